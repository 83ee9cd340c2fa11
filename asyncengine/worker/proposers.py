"""Draft proposers for speculative decoding, behind one small interface.

A proposer guesses the next tokens of the requests that have draft slots this step; the
model runner then checks them in the target's forward (worker/rejection_sampler.py). Prompt
lookup needs no model: the scheduler finds its drafts while it plans the step
(core/ngram.py), so it is not one of these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
