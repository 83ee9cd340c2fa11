"""Incremental detokenization: text deltas that never split a UTF-8 character."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from tokenizers.decoders import DecodeStream

# decode a few prompt tokens along with the first output so tokenizers that drop a
# leading space on a lone token (SentencePiece) still produce the right first delta
_PROMPT_CONTEXT_TOKENS = 5

Decode = Callable[[list[int], bool], str]  # (token ids, skip_special_tokens) -> text


class Detokenizer(Protocol):
    """One sample's text, a delta at a time."""

    def decode_next(self, token_ids: list[int], is_final: bool = False) -> str: ...


# (prompt token ids, skip_special_tokens) -> a detokenizer for one sample
NewDetokenizer = Callable[[list[int], bool], Detokenizer]


def make_detokenizer(tokenizer: Any) -> NewDetokenizer:
    """The fastest detokenizer that gives exactly the text `tokenizer.decode` gives.

    A fast tokenizer's own `DecodeStream` decodes each new token with one call into Rust;
    otherwise (a slow tokenizer, one that cleans up spaces, or a tokenizers release whose
    `DecodeStream` takes no prompt ids) `IncrementalDetokenizer` decodes twice per token.
    """
    decode = make_decode(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        backend is None
        or getattr(tokenizer, "clean_up_tokenization_spaces", False)
        or not _has_decode_stream()
    ):
        return lambda prompt, skip: IncrementalDetokenizer(decode, prompt, skip)
    return lambda prompt, skip: StreamDetokenizer(backend, decode, prompt, skip)


def _has_decode_stream() -> bool:
    try:
        DecodeStream(ids=[], skip_special_tokens=True)  # `ids`: not in the first releases
    except TypeError:
        return False
    return True


def make_decode(tokenizer: Any) -> Decode:
    """The cheapest call that decodes exactly as `tokenizer.decode` does.

    A fast tokenizer's Rust backend decodes directly; the transformers wrapper around it costs
    several times more per call, and the step loop decodes twice per request per step.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids, skip: str(tokenizer.decode(ids, skip_special_tokens=skip))
    return lambda ids, skip: str(backend.decode(ids, skip_special_tokens=skip))


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas (the prefix/read offsets of TGI, vLLM).

    The window `[prefix_offset, read_offset)` is text already emitted; decoding it and the
    window extended by the new tokens gives the new text as the difference. A delta that ends
    in U+FFFD is a multi-byte character still being completed: it waits for the next token.
    """

    def __init__(self, decode: Decode, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.decode = decode
        self.skip_special_tokens = skip_special_tokens
        self.read_offset = len(prompt_token_ids)
        self.prefix_offset = max(self.read_offset - _PROMPT_CONTEXT_TOKENS, 0)

    def decode_next(self, token_ids: list[int], is_final: bool = False) -> str:
        """The text the tokens after `read_offset` add; on the final call, whatever remains."""
        skip = self.skip_special_tokens
        prefix_text = self.decode(token_ids[self.prefix_offset : self.read_offset], skip)
        new_text = self.decode(token_ids[self.prefix_offset :], skip)
        if len(new_text) <= len(prefix_text) and not is_final:
            return ""
        if new_text.endswith("\ufffd") and not is_final:
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return new_text[len(prefix_text) :]


class StreamDetokenizer:
    """The same deltas as `IncrementalDetokenizer`, from tokenizers' `DecodeStream` (the same
    prefix/read offsets, kept in Rust): one call per token instead of two decodes."""

    def __init__(
        self, backend: Any, decode: Decode, prompt_token_ids: list[int], skip_special_tokens: bool
    ) -> None:
        self.backend = backend
        self.decode = decode
        self.skip_special_tokens = skip_special_tokens
        self.stream = DecodeStream(ids=prompt_token_ids, skip_special_tokens=skip_special_tokens)
        self.num_fed = len(prompt_token_ids)  # tokens given to the stream
        self.num_shown = self.num_fed  # tokens whose text has been returned

    def decode_next(self, token_ids: list[int], is_final: bool = False) -> str:
        new = token_ids[self.num_fed :]
        self.num_fed = len(token_ids)
        text = self.stream.step(self.backend, new[0] if len(new) == 1 else new)
        if text is not None:
            self.num_shown = self.num_fed
            return str(text)
        if is_final and self.num_shown < self.num_fed:
            # the sequence ends inside a character: show what a full decode shows for it
            start = max(self.num_shown - _PROMPT_CONTEXT_TOKENS, 0)
            skip = self.skip_special_tokens
            shown = self.decode(token_ids[start : self.num_shown], skip)
            return self.decode(token_ids[start:], skip)[len(shown) :]
        return ""
