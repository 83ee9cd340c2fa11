"""Per-request output state: each sample's text (detokenized incrementally), stop strings, and
the `RequestOutput` a caller sees (cumulative, or only what is new)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from asyncengine.core.request import FinishReason, Request
from asyncengine.engine.detokenizer import Decode, Detokenizer, NewDetokenizer
from asyncengine.outputs import (
    CompletionOutput,
    Logprob,
    Logprobs,
    RawLogprobs,
    RequestMetrics,
    RequestOutput,
)
from asyncengine.sampling_params import RequestOutputKind

FinishRequest = Callable[[Request, FinishReason], None]


class TokenTexts:
    """Scores as outputs carry them: `Logprob`s with each token's rank and own text (vLLM's
    `decoded_token`, the decode of that token alone), each text decoded once per engine."""

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._decode([token_id], False)
        return text

    def logprobs(self, raw: RawLogprobs) -> Logprobs:
        """The sampler's entry: the top n ranked by their order, likeliest first, and the
        sampled (or prompt) token by its rank among the vocabulary, whether in the top n or
        not (as vLLM ranks them)."""
        ordered = sorted(raw.logprobs.items(), key=lambda kv: kv[1], reverse=True)
        entry = {t: Logprob(lp, i + 1, self.text(t)) for i, (t, lp) in enumerate(ordered)}
        entry[raw.token_id].rank = raw.rank
        return entry


@dataclass
class _Sample:
    req: Request
    detokenizer: Detokenizer
    text: str = ""
    logprobs: list[Logprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0  # of the sampled tokens, when logprobs are asked for
    num_seen_tokens: int = 0  # of the sequence's tokens, those detokenized and stop-checked
    # what DELTA outputs have carried so far
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    is_finish_sent: bool = False  # its last DELTA went out: later outputs leave it out


class RequestState:
    """What the engine keeps of one caller's request besides the scheduler's: its samples' text.

    `request_id` is the caller's id; the scheduler knows the request by the engine's own ids.
    A request with `n > 1` is one scheduler request per sample (sample 0 is the request
    itself, the others are forked from it once its prompt is computed); they all report here.
    """

    def __init__(
        self,
        request_id: str,
        req: Request,
        prompt: str | None,
        new_detokenizer: NewDetokenizer,
        token_texts: TokenTexts,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.new_detokenizer = new_detokenizer
        self.token_texts = token_texts
        self.parent = req
        self.samples: dict[int, _Sample] = {}
        self.is_ended = False  # aborted or failed: over, whichever samples exist by then
        # the prompt's scores so far (the first token has none), when the caller asked
        self.prompt_logprobs: list[Logprobs | None] | None = None
        if req.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        self.is_prompt_logprobs_sent = False
        self.add_sample(req)

    @property
    def group_id(self) -> str:
        return self.parent.group_id

    def add_sample(self, req: Request) -> None:
        skip = req.sampling_params.skip_special_tokens
        detokenizer = self.new_detokenizer(req.prompt_token_ids, skip)
        self.samples[req.sample_index] = _Sample(
            req, detokenizer, num_seen_tokens=req.num_prompt_tokens
        )

    @property
    def is_finished(self) -> bool:
        if self.is_ended:
            return True
        # before the fork only sample 0 exists; a parent that ended then has no samples to wait on
        expected = 1 if self.parent.num_pending_samples else self.parent.sampling_params.n
        if len(self.samples) != expected:
            return False
        if expected == 1:  # no generator for the common case: this runs every step
            return self.samples[0].req.is_finished
        return all(sample.req.is_finished for sample in self.samples.values())

    def on_token(
        self, req: Request, logprobs: list[RawLogprobs] | None, finish: FinishRequest
    ) -> None:
        """Take a sample's new tokens (one, or a run of accepted speculative drafts and the
        token after them; `logprobs` one entry each, when asked for): detokenize each and end
        the sample on a stop string, at the token that completed it (later ones are dropped)."""
        sample = self.samples.get(req.sample_index)
        if sample is None:  # a forked sample's first token
            self.add_sample(req)
            sample = self.samples[req.sample_index]
        first = sample.num_seen_tokens
        for i in range(req.num_tokens - first):
            if logprobs is not None:
                sample.logprobs.append(self.token_texts.logprobs(logprobs[i]))
                sample.cumulative_logprob += logprobs[i].logprobs[logprobs[i].token_id]
            if self._take_token(sample, req, first + i + 1, finish):
                del req.token_ids[first + i + 1 :]
                break
        sample.num_seen_tokens = req.num_tokens

    @staticmethod
    def _take_token(sample: _Sample, req: Request, end: int, finish: FinishRequest) -> bool:
        """Detokenize `req`'s tokens up to `end`; whether a stop string ended the sample."""
        is_last = end == req.num_tokens
        token_ids = req.token_ids if is_last else req.token_ids[:end]
        delta = sample.detokenizer.decode_next(token_ids, req.is_finished and is_last)
        if delta:
            sample.text += delta
        params = req.sampling_params
        if not params.stop or end - req.num_prompt_tokens < params.min_tokens:
            return False
        longest = max(len(s) for s in params.stop)
        start = max(0, len(sample.text) - len(delta) - longest + 1)
        hits = [(i, s) for s in params.stop if (i := sample.text.find(s, start)) != -1]
        if not hits:
            return False
        index, stop = min(hits)
        sample.text = sample.text[: index + (len(stop) if params.include_stop_str_in_output else 0)]
        req.stop_reason = stop
        if req.is_finished:  # a stop string wins over a finish by length in the same step
            req.finish_reason = FinishReason.STOP_STRING
            req.status = req.finish_reason.status
        else:
            finish(req, FinishReason.STOP_STRING)
        return True

    def on_prompt_logprobs(self, first_index: int, entries: list[RawLogprobs]) -> None:
        """Scores of prompt tokens from `first_index` on; a recomputed prefill scores again
        what it scored before, and only what is new is kept."""
        scored = self.prompt_logprobs
        if scored is not None and first_index <= len(scored):
            new = entries[len(scored) - first_index :]
            scored += [self.token_texts.logprobs(entry) for entry in new]

    def _prompt_logprobs_to_send(self, is_delta: bool) -> list[Logprobs | None] | None:
        scored = self.prompt_logprobs
        if scored is None or len(scored) < self.parent.num_prompt_tokens:
            return None
        if is_delta and self.is_prompt_logprobs_sent:
            return None
        self.is_prompt_logprobs_sent = True
        return scored

    def make_output(self) -> RequestOutput | None:
        """The output the caller gets after this step; None when it wants nothing yet."""
        kind = self.parent.sampling_params.output_kind
        is_finished = self.is_finished
        if kind is RequestOutputKind.FINAL_ONLY and not is_finished:
            return None
        is_delta = kind is RequestOutputKind.DELTA
        parent = self.parent
        samples = self.samples
        if len(samples) == 1:  # n == 1, or before the fork: no merging or sorting
            only = samples[0].req
            outputs = [_completion(samples[0], is_delta)]
            finished_time, num_preemptions = only.finished_time, only.num_preemptions
            num_output_tokens = len(only.token_ids) - only.num_prompt_tokens
        else:  # a DELTA carries the samples still going and those that end now
            outputs = [
                _completion(samples[i], is_delta)
                for i in sorted(samples)
                if not samples[i].is_finish_sent
            ]
            finished_time = max(s.req.finished_time or 0.0 for s in samples.values())
            num_preemptions = sum(s.req.num_preemptions for s in samples.values())
            num_output_tokens = max(s.req.num_output_tokens for s in samples.values())
        if is_finished and len(samples) < parent.sampling_params.n:
            # samples never forked (the request ended before its prompt was computed) end
            # with it, empty: a caller always gets n final samples
            params = parent.sampling_params
            no_logprobs: list[Logprobs] | None = None if params.logprobs is None else []
            missing = [i for i in range(params.n) if i not in samples]
            outputs += [
                CompletionOutput(i, "", [], no_logprobs, parent.finish_reason) for i in missing
            ]
            outputs.sort(key=lambda c: c.index)
        metrics = RequestMetrics(
            arrival_time=parent.arrival_time,
            first_scheduled_time=parent.first_scheduled_time,
            first_token_time=parent.first_token_time,
            finished_time=(finished_time or 0.0) if is_finished else None,
            num_preemptions=num_preemptions,
            num_cached_tokens=parent.num_cached_tokens,
            num_output_tokens=num_output_tokens,
        )
        prompt_logprobs = None
        if self.prompt_logprobs is not None:
            prompt_logprobs = self._prompt_logprobs_to_send(is_delta)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outputs,
            finished=is_finished,
            error=parent.error,
            metrics=metrics,
            prompt_logprobs=prompt_logprobs,
        )


