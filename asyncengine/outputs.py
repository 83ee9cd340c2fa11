"""What `generate()` returns: one `RequestOutput` per request, cumulative so far."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from asyncengine.core.request import FinishReason

__all__ = [
    "CompletionOutput",
    "FinishReason",
    "Logprob",
    "Logprobs",
    "RawLogprobs",
    "RequestMetrics",
    "RequestOutput",
    "merge_deltas",
]


class Logprob(msgspec.Struct, array_like=True):
    """One token's score at one position (vLLM's `Logprob`): its log probability, its rank
    among the vocabulary (1 is the likeliest), and its own text (the token decoded alone)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class RawLogprobs:
    """One position's scores as the sampler makes them: the sampled (or prompt) token's rank
    among the vocabulary, and token id -> logprob for it and the top-n alternatives."""

    token_id: int
    rank: int
    logprobs: dict[int, float]


# the same as outputs carry them (vLLM's `SampleLogprobs` / `PromptLogprobs` entries)
Logprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request: text and token ids generated so far (or, for a DELTA output,
    since the last output its caller took)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Logprobs] | None = None
    finish: FinishReason | None = None  # why the sample ended; None while it runs
    # the stop string or stop token id that ended the sample (None for eos or length)
    stop_reason: str | int | None = None
    # the sum of the sampled tokens' logprobs so far, when `SamplingParams.logprobs` is set
    cumulative_logprob: float | None = None

    @property
    def finish_reason(self) -> str | None:
        """vLLM's string: "stop" | "length" | "abort" | "error"; None while running."""
        return None if self.finish is None else self.finish.vllm_name

    @property
    def is_finished(self) -> bool:
        return self.finish is not None

    def extend(self, later: CompletionOutput) -> None:
        """Append a later DELTA of the same sample to this one."""
        self.text += later.text
        self.token_ids = self.token_ids + later.token_ids
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        self.finish, self.stop_reason = later.finish, later.stop_reason
        self.cumulative_logprob = later.cumulative_logprob


@dataclass(slots=True)
class RequestMetrics:
    """Timings (time.monotonic seconds) and counts of one request, for usage reports."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0  # of the longest sample, so far (whatever the output kind)


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after a step; `finished` is True on its last output."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None  # why it failed, when it ended rejected or with an error
    metrics: RequestMetrics | None = None
    # with SamplingParams.prompt_logprobs: one entry per prompt token, the first None; set
    # once the whole prompt is scored (a DELTA stream carries it once)
    prompt_logprobs: list[Logprobs | None] | None = None

    @classmethod
    def aborted(
        cls,
        request_id: str,
        num_samples: int,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> RequestOutput:
        """The final output of a request aborted before the engine stepped it: no tokens."""
        samples = [
            CompletionOutput(i, "", [], finish=FinishReason.ABORTED) for i in range(num_samples)
        ]
        return cls(request_id, prompt, prompt_token_ids or [], samples, finished=True)

    def extend(self, later: RequestOutput) -> None:
        """Merge a later DELTA output of the same request into this one, which the caller
        has not taken yet: nothing is lost, and the pending outputs stay one."""
        by_index = {c.index: c for c in self.outputs}
        for completion in later.outputs:
            if completion.index in by_index:
                by_index[completion.index].extend(completion)
            else:
                self.outputs.append(completion)
        self.outputs.sort(key=lambda c: c.index)
        self.finished, self.error, self.metrics = later.finished, later.error, later.metrics
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs


def merge_deltas(out: RequestOutput, later: list[RequestOutput]) -> None:
    """Merge later DELTA outputs of a request into `out`, as `RequestOutput.extend` one by one
    would, with each sample's text and tokens joined once (not copied per output)."""
    by_index: dict[int, list[CompletionOutput]] = {c.index: [c] for c in out.outputs}
    for each in later:
        for completion in each.outputs:
            by_index.setdefault(completion.index, []).append(completion)
    merged = []
    for index in sorted(by_index):
        parts = by_index[index]
        first, last = parts[0], parts[-1]
        if len(parts) > 1:
            first.text = "".join([part.text for part in parts])
            first.token_ids = [token for part in parts for token in part.token_ids]
            if any(part.logprobs is not None for part in parts):
                first.logprobs = [entry for part in parts for entry in part.logprobs or ()]
            first.finish, first.stop_reason = last.finish, last.stop_reason
            first.cumulative_logprob = last.cumulative_logprob
        merged.append(first)
    out.outputs = merged
    final = later[-1]
    out.finished, out.error, out.metrics = final.finished, final.error, final.metrics
    for each in later:
        if each.prompt_logprobs is not None:
            out.prompt_logprobs = each.prompt_logprobs
