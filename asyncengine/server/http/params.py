"""Translation between OpenAI's fields and the engine's: sampling parameters, field names in
errors, finish reasons and logprobs. No HTTP here and no checks of values: the engine's."""

from __future__ import annotations

from typing import Any

from asyncengine.engine.async_llm_engine import AsyncLLMEngine
from asyncengine.errors import ContextLengthError, DuplicateRequestError, InvalidRequestError
from asyncengine.outputs import FinishReason, Logprobs
from asyncengine.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from asyncengine.server.http import protocol
from asyncengine.server.http.errors import ContextLengthExceededError, InvalidParamError

# the engine's field -> the OpenAI field it comes from ("prompts": the server's own count)
COMPLETION_PARAMS = {
    "prompt": "prompt",
    "prompts": "prompt",
    "request_id": "x-request-id",
    "cache_salt": "cache_salt",
    "n": "n",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "max_tokens": "max_tokens",
    "min_tokens": "min_tokens",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "logit_bias": "logit_bias",
    "ignore_eos": "ignore_eos",
    "include_stop_str_in_output": "include_stop_str_in_output",
    "logprobs": "logprobs",
    "prompt_logprobs": "logprobs",  # echo scores the prompt with the same k
    "skip_special_tokens": "skip_special_tokens",
    "truncate_prompt_tokens": "truncate_prompt_tokens",
    "allowed_token_ids": "allowed_token_ids",
    # a constraint's fields (structured_outputs.regex, ...) are named by fields.constraint
}
CHAT_PARAMS = {
    **COMPLETION_PARAMS,
    "prompt": "messages",
    "prompts": "messages",
    "logprobs": "top_logprobs",
}
# decided once here: the engine's reason -> OpenAI's finish_reason (vLLM's words for the rest)
FINISH_REASONS = {
    FinishReason.EOS: "stop",
    FinishReason.STOP_STRING: "stop",
    FinishReason.STOP_TOKEN: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CONTEXT_LIMIT: "length",
    FinishReason.CACHE_LIMIT: "length",
    FinishReason.ABORTED: "abort",
    FinishReason.REJECTED: "error",
    FinishReason.ERROR: "error",
}
_MIN_LOGPROB = -9999.0  # JSON has no -inf


def param_error(
    exc: InvalidRequestError, table: dict[str, str], prefix: str = ""
) -> InvalidRequestError:
    """The engine's error named by the OpenAI field it came from; `prefix` says which prompt
    of a batch (`prompt[2]`) in the message. A duplicate id stays what it is (409)."""
    if isinstance(exc, InvalidParamError | DuplicateRequestError):
        return exc
    name = table.get(exc.field, exc.field)
    where = f"{prefix} " if prefix else ""
    kind = ContextLengthExceededError if isinstance(exc, ContextLengthError) else InvalidParamError
    error = kind(name, where + exc.description)
    error.__cause__ = exc
    return error


def finish_reason(finish: FinishReason | None) -> str | None:
    return None if finish is None else FINISH_REASONS[finish]