def _completion(sample: _Sample, is_delta: bool) -> CompletionOutput:
    req, params, text = sample.req, sample.req.sampling_params, sample.text
    if params.stop and not req.is_finished:
        # hold back what may be the start of a stop string still being completed
        hold = max(len(s) for s in params.stop) - 1
        text = text[: max(0, len(text) - hold)]
    logprobs = None
    cumulative_logprob = None if params.logprobs is None else sample.cumulative_logprob
    if is_delta:
        # what is visible only grows: a stop string is found before its start is shown
        start_char, start_token = sample.num_sent_chars, sample.num_sent_tokens
        token_ids = req.token_ids[req.num_prompt_tokens + start_token :]
        sample.num_sent_chars = max(start_char, len(text))
        sample.num_sent_tokens = start_token + len(token_ids)
        text = text[start_char:]
        if params.logprobs is not None:
            logprobs = sample.logprobs[start_token:]
        sample.is_finish_sent = req.is_finished
    else:
        token_ids = req.output_token_ids
        if params.logprobs is not None:
            logprobs = list(sample.logprobs)
    return CompletionOutput(
        index=req.sample_index,
        text=text,
        token_ids=token_ids,
        logprobs=logprobs,
        finish=req.finish_reason,
        stop_reason=req.stop_reason,
        cumulative_logprob=cumulative_logprob,
    )
