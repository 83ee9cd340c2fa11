"""Incremental detokenization: each sample's text is its own tokens' text, in deltas that never
split a UTF-8 character and never show what a later token would change."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tokenizers.decoders import DecodeStream

# tokens of text already shown that a final decode starts from, so that it never splits a
# character the shown text ended with
_WINDOW_TOKENS = 5
# plain texts whose token can stand before the output in the prompt's place (see _context_ids)
_CONTEXT_TEXTS = ("a", "0", ".", "x")
# SentencePiece's byte-fallback pieces; tokenizers' ByteFallback decoder reads them the same way
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")

Decode = Callable[[list[int], bool], str]  # (token ids, skip_special_tokens) -> text


class Detokenizer(Protocol):
    """One sample's text, a delta at a time."""

    def decode_next(self, token_ids: list[int], is_final: bool = False) -> str: ...


# (prompt token ids, skip_special_tokens) -> a detokenizer for one sample
NewDetokenizer = Callable[[list[int], bool], Detokenizer]


@dataclass(frozen=True)
class Vocab:
    """What every sample's detokenizer needs of the tokenizer, worked out once."""

    context_ids: tuple[int, ...]  # decoded before the output (see _context_ids)
    byte_ids: frozenset[int]  # byte-fallback tokens
    special_ids: frozenset[int]

    def num_settled(self, token_ids: list[int], start: int, skip_special_tokens: bool) -> int:
        """The end of the tokens (from `start` on) whose text no later token changes.

        A run of byte-fallback tokens decodes as one: valid UTF-8, or one U+FFFD per byte, so
        a byte token yet to come can turn shown text into U+FFFD. The run waits for the next
        other token (a skipped special token does not end it: the decoder never sees it).
        """
        end = len(token_ids)
        if not self.byte_ids:
            return end
        i = end - 1
        while i >= start and skip_special_tokens and token_ids[i] in self.special_ids:
            i -= 1
        if i < start or token_ids[i] not in self.byte_ids:
            return end
        while i >= start and (
            token_ids[i] in self.byte_ids
            or (skip_special_tokens and token_ids[i] in self.special_ids)
        ):
            i -= 1
        return i + 1 if i >= start else start

    def window(
        self, token_ids: list[int], num_prompt_tokens: int, start: int, end: int | None = None
    ) -> list[int]:
        """`token_ids[start:end]`, after the context tokens when it starts the output."""
        ids = token_ids[start:end]
        return list(self.context_ids) + ids if start == num_prompt_tokens else ids


def make_vocab(tokenizer: Any, decode: Decode) -> Vocab:
    """The tokenizer's context token, byte-fallback tokens and special tokens."""
    special = frozenset(getattr(tokenizer, "all_special_ids", ()))
    pieces = tokenizer.get_vocab()
    byte_ids = frozenset(
        i for p, i in pieces.items() if p.startswith("<0x") and _BYTE_PIECE.fullmatch(p)
    )
    return Vocab(tuple(_context_ids(tokenizer, decode, special | byte_ids)), byte_ids, special)


def _context_ids(tokenizer: Any, decode: Decode, excluded: frozenset[int]) -> list[int]:
    """One plain ASCII token that the output is decoded after, in the prompt's place.

    The output's text is its own tokens' text: decoded after the prompt, a character the
    prompt leaves unfinished would be completed by the output's first bytes, and the prompt's
    text (all of it, in `DecodeStream`) leaks into the first delta. Decoded alone, a
    SentencePiece first token loses its leading space (a completion of "Close the" would read
    "door", not " door"); after this token it keeps it, as vLLM's text does.
    """
    for text in _CONTEXT_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if ids and ids[-1] not in excluded:
            shown = decode(ids[-1:], True)
            if shown and shown.isascii() and shown.isprintable() and not shown.isspace():
                return ids[-1:]
    return []  # the output decoded alone: its text still, less a SentencePiece leading space


