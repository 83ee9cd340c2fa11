"""Per-forward attention metadata, set around a forward in a `with` and read by attention layers.

Model code keeps the signature `forward(input_ids, positions)`; the paged-attention inputs
(slot mapping, block tables, lengths, the KV cache tensors) travel here instead.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Paged-attention inputs of one flattened batch.

    The batch holds `num_decodes` one-token sequences first, then the prefill (or chunked
    prefill / resume) sequences. For sequence i, its new tokens are rows
    `query_start_loc[i]:query_start_loc[i+1]` of the flattened batch, `context_lens[i]` tokens
    were already in the cache, and `seq_lens[i] = context_lens[i] + new tokens`.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32 (padded with 0)
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: list[int]  # num_seqs + 1 offsets into the flattened batch
    context_lens: list[int]  # tokens already cached per sequence
    seq_lens_list: list[int]
    num_decodes: int
    max_seq_len: int
    # values every layer would compute alike (e.g. the decode mask), computed by the first
    scratch: dict[Any, Any] = field(default_factory=dict)


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]  # per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
    lora: Any = None  # asyncengine.lora.layers.LoRABatch: the rows' adapters, if any


class _Local(threading.local):
    current: ForwardContext | None = None


# per thread: each engine runs its forwards in a worker thread of its own, and several
# engines may share a process (tests, replicas in one process)
_local = _Local()


@contextmanager
def set_forward_context(
    attn_metadata: AttentionMetadata, kv_caches: list[torch.Tensor], lora: Any = None
) -> Iterator[None]:
    assert _local.current is None, "forward contexts do not nest"
    _local.current = ForwardContext(attn_metadata, kv_caches, lora)
    try:
        yield
    finally:
        _local.current = None


def get_forward_context() -> ForwardContext:
    assert _local.current is not None, "attention ran outside set_forward_context()"
    return _local.current


def current_lora() -> Any:
    """The forward's `LoRABatch`, or None (no adapter in it, or no forward running)."""
    current = _local.current
    return None if current is None else current.lora
