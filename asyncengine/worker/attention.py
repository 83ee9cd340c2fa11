"""Attention over the paged KV cache: the torch backend (CPU path, kernel reference).

On the CPU, decode runs in a C++ op when it could be built (asyncengine/worker/cpu_ops.py):
it reads each block in place, once, and computes nothing for slots a sequence does not see.
Otherwise, and on other devices, decode gathers the blocks and masks the padding.
`set_attention_backend` routes a model's `Attention` layers to the Triton kernels instead
(asyncengine/worker/triton_attention.py); triton is imported only then.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.worker import cpu_ops
from asyncengine.worker.forward_context import AttentionMetadata, get_forward_context


def store_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write new K/V rows ([num_tokens, num_kv_heads, head_dim]) into their cache slots."""
    if kv_cache.is_cpu and cpu_ops.is_loaded():
        torch.ops.asyncengine.store_kv(kv_cache, key, value, slot_mapping)  # both, one call
        return
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


def gather_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence's first `seq_len` tokens, read through its block table."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    blocks = kv_cache[:, block_table[:num_blocks]]  # [2, n, block_size, kv_heads, dim]
    blocks = blocks.flatten(1, 2)[:, :seq_len]
    return blocks[0], blocks[1]


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Attention of each sequence's new tokens over its cached K/V ([T, heads, dim] -> same)."""
    out = torch.empty_like(query)
    rows = meta.scratch.get("decode_rows")
    if rows is None:  # the same for every layer of this forward: derive it once
        rows = meta.scratch["decode_rows"] = _decode_rows(meta)
    n = rows.num_rows
    if n and query.is_cpu and cpu_ops.is_loaded():
        cpu_ops.paged_decode_attention(
            query[:n], kv_cache, rows.block_tables, rows.seq_lens, scale, sliding_window,
            out=out[:n],
        )  # fmt: skip
    elif n:
        out[:n] = _decode_attention(query[:n], kv_cache, rows, scale, sliding_window, meta.scratch)
    first = rows.num_seqs  # the sequences after the decode rows: prefills, chunks, resumes
    if first == len(meta.context_lens):
        return out
    start = meta.query_start_loc[first]
    if query.is_cpu and cpu_ops.is_loaded():
        starts = meta.scratch.get("prefill_starts")
        if starts is None:  # every layer's: made once
            offsets = [loc - start for loc in meta.query_start_loc[first:]]
            starts = meta.scratch["prefill_starts"] = torch.tensor(offsets, dtype=torch.int32)
        cpu_ops.paged_prefill_attention(
            query[start:], kv_cache, meta.block_tables[first:], starts, meta.seq_lens[first:],
            scale, sliding_window, out=out[start:],
        )  # fmt: skip
        return out
    for i in range(first, len(meta.context_lens)):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        key, value = gather_kv(kv_cache, meta.block_tables[i], meta.seq_lens_list[i])
        out[start:end] = _prefill_attention(
            query[start:end], key, value, meta.context_lens[i], scale, sliding_window
        )
    return out


# A short query (drafts under verification, a short chunk) of a short sequence attends as that
# many one-token decodes of it, each row seeing the cache up to its own position, all in the
# decode op's one call: per sequence, a gather of its K/V and an SDPA cost ~40 us of calls
# alone, which a batch of 16 verifying requests paid 16 times a layer (the bundled model at
# batch 16, ngram speculation on random prompts: 0.76x of no speculation, 1.04x so). The op
# reads the K/V once per row, though: past ~1,000 tokens the copy made once costs less (6 rows
# at 2,000 tokens: 730 against 570 us, 4 heads).
MAX_DECODE_LIKE_TOKENS = 8
MAX_DECODE_LIKE_SEQ_LEN = 1024


def attends_as_decodes(num_new_tokens: int, seq_len: int) -> bool:
    """Whether a sequence's `num_new_tokens` (> 1) attend as one-token decodes; the model
    runner puts such sequences right after the one-token ones."""
    return num_new_tokens <= MAX_DECODE_LIKE_TOKENS and seq_len <= MAX_DECODE_LIKE_SEQ_LEN


@dataclass
class _DecodeRows:
    """The batch's leading rows that attend as one-token decodes: those of its first
    `num_seqs` sequences (all the one-token ones, then the short queries after them), each
    row with its sequence's block table and its own length."""

    num_rows: int
    num_seqs: int
    block_tables: torch.Tensor  # [num_rows, max_blocks] int32
    seq_lens: torch.Tensor  # [num_rows] int32
    seq_lens_list: list[int]


def _decode_rows(meta: AttentionMetadata) -> _DecodeRows:
    nd, starts = meta.num_decodes, meta.query_start_loc
    num_seqs = nd
    while num_seqs < len(meta.context_lens) and attends_as_decodes(
        starts[num_seqs + 1] - starts[num_seqs], meta.seq_lens_list[num_seqs]
    ):
        num_seqs += 1
    if num_seqs == nd:
        return _DecodeRows(nd, nd, meta.block_tables[:nd], meta.seq_lens[:nd],
                           meta.seq_lens_list[:nd])  # fmt: skip
    counts = [starts[i + 1] - starts[i] for i in range(num_seqs)]
    seq_lens = [
        context + j + 1 for context, count in zip(meta.context_lens, counts) for j in range(count)
    ]
    tables = meta.block_tables[:num_seqs].repeat_interleave(
        torch.tensor(counts, device=meta.block_tables.device), dim=0
    )
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=meta.seq_lens.device)
    return _DecodeRows(len(seq_lens), num_seqs, tables, lens, seq_lens)


