"""vLLM's prompt types (`vllm.inputs`): a prompt is text, token ids, or a dict saying which.

`LLM.generate` and `AsyncLLMEngine.generate` take any of them; `parse_prompt` turns each into
what the engine queues, once, at the boundary.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NotRequired, TypedDict, TypeVar

from asyncengine.errors import InvalidRequestError

__all__ = ["ParsedPrompt", "PromptType", "TextPrompt", "TokensPrompt", "parse_prompt"]


class TextPrompt(TypedDict):
    """A text prompt, encoded by the model's tokenizer (vLLM's `TextPrompt`)."""

    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """A prompt already tokenized (vLLM's `TokensPrompt`); `prompt`, if given, is only the
    text that `RequestOutput.prompt` shows for it."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


# a plain list of token ids is this engine's own form, kept beside vLLM's
PromptType = str | list[int] | TextPrompt | TokensPrompt

T = TypeVar("T")
_TEXT_KEYS = frozenset(TextPrompt.__annotations__)
_TOKENS_KEYS = frozenset(TokensPrompt.__annotations__)


@dataclass(frozen=True, slots=True)
class ParsedPrompt:
    """What the engine queues for one prompt."""

    prompt: str | list[int]  # text to encode, or the token ids themselves
    # what outputs show as `prompt` for token ids (a TokensPrompt's `prompt`); text shows itself
    text: str | None = None
    cache_salt: str | None = None


def parse_prompt(prompt: object, cache_salt: str | None = None) -> ParsedPrompt:
    """The prompt in the engine's terms; a dict with a key neither TypedDict has, or of the
    wrong type, raises `InvalidRequestError` ("prompt") naming it.

    `cache_salt` is the caller's argument; a dict may carry its own, not both.
    """
    if isinstance(prompt, str):
        return ParsedPrompt(prompt, None, cache_salt)
    if isinstance(prompt, list):
        return ParsedPrompt(prompt, None, cache_salt)
    if isinstance(prompt, Iterable) and not isinstance(prompt, Mapping | bytes):
        return ParsedPrompt(list(prompt), None, cache_salt)  # a tuple, a protobuf repeated field
    if not isinstance(prompt, Mapping):
        raise InvalidRequestError(
            "prompt",
            f"must be a str, a list of token ids, a TextPrompt or a TokensPrompt dict, "
            f"got {type(prompt).__name__}",
        )
    is_tokens = "prompt_token_ids" in prompt
    allowed = _TOKENS_KEYS if is_tokens else _TEXT_KEYS
    unknown = sorted(str(k) for k in prompt if k not in allowed)
    if unknown:
        kind = "TokensPrompt" if is_tokens else "TextPrompt"
        raise InvalidRequestError(
            "prompt",
            f"unknown key {unknown[0]!r} in a {kind} dict (it takes {', '.join(sorted(allowed))})",
        )
    if "cache_salt" in prompt:
        if cache_salt is not None:
            raise InvalidRequestError("cache_salt", "given both in the prompt dict and apart")
        cache_salt = _typed(prompt, "cache_salt", str)
    if is_tokens:
        token_ids = _typed(prompt, "prompt_token_ids", list)
        text = _typed(prompt, "prompt", str) if "prompt" in prompt else None
        return ParsedPrompt(token_ids, text, cache_salt)
    if "prompt" not in prompt:
        raise InvalidRequestError("prompt", "a prompt dict needs 'prompt' or 'prompt_token_ids'")
    return ParsedPrompt(_typed(prompt, "prompt", str), None, cache_salt)


def _typed(prompt: Mapping[object, object], key: str, kind: type[T]) -> T:
    value = prompt[key]
    if not isinstance(value, kind):
        raise InvalidRequestError(
            "prompt", f"{key!r} must be a {kind.__name__}, got {type(value).__name__}"
        )
    return value