def make_detokenizer(tokenizer: Any) -> NewDetokenizer:
    """The fastest detokenizer that gives exactly the text `tokenizer.decode` gives.

    A fast tokenizer's own `DecodeStream` decodes each new token with one call into Rust;
    otherwise (a slow tokenizer, one that cleans up spaces, or a tokenizers release whose
    `DecodeStream` takes no prompt ids) `IncrementalDetokenizer` decodes twice per token.
    """
    decode = make_decode(tokenizer)
    vocab = make_vocab(tokenizer, decode)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        backend is None
        or getattr(tokenizer, "clean_up_tokenization_spaces", False)
        or not _has_decode_stream()
    ):
        return lambda prompt, skip: IncrementalDetokenizer(decode, vocab, len(prompt), skip)
    return lambda prompt, skip: StreamDetokenizer(backend, decode, vocab, len(prompt), skip)


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

    The window `[prefix_offset, read_offset)` of the output is text already emitted (at first,
    the context token alone); decoding it and the window extended by the new tokens gives the
    new text as the difference. A delta that ends in U+FFFD is a multi-byte character still
    being completed: it waits for the next token.
    """

    def __init__(
        self, decode: Decode, vocab: Vocab, num_prompt_tokens: int, skip_special_tokens: bool
    ) -> None:
        self.decode = decode
        self.vocab = vocab
        self.num_prompt_tokens = num_prompt_tokens
        self.skip_special_tokens = skip_special_tokens
        # in `token_ids`; the prompt's tokens are never decoded
        self.prefix_offset = self.read_offset = num_prompt_tokens

    def decode_next(self, token_ids: list[int], is_final: bool = False) -> str:
        """The text the tokens after `read_offset` add; on the final call, whatever remains."""
        skip = self.skip_special_tokens
        end = len(token_ids)
        if not is_final:
            end = self.vocab.num_settled(token_ids, self.read_offset, skip)
            if end <= self.read_offset:
                return ""
        num_prompt, start = self.num_prompt_tokens, self.prefix_offset
        prefix_text = self.decode(
            self.vocab.window(token_ids, num_prompt, start, self.read_offset), skip
        )
        new_text = self.decode(self.vocab.window(token_ids, num_prompt, start, end), skip)
        if len(new_text) <= len(prefix_text) and not is_final:
            return ""
        if new_text.endswith("\ufffd") and not is_final:
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, end
        return new_text[len(prefix_text) :]


class StreamDetokenizer:
    """The same deltas as `IncrementalDetokenizer`, from tokenizers' `DecodeStream` (the same
    prefix/read offsets, kept in Rust): one call per token instead of two decodes."""

    def __init__(
        self,
        backend: Any,
        decode: Decode,
        vocab: Vocab,
        num_prompt_tokens: int,
        skip_special_tokens: bool,
    ) -> None:
        self.backend = backend
        self.decode = decode
        self.vocab = vocab
        self.num_prompt_tokens = num_prompt_tokens
        self.skip_special_tokens = skip_special_tokens
        # seeded with the context token, never the prompt: a long prompt costs nothing here
        self.stream = DecodeStream(
            ids=list(vocab.context_ids), skip_special_tokens=skip_special_tokens
        )
        self.num_fed = num_prompt_tokens  # of `token_ids`, those given to the stream
        self.num_shown = num_prompt_tokens  # of `token_ids`, those whose text was returned

    def decode_next(self, token_ids: list[int], is_final: bool = False) -> str:
        end = len(token_ids)
        if not is_final:
            end = self.vocab.num_settled(token_ids, self.num_fed, self.skip_special_tokens)
        new = token_ids[self.num_fed : end]
        if new:
            self.num_fed = end
            text = self.stream.step(self.backend, new[0] if len(new) == 1 else new)
            if text is not None:
                self.num_shown = self.num_fed
                return str(text)
        if is_final and self.num_shown < len(token_ids):
            # the sequence ends inside a character: show what a full decode shows for it
            num_prompt, skip = self.num_prompt_tokens, self.skip_special_tokens
            start = max(self.num_shown - _WINDOW_TOKENS, num_prompt)
            shown = self.decode(
                self.vocab.window(token_ids, num_prompt, start, self.num_shown), skip
            )
            return self.decode(self.vocab.window(token_ids, num_prompt, start), skip)[len(shown) :]
        return ""