def _decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    rows: _DecodeRows,
    scale: float,
    sliding_window: int | None,
    scratch: dict[Any, torch.Tensor],
) -> torch.Tensor:
    # all one-token rows at once: gather their blocks, pad to the longest, mask the rest
    nd = query.shape[0]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    max_len = max(rows.seq_lens_list)
    num_blocks = -(-max_len // block_size)
    blocks = rows.block_tables[:, :num_blocks].flatten()
    key, value = (
        _gather_blocks(kv_cache[i], blocks, i)
        .view(nd, num_blocks * block_size, num_kv_heads, -1)[:, :max_len]
        .transpose(1, 2)  # [nd, kv_heads, len, dim]
        for i in (0, 1)
    )
    mask = scratch.get(("decode_mask", sliding_window))
    if mask is None:  # the same for every layer of this forward: build it once
        mask = _decode_mask(rows.seq_lens, max_len, sliding_window, query.dtype)
        scratch[("decode_mask", sliding_window)] = mask
    # Slots past a sequence's end hold stale but finite values (the cache starts zeroed), so
    # their zero attention weights zero them out. The query heads that share a KV head ride in
    # the query-length dimension: each KV head is read once, with no expanded copy (~1.6x).
    attn = F.scaled_dot_product_attention(
        query.view(nd, num_kv_heads, -1, query.shape[-1]),  # [nd, kv_heads, group, dim]
        key,
        value,
        attn_mask=mask,
        scale=scale,
    )
    return attn.reshape(query.shape)


def _decode_mask(
    seq_lens: torch.Tensor, max_len: int, sliding_window: int | None, dtype: torch.dtype
) -> torch.Tensor:
    """Additive mask [nd, 1, 1, max_len]: 0 where a sequence may look, -inf elsewhere (an
    additive float mask runs ~2x faster in SDPA than a boolean one, which it converts)."""
    pos = torch.arange(max_len, device=seq_lens.device)
    visible = pos[None, :] < seq_lens[:, None]
    if sliding_window is not None:
        visible &= pos[None, :] >= (seq_lens[:, None] - sliding_window)
    mask = torch.zeros(visible.shape, dtype=dtype, device=seq_lens.device)
    return mask.masked_fill_(~visible, float("-inf"))[:, None, None, :]


class _GatherBuffers(threading.local):
    """Reused gather buffers, one for K and one for V: a fresh multi-MB tensor per layer and
    step costs page faults that double the copy's time. Per thread, as each engine runs its
    forwards in a worker thread of its own."""

    def __init__(self) -> None:
        self.by_key: dict[tuple[torch.device, torch.dtype, int, bool], torch.Tensor] = {}


_gather_buffers = _GatherBuffers()


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, slot: int) -> torch.Tensor:
    """Rows of `cache` ([num_blocks, ...]) at `blocks`, copied into a reused buffer."""
    flat = cache.view(cache.shape[0], -1)
    num_rows, row_len = blocks.numel(), flat.shape[1]
    # an inference-mode buffer cannot be written outside inference mode (nor used by autograd)
    key = (flat.device, flat.dtype, slot, torch.is_inference_mode_enabled())
    buffer = _gather_buffers.by_key.get(key)
    if buffer is None or buffer.numel() < num_rows * row_len:
        buffer = torch.empty(2 * num_rows * row_len, dtype=flat.dtype, device=flat.device)
        _gather_buffers.by_key[key] = buffer
    out = buffer[: num_rows * row_len].view(num_rows, row_len)
    return torch.index_select(flat, 0, blocks, out=out)


def _prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    context_len: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    # query i sits at position context_len + i and sees keys up to there (causal)
    num_new, seq_len = query.shape[0], key.shape[0]
    # [1, heads, len, dim]: SDPA's CPU flash kernel takes 4-d inputs only (3-d ones fall back
    # to the unfused math path, ~1.4x slower at 160 tokens, ~4x at 1024)
    q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))
    if context_len == 0 and (sliding_window is None or seq_len <= sliding_window):
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        q_pos = torch.arange(context_len, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    assert attn.shape[2] == num_new
    return attn[0].transpose(0, 1)


def torch_attention(
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
    return paged_attention(query, kv_cache, meta, scale, sliding_window)


AttentionImpl = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float, int | None],
    torch.Tensor,
]


def set_attention_backend(model: nn.Module, backend: str) -> None:
    """Route every `Attention` layer of `model` through `backend`: "torch" or "triton"."""
    impl: AttentionImpl = torch_attention
    if backend == "torch" and all(p.is_cpu for p in model.parameters()):
        cpu_ops.load()  # builds on first use; without it decode stays in plain torch
    elif backend == "triton":
        from asyncengine.worker.triton_attention import triton_attention

        impl = triton_attention
    elif backend != "torch":
        raise ValueError(f"unknown attention backend {backend!r}")
    for module in model.modules():
        if isinstance(module, Attention):
            module.impl = impl


class Attention(nn.Module):
    """Stores this layer's new K/V in the paged cache and attends over it."""

    def __init__(
        self,
        layer_idx: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        self.impl: AttentionImpl = torch_attention

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        kv_cache = ctx.kv_caches[self.layer_idx]
        return self.impl(
            query, key, value, kv_cache, ctx.attn_metadata, self.scale, self.sliding_window
        )
