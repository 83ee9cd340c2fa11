"""Megatron-style tensor-parallel layers and the slices of checkpoint tensors each rank reads.

A column-parallel linear is a plain `nn.Linear` over this rank's output rows (the sharding is
all in which rows it loads). A row-parallel linear holds this rank's input columns and sums
the ranks' partial outputs with one all_reduce. The embedding and the LM head are split by
vocabulary rows (padded to a multiple of the ranks). With one rank (`tp is None`) models build
plain `nn` modules instead, so the single-device path runs no parallel code at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.distributed.parallel_state import TensorParallelGroup


class WeightSource(Protocol):
    """A checkpoint tensor or a lazy safetensors slice: both index to a tensor."""

    def __getitem__(self, index: Any) -> torch.Tensor: ...


@dataclass(frozen=True)
class Shard:
    """Rows or columns [start, start + size) of a checkpoint tensor (`dim` None: all of it)."""

    dim: int | None = None
    start: int = 0
    size: int = 0

    def read(self, source: WeightSource) -> torch.Tensor:
        """Only this slice is read from disk when `source` is a safetensors slice."""
        if self.dim is None:
            return source[:]
        index = slice(self.start, self.start + self.size)
        return source[index] if self.dim == 0 else source[:, index]


def padded_vocab_size(vocab_size: int, tp: TensorParallelGroup | None) -> int:
    num_ranks = 1 if tp is None else tp.world_size
    return -(-vocab_size // num_ranks) * num_ranks


def vocab_shard(vocab_size: int, tp: TensorParallelGroup | None) -> Shard:
    """This rank's vocabulary rows (the last rank's may run past the vocabulary: padding)."""
    if tp is None:
        return Shard()
    start, size = tp.split(padded_vocab_size(vocab_size, tp))
    return Shard(0, start, max(0, min(size, vocab_size - start)))


class RowParallelLinear(nn.Linear):
    """y = x W^T + b where x holds this rank's input columns: partial sums, all-reduced."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup
    ) -> None:
        super().__init__(in_features // tp.world_size, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


def row_parallel_linear(
    in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup | None
) -> nn.Linear:
    if tp is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp)


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the embedding; other ranks' tokens embed as 0 before the sum."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup) -> None:
        padded = padded_vocab_size(vocab_size, tp)
        super().__init__(padded // tp.world_size, hidden_size)
        self.tp = tp
        self.vocab_start = tp.split(padded)[0]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        is_mine = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(local.masked_fill(~is_mine, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(~is_mine.unsqueeze(-1), 0))


def vocab_parallel_embedding(
    vocab_size: int, hidden_size: int, tp: TensorParallelGroup | None
) -> nn.Embedding:
    if tp is None:
        return nn.Embedding(vocab_size, hidden_size)
    return VocabParallelEmbedding(vocab_size, hidden_size, tp)


class ParallelLMHead(nn.Linear):
    """Logits of this rank's vocabulary rows, gathered whole on the driver (rank 0).

    Every rank must call it with the same rows; only the driver's result is the logits.
    """

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallelGroup) -> None:
        super().__init__(hidden_size, padded_vocab_size(vocab_size, tp) // tp.world_size, False)
        self.tp = tp
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.gather_to_driver(F.linear(hidden, self.weight))
        return logits[..., : self.vocab_size] if self.tp.is_driver else logits


def lm_head(hidden_size: int, vocab_size: int, tp: TensorParallelGroup | None) -> nn.Linear:
    if tp is None:
        return nn.Linear(hidden_size, vocab_size, bias=False)
    return ParallelLMHead(hidden_size, vocab_size, tp)
