"""Draft proposers for speculative decoding, behind one small interface.

A proposer guesses the next tokens of the requests that have draft slots this step; the
model runner then checks them in the target's forward (worker/rejection_sampler.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncengine.config import SpeculativeConfig
from asyncengine.core.request import Request
from asyncengine.core.scheduler import SchedulerOutput
from asyncengine.worker.forward_context import AttentionMetadata


@dataclass
class ForwardInputs:
    """One forward's flattened batch: what the model and its attention layers read."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata


class Proposer:
    """Drafts for each request with draft slots: at most its number of slots, possibly none.

    A proposer with K/V of its own (a draft model) keeps it in the target's blocks, in tensors
    of its own: the hooks size and move it with the target's cache, and let it see every
    forward the target runs, so its K/V covers the same tokens.
    """

    method: str

    def bytes_per_block(self) -> int:
        """Bytes of K/V the proposer keeps per block (0: none)."""
        return 0

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Make the proposer's K/V for the target's blocks (nothing without K/V)."""

    def apply_block_moves(self, plan: SchedulerOutput) -> None:
        """Apply the plan's swaps and copies to the proposer's K/V too."""

    def propose(
        self, reqs: list[Request], num_spec_tokens: list[int], block_tables: list[list[int]]
    ) -> list[list[int]]:
        raise NotImplementedError

    def observe(self, inputs: ForwardInputs) -> None:
        """See the target's forward over `inputs` (run there with the proposer's K/V)."""


class NgramProposer(Proposer):
    """Prompt lookup: find the last n tokens earlier in the prompt and output so far (n from
    `prompt_lookup_max` down to `prompt_lookup_min`, the latest occurrence) and propose the
    tokens that followed them there. No model, a few vector compares per request."""

    method = "ngram"

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(
        self, reqs: list[Request], num_spec_tokens: list[int], block_tables: list[list[int]]
    ) -> list[list[int]]:
        return [
            ngram_lookup(np.asarray(req.token_ids), k, self.min_n, self.max_n)
            for req, k in zip(reqs, num_spec_tokens)
        ]


def ngram_lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of `tokens`' longest
    suffix of `min_n`..`max_n` tokens; [] when none occurs."""
    num_tokens = len(tokens)
    max_n = min(max_n, num_tokens - 1)
    # where a suffix of n tokens ends earlier (before the last token, so a token follows):
    # the last token's occurrences, kept while the n-th token back matches too, n = 1, 2, ..
    ends = np.flatnonzero(tokens[: num_tokens - 1] == tokens[-1])
    found = ends if min_n <= 1 else ends[:0]
    for n in range(1, max_n):
        ends = ends[ends >= n]
        ends = ends[tokens[ends - n] == tokens[num_tokens - 1 - n]]
        if not ends.size:
            break
        if n + 1 >= min_n:
            found = ends  # the longest suffix so far
    if not found.size:
        return []
    start = int(found[-1]) + 1  # its latest occurrence
    return tokens[start : start + k].tolist()
