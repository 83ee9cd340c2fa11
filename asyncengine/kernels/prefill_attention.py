"""Prefill / extend attention over the paged KV cache for a flattened varlen batch.

Each sequence's new tokens (rows query_start_loc[i]:query_start_loc[i+1]) attend causally to
its first seq_lens[i] cached tokens: a cached prefix or a resumed request's earlier tokens, and
the new tokens themselves (store_kv has already written them). One program handles BLOCK_Q new
tokens x all query heads of one KV head, packed as BLOCK_Q * BLOCK_H rows of one tile, so each
K/V tile feeds every head of the group. The grid has an upper bound of programs
(num_tokens // BLOCK_Q + num_seqs) and each finds its sequence by binary search, so the host never
needs the per-sequence query lengths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_tile import NO_MAX, _attend_kv_tiles, attend_ref
from .decode_attention import LOG2E, default_block_n
from .utils import (
    check_attention_inputs,
    dot_in_fp32,
    dot_precision,
    is_interpreter,
    next_power_of_2,
    require,
)


@triton.jit
def _paged_prefill_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    kv_cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_num_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32: cached tokens incl. this step's new ones
    query_start_loc_ptr,  # [num_seqs + 1] int32: row offsets of each sequence's new tokens
    out_ptr,  # [num_tokens, num_heads, head_dim]
    num_seqs,
    qk_scale,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_c_kv,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    stride_bt_seq,
    QUERIES_PER_KV: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    # sequence i owns program ids from query_start_loc[i] // BLOCK_Q + i on
    left: tl.int32 = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block:
            left = mid + 1
        else:
            right = mid
    seq = left - 1
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_q = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if first_q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_Q * BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    q_idx = first_q + offs_m // BLOCK_H
    head = kv_head * QUERIES_PER_KV + offs_m % BLOCK_H
    row_mask = (q_idx < q_len) & (offs_m % BLOCK_H < QUERIES_PER_KV)
    mask = row_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    tok = (q_start + q_idx).to(tl.int64)
    q_off = tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=mask, other=0.0)

    row_pos = context_len + q_idx
    end = tl.minimum(context_len + first_q + BLOCK_Q, seq_len)  # past the last row's position
    start = 0
    if SLIDING_WINDOW > 0:
        start = (tl.maximum(context_len + first_q - SLIDING_WINDOW + 1, 0) // BLOCK_N) * BLOCK_N
    acc = tl.full([BLOCK_Q * BLOCK_H, BLOCK_D], 0.0, dtype=tl.float32)
    l_i = tl.full([BLOCK_Q * BLOCK_H], 0.0, dtype=tl.float32)
    m_i = tl.full([BLOCK_Q * BLOCK_H], NO_MAX, dtype=tl.float32)
    k_base = kv_cache_ptr + kv_head * stride_c_head
    acc, l_i, m_i = _attend_kv_tiles(
        q,
        acc,
        l_i,
        m_i,
        row_pos,
        start,
        end,
        k_base,
        k_base + stride_c_kv,
        block_tables_ptr + seq.to(tl.int64) * stride_bt_seq,
        stride_c_block,
        stride_c_slot,
        qk_scale,
        SLIDING_WINDOW,
        BLOCK_SIZE,
        BLOCK_N,
        BLOCK_D,
        HEAD_DIM,
        DOT_PRECISION,
        DOT_IN_FP32,
    )
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_off = tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=mask)


def default_block_m(head_dim: int, dtype: torch.dtype) -> int:
    """Query rows (tokens x heads) per program: 64, 32 for wide rows; 128 when interpreted."""
    if is_interpreter():
        return 128
    return 64 if next_power_of_2(head_dim) * dtype.itemsize <= 256 else 32


def paged_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    block_q: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged K/V.

    query [num_tokens, num_heads, head_dim] (sequences back to back); kv_cache [2, num_blocks,
    block_size, num_kv_heads, head_dim] already holding the new tokens; block_tables
    [num_seqs, max_num_blocks] int32; seq_lens [num_seqs] int32; query_start_loc
    [num_seqs + 1] int32 with query_start_loc[0] == 0. `block_q` (new tokens per program) and
    `block_n` (keys per tile) override the defaults.
    """
    out = check_attention_inputs(query, kv_cache, block_tables, seq_lens, sliding_window, out)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_tokens, num_heads, num_seqs = query.shape[0], query.shape[1], seq_lens.shape[0]
    require(
        query_start_loc.shape == (num_seqs + 1,)
        and query_start_loc.dtype == torch.int32
        and query_start_loc.device == query.device,
        f"query_start_loc must be [{num_seqs + 1}] int32 on the query's device",
    )
    if num_tokens == 0 or num_seqs == 0:
        return out
    queries_per_kv = num_heads // num_kv_heads
    block_h = next_power_of_2(queries_per_kv)
    if block_q is None:
        block_q = max(1, default_block_m(head_dim, kv_cache.dtype) // block_h)
    require(block_q * block_h >= 16, "block_q * next_power_of_2(queries_per_kv) must be >= 16")
    block_n = block_n or default_block_n(head_dim, kv_cache.dtype)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_prefill_kernel[grid](
        query,
        kv_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        num_seqs,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        *kv_cache.stride()[:4],
        block_tables.stride(0),
        QUERIES_PER_KV=queries_per_kv,
        SLIDING_WINDOW=sliding_window or 0,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_D=next_power_of_2(head_dim),
        HEAD_DIM=head_dim,
        DOT_PRECISION=dot_precision(kv_cache.dtype),
        DOT_IN_FP32=dot_in_fp32(kv_cache.dtype),
        num_warps=4,
        num_stages=2,
    )
    return out


def paged_prefill_attention_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Plain-torch `paged_prefill_attention`, in float32, one sequence at a time."""
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for i in range(seq_lens.shape[0]):
        start, end = starts[i], starts[i + 1]
        if end > start:
            out[start:end] = attend_ref(
                query[start:end],
                kv_cache,
                block_tables[i],
                int(seq_lens[i]),
                scale,
                sliding_window,
            )
    return out