def sampling_params(
    request: protocol.CompletionRequest | protocol.ChatRequest,
    max_tokens: int | None,
    logprobs: int | None,
    output_kind: RequestOutputKind,
    structured_outputs: StructuredOutputsParams | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The engine's parameters for a request (OpenAI's defaults for the fields left out);
    `structured_outputs` is `fields.constraint`'s.

    A bad value raises the engine's `InvalidRequestError`; `param_error` names the field.
    """
    top_k = request.top_k
    return SamplingParams(
        n=1 if request.n is None else request.n,
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        temperature=_or(request.temperature, 1.0),
        top_p=_or(request.top_p, 1.0),
        top_k=0 if top_k is None or top_k == -1 else top_k,  # vLLM's -1: no top-k
        min_p=_or(request.min_p, 0.0),
        seed=request.seed,
        repetition_penalty=_or(request.repetition_penalty, 1.0),
        presence_penalty=_or(request.presence_penalty, 0.0),
        frequency_penalty=_or(request.frequency_penalty, 0.0),
        stop=[request.stop] if isinstance(request.stop, str) else request.stop or [],
        stop_token_ids=request.stop_token_ids or [],
        ignore_eos=request.ignore_eos,
        include_stop_str_in_output=request.include_stop_str_in_output,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        truncate_prompt_tokens=request.truncate_prompt_tokens,
        skip_special_tokens=request.skip_special_tokens,
        logit_bias=_logit_bias(request.logit_bias),
        allowed_token_ids=request.allowed_token_ids,
        output_kind=output_kind,
        structured_outputs=structured_outputs,
    )


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    if len(bias) > 4096:  # the engine bounds the count; this bounds the parsing before it
        raise InvalidParamError("logit_bias", f"at most 4096 entries, got {len(bias)}")
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise InvalidParamError("logit_bias", "keys must be token ids (as strings)") from None


class TokenTexts:
    """Each token id's text (the decoding of that token alone), cached for the vocabulary.

    Logprobs name tokens by text; a few thousand of them per response would otherwise be a
    decode each. The raw tokens come from the engine's tokenizer thread, their text from the
    tokenizer's decoder (which does not touch the encoder's state).
    """

    def __init__(self, engine: AsyncLLMEngine) -> None:
        self._engine = engine
        self._tokenizer = engine.get_tokenizer()
        self._texts: dict[int, str] = {}
        self.special_ids = frozenset(getattr(self._tokenizer, "all_special_ids", ()))

    async def __call__(self, token_ids: list[int]) -> list[str]:
        missing = sorted({t for t in token_ids if t not in self._texts})
        if missing:
            tokens = await self._engine.convert_ids_to_tokens(missing)
            for token_id, token in zip(missing, tokens):
                self._texts[token_id] = str(self._tokenizer.convert_tokens_to_string([token]))
        return [self._texts[t] for t in token_ids]

    async def of_entries(self, token_ids: list[int], entries: list[Any]) -> None:
        """Make sure the texts of `token_ids` and every id in `entries` are cached."""
        ids = list(token_ids)
        for entry in entries:
            if entry:
                ids += list(entry)
        await self(ids)

    def text(self, token_id: int) -> str:
        return self._texts[token_id]

    async def hidden_in(self, text: str, token_ids: list[int]) -> list[bool]:
        """Which of `token_ids`, whose text is `text`, show nothing in it: the special tokens
        a tokenizer adds to a text prompt (its BOS), which the prompt's text never held."""
        await self(token_ids)
        hidden, at = [], 0
        for token_id in token_ids:
            token = self._texts[token_id]
            is_hidden = token_id in self.special_ids and not text.startswith(token, at)
            hidden.append(is_hidden)
            at += 0 if is_hidden else len(token)
        return hidden

    def skipped(self, token_ids: list[int], skip_special_tokens: bool) -> list[bool]:
        """Which of a sample's `token_ids` its text leaves out (`skip_special_tokens`)."""
        return [skip_special_tokens and t in self.special_ids for t in token_ids]


def clamp(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def ranked(entry: Logprobs, num_top: int) -> list[tuple[int, float]]:
    """The `num_top` most likely (token id, logprob) pairs of one position's entry."""
    pairs = [(t, lp.logprob) for t, lp in entry.items()]
    return sorted(pairs, key=lambda kv: kv[1], reverse=True)[:num_top]


async def completion_logprobs(
    texts: TokenTexts,
    token_ids: list[int],
    entries: list[Logprobs | None],
    num_top: int,
    text_offset: int,
    hidden: list[bool],
) -> protocol.CompletionLogprobs:
    """OpenAI's legacy logprobs of tokens whose text starts at `text_offset` in the choice's
    text; a token `hidden` from that text (a BOS, a skipped special token) takes up none of
    it. An entry of None (the first prompt token: nothing before it) scores nothing."""
    await texts.of_entries(token_ids, entries)
    out = protocol.CompletionLogprobs()
    for token_id, entry, is_hidden in zip(token_ids, entries, hidden, strict=True):
        token = texts.text(token_id)
        out.tokens.append(token)
        out.text_offset.append(text_offset)
        text_offset += 0 if is_hidden else len(token)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(clamp(entry[token_id].logprob))
        # the position's top k with the token itself, as vLLM returns them (k or k + 1)
        top = ranked(entry, num_top)
        if all(t != token_id for t, _ in top):
            top.append((token_id, entry[token_id].logprob))
        by_text: dict[str, float] = {}
        for t, lp in top:  # tokens of one text (partial characters): the likeliest stands
            by_text.setdefault(texts.text(t), clamp(lp))
        out.top_logprobs.append(by_text)
    return out


async def chat_logprobs(
    texts: TokenTexts, token_ids: list[int], entries: list[Logprobs], num_top: int
) -> protocol.ChatLogprobs:
    """Chat logprobs: each sampled token with its logprob and the top `num_top` alternatives."""
    await texts.of_entries(token_ids, entries)
    content = []
    for token_id, entry in zip(token_ids, entries):
        token = texts.text(token_id)
        top = [
            protocol.TopLogprob(
                token=texts.text(t), logprob=clamp(lp), bytes=list(texts.text(t).encode())
            )
            for t, lp in ranked(entry, num_top)
        ]
        content.append(
            protocol.TokenLogprob(
                token=token,
                logprob=clamp(entry[token_id].logprob),
                bytes=list(token.encode()),
                top_logprobs=top,
            )
        )
    return protocol.ChatLogprobs(content=content)
