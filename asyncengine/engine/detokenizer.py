"""Incremental detokenization: text deltas that never split a UTF-8 character."""

from __future__ import annotations

from typing import Any

# decode a few prompt tokens along with the first output so tokenizers that drop a
# leading space on a lone token (SentencePiece) still produce the right first delta
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas (the prefix/read offsets of TGI, vLLM).

    The window `[prefix_offset, read_offset)` is text already emitted; decoding it and the
    window extended by the new tokens gives the new text as the difference. A delta that ends
    in U+FFFD is a multi-byte character still being completed: it waits for the next token.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.read_offset = len(prompt_token_ids)
        self.prefix_offset = max(self.read_offset - _PROMPT_CONTEXT_TOKENS, 0)

    def decode_next(self, token_ids: list[int], is_final: bool = False) -> str:
        """The text the tokens after `read_offset` add; on the final call, whatever remains."""
        prefix_text = self._decode(token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) and not is_final:
            return ""
        if new_text.endswith("\ufffd") and not is_final:
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return new_text[len(prefix_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens))
