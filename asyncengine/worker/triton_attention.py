"""The Triton attention backend: store_kv, then split-KV decode and varlen prefill kernels.

Imports triton (through asyncengine.kernels); attention.py imports this module only when the
engine runs with attention_backend="triton".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncengine.kernels import paged_decode_attention, paged_prefill_attention, store_kv
from asyncengine.worker.forward_context import AttentionMetadata


@dataclass
class _KernelMetadata:
    """What the kernels need beyond `AttentionMetadata`, built once per forward (not per layer)."""

    max_decode_seq_len: int
    # [num_prefills + 1] int32 on the device: row offsets of the prefill sequences' new tokens,
    # counted from the first prefill row; None when the batch is all decodes
    prefill_query_start_loc: torch.Tensor | None


def _kernel_metadata(meta: AttentionMetadata) -> _KernelMetadata:
    # every layer of one forward sees the same metadata: derive once, keep it in its scratch
    cached = meta.scratch.get("triton")
    if cached is not None:
        return cached
    nd = meta.num_decodes
    starts = None
    if len(meta.context_lens) > nd:
        first = meta.query_start_loc[nd]
        starts = torch.tensor(
            [loc - first for loc in meta.query_start_loc[nd:]],
            dtype=torch.int32,
            device=meta.seq_lens.device,
        )
    derived = _KernelMetadata(max(meta.seq_lens_list[:nd], default=0), starts)
    meta.scratch["triton"] = derived
    return derived


def triton_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Store this step's K/V, then attend every new token over its sequence's cached K/V."""
    store_kv(key, value, kv_cache, meta.slot_mapping)
    derived = _kernel_metadata(meta)
    out = torch.empty_like(query)
    nd = meta.num_decodes  # decode sequences come first, one row each
    if nd:
        paged_decode_attention(
            query[:nd],
            kv_cache,
            meta.block_tables[:nd],
            meta.seq_lens[:nd],
            scale,
            max_seq_len=derived.max_decode_seq_len,
            sliding_window=sliding_window,
            out=out[:nd],
        )
    if derived.prefill_query_start_loc is not None:
        paged_prefill_attention(
            query[nd:],
            kv_cache,
            meta.block_tables[nd:],
            meta.seq_lens[nd:],
            derived.prefill_query_start_loc,
            scale,
            sliding_window=sliding_window,
            out=out[nd:],
        )
    return out
