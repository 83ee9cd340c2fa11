"""Prompt lookup (the `ngram` proposer): what followed the latest earlier occurrence of a
request's last n tokens, found through an index that grows with the request.

It needs no model, so the scheduler runs it while it plans a step: a request gets draft slots
only for drafts that exist, and one whose suffix occurs nowhere earlier is a plain decode.
"""

from __future__ import annotations

import weakref

from asyncengine.core.request import Request


class NgramIndex:
    """For each n in `min_n..max_n`: every n-gram of a token list mapped to where its latest
    occurrence ends. Positions are indexed once each, as tokens are appended, so a lookup
    costs a few dict reads however long the sequence is."""

    __slots__ = ("ends", "max_n", "min_n", "num_indexed")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.ends: dict[tuple[int, ...], int] = {}  # n-grams of every n share it: keys differ
        self.num_indexed = 0  # n-grams ending before this position are in

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of `tokens`' longest
        suffix of `min_n`..`max_n` tokens; [] when none occurs."""
        num_tokens = len(tokens)
        if num_tokens < self.num_indexed:  # tokens were taken back: index afresh
            self.ends.clear()
            self.num_indexed = 0
        # every n-gram ending before the last token (a token follows each occurrence)
        self._index(tokens, num_tokens - 1)
        ends = self.ends
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            end = ends.get(tuple(tokens[num_tokens - n :]))
            if end is not None:
                return tokens[end + 1 : end + 1 + k]
        return []

    def _index(self, tokens: list[int], upto: int) -> None:
        ends, min_n, max_n = self.ends, self.min_n, self.max_n
        for end in range(self.num_indexed, upto):
            for n in range(min_n, min(max_n, end + 1) + 1):
                ends[tuple(tokens[end - n + 1 : end + 1])] = end
        self.num_indexed = max(self.num_indexed, upto)


class NgramProposer:
    """Drafts by prompt lookup in each request's prompt and output so far (an index per
    request, dropped with the request)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._indexes: weakref.WeakKeyDictionary[Request, NgramIndex] = weakref.WeakKeyDictionary()

    def propose(self, req: Request, k: int) -> list[int]:
        index = self._indexes.get(req)
        if index is None:
            index = self._indexes[req] = NgramIndex(self.min_n, self.max_n)
        return index.lookup(req.token_ids, k)
