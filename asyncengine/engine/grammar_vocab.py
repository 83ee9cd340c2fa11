r"""The vocabulary as xgrammar matches it, so that what a grammar accepts is the sample's text.

Two gaps between xgrammar (0.2.9) and the text a sample decodes to are closed here, in any
grammar (JSON schema, regex, choice, EBNF):

- Special tokens are text to xgrammar. `TokenizerInfo.from_huggingface` marks only tokens that
  decode to nothing as special, so `<s>` or `<pad>` of a byte-level vocabulary are the characters
  they spell, and `"<" [^>]+ ">"` accepts `<pad>`; the detokenizer then skips it and
  the text is empty. `tokenizer_info` gives xgrammar an empty string for each special token: it
  never matches (a stop token still ends the grammar).
- A byte-level vocabulary (and a byte-fallback one) has tokens that carry part of a character.
  xgrammar checks each character's byte shape (lead and continuation bytes, no overlong form,
  nothing past U+10FFFF) but not that it is outside the UTF-16 surrogates U+D800-DFFF: ED A0..BF
  xx passes every class that spans them (JSON's string character `[^"\...]`, so every string
  of a schema, its patterns and formats; regex `.`, `\S`, `[^a]`). The sample then ends with
  bytes no decoder accepts: one U+FFFD each in the text, and a string over its maxLength, as the
  grammar counted one character where the text has three. ED is the surrogates' only lead byte
  and always a lead byte, so `Utf8Guard`'s two masks close it: a token holding ED A0..BF is never
  allowed, and after a token that ends with ED no token starting with A0..BF is.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import torch

_SURROGATE_LEAD = 0xED
_SURROGATE_SECOND = range(0xA0, 0xC0)  # ED followed by these encodes U+D800-DFFF


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """xgrammar's `TokenizerInfo` for a Hugging Face tokenizer, its special tokens unmatchable.

    The vocabulary's type (byte-level, byte-fallback, raw) and prefix space are xgrammar's own
    reading of the tokenizer."""
    import xgrammar as xgr

    detected = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
    )
    encoded: list[str] = [""] * vocab_size
    for token, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size:
            encoded[token_id] = token
    added = getattr(tokenizer, "added_tokens_decoder", {})
    special = {i for i, token in added.items() if token.special}
    for token_id in special | set(getattr(tokenizer, "all_special_ids", ())):
        if token_id < vocab_size:
            encoded[token_id] = ""
    return xgr.TokenizerInfo(
        encoded,
        detected.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=stop_token_ids,
        add_prefix_space=detected.add_prefix_space,
    )


class Utf8Guard:
    """The tokens a constrained row may never sample for being a surrogate, by what it has
    written last. Built once per tokenizer, from the token bytes xgrammar matches on."""

    def __init__(self, token_bytes: Sequence[bytes], vocab_size: int) -> None:
        always = torch.ones(vocab_size, dtype=torch.bool)
        after_lead = torch.ones(vocab_size, dtype=torch.bool)
        self._ends_with_lead = torch.zeros(vocab_size, dtype=torch.bool)
        for token_id, data in enumerate(token_bytes[:vocab_size]):
            if not data:
                continue
            if data[0] in _SURROGATE_SECOND:
                after_lead[token_id] = False
            if data[-1] == _SURROGATE_LEAD:
                self._ends_with_lead[token_id] = True
            if _SURROGATE_LEAD in data[:-1] and _holds_surrogate(data):
                always[token_id] = False
        self.always = pack_bitmask(always)
        self.after_lead = pack_bitmask(always & after_lead)

    def restrict(self, bitmask: torch.Tensor, row: int, last_token_id: int | None) -> bool:
        """Take the surrogates out of row `row` of xgrammar's packed `bitmask`, given the
        sample's last token (None before its first); False when no token is left."""
        is_after_lead = last_token_id is not None and bool(self._ends_with_lead[last_token_id])
        bitmask[row].bitwise_and_(self.after_lead if is_after_lead else self.always)
        return bool(bitmask[row].any())


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """A bool vector of allowed tokens as xgrammar packs it: int32 words, token i allowed when
    bit i % 32 of word i // 32 is set."""
    num_words = (allowed.numel() + 31) // 32
    bits = torch.zeros(num_words * 32, dtype=torch.int64)
    bits[: allowed.numel()] = allowed.to(torch.int64)
    words = (bits.view(num_words, 32) << torch.arange(32)).sum(dim=1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _holds_surrogate(data: bytes) -> bool:
    return any(
        lead == _SURROGATE_LEAD and second in _SURROGATE_SECOND for lead, second in pairwise(data)
    )
