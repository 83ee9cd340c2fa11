"""Paged decode attention: one query token per sequence, split-KV (flash-decoding), GQA.

Stage 1 runs one program per (sequence, KV head, split). It loads the query rows of all the
query heads that share the KV head (padded to 16 rows for tensor cores), so each K/V tile is read
once per group, and walks its split of the context with an online softmax. With one split it
writes the output directly; otherwise it writes a partial output and its log-sum-exp, and stage 2
merges the splits of each (sequence, head). Splits are chosen on the host from the batch shape
and the longest context so that few long sequences still fill the GPU, without a device sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_tile import NO_MAX, _attend_kv_tiles, attend_ref
from .utils import (
    check_attention_inputs,
    dot_in_fp32,
    dot_precision,
    is_interpreter,
    next_power_of_2,
    num_compute_units,
    require,
)

LOG2E = 1.4426950408889634
MIN_SPLIT_LEN = 256  # below this a split's fixed cost outweighs the parallelism it adds
MAX_SPLITS = 64
PROGRAMS_PER_SM = 4  # enough resident programs per SM to keep loads in flight


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [num_seqs, num_heads, head_dim]
    kv_cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_num_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32: tokens in the cache, the query's own included
    out_ptr,  # [num_seqs, num_heads, head_dim]: written when not IS_SPLIT
    part_out_ptr,  # [num_seqs, num_heads, num_splits, head_dim] float32: per-split outputs
    part_lse_ptr,  # [num_seqs, num_heads, num_splits] float32: per-split log2-sum-exp2
    qk_scale,
    split_len,  # keys per split, a multiple of BLOCK_N
    stride_q_seq,
    stride_q_head,
    stride_o_seq,
    stride_o_head,
    stride_c_kv,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    stride_bt_seq,
    QUERIES_PER_KV: tl.constexpr,
    IS_SPLIT: tl.constexpr,  # more than one split: write partials for the reduce kernel
    SLIDING_WINDOW: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    first = 0
    if SLIDING_WINDOW > 0:
        # start at a tile boundary; the window mask drops the few keys before the window
        first = (tl.maximum(seq_len - SLIDING_WINDOW, 0) // BLOCK_N) * BLOCK_N
    start = first + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * QUERIES_PER_KV + offs_h
    hd_mask = (offs_h < QUERIES_PER_KV)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_off = seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=hd_mask, other=0.0)

    # tl.full rather than tl.zeros: the same code, and a builtin is cheaper when interpreted
    acc = tl.full([BLOCK_H, BLOCK_D], 0.0, dtype=tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, dtype=tl.float32)
    m_i = tl.full([BLOCK_H], NO_MAX, dtype=tl.float32)
    row_pos = tl.full([BLOCK_H], 0, dtype=tl.int32) + (seq_len - 1)
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
    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if not IS_SPLIT:
        o_off = seq.to(tl.int64) * stride_o_seq + heads[:, None] * stride_o_head + offs_d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=hd_mask)
    else:
        # an empty split (a short sequence in a batch split for a long one) has lse -inf
        num_splits = tl.num_programs(2)
        row = (seq * (QUERIES_PER_KV * tl.num_programs(1)) + heads) * num_splits + split
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=offs_h < QUERIES_PER_KV)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=hd_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,  # [num_seqs, num_heads, num_splits, head_dim] float32
    part_lse_ptr,  # [num_seqs, num_heads, num_splits] float32
    out_ptr,  # [num_seqs, num_heads, head_dim]
    num_splits,
    stride_o_seq,
    stride_o_head,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    row = (seq * tl.num_programs(1) + head) * num_splits
    lse = tl.load(part_lse_ptr + row + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))  # split 0 is never empty, so the max is finite
    mask = (offs_s < num_splits)[:, None] & (offs_d < HEAD_DIM)[None, :]
    parts = tl.load(
        part_out_ptr + (row + offs_s)[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0
    )
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    o_off = seq.to(tl.int64) * stride_o_seq + head * stride_o_head + offs_d
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def default_block_n(head_dim: int, dtype: torch.dtype) -> int:
    """Keys per tile: 64 rows of up to 256 bytes, 32 for wider rows; 256 when interpreted."""
    if is_interpreter():
        return 256  # the interpreter's cost is per operation, hardly per element
    return 64 if next_power_of_2(head_dim) * dtype.itemsize <= 256 else 32


def choose_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_compute_units: int,
    block_n: int,
    sliding_window: int | None = None,
) -> int:
    """Splits per sequence so that (seqs x kv heads x splits) programs fill the device."""
    attended = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window + block_n)
    num_programs = num_seqs * num_kv_heads
    target = PROGRAMS_PER_SM * num_compute_units
    by_fill = target // num_programs  # rounded down: a partial extra wave gains nothing
    by_len = attended // MIN_SPLIT_LEN
    return max(1, min(by_fill, by_len, MAX_SPLITS))


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged K/V.

    query [num_seqs, num_heads, head_dim]; kv_cache [2, num_blocks, block_size, num_kv_heads,
    head_dim]; block_tables [num_seqs, max_num_blocks] int32; seq_lens [num_seqs] int32 (the
    query's own token included, already stored). `max_seq_len` (>= every seq_len) picks the
    splits without reading seq_lens back; `num_splits` / `block_n` override the heuristics.
    """
    out = check_attention_inputs(query, kv_cache, block_tables, seq_lens, sliding_window, out)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_seqs, num_heads = query.shape[0], query.shape[1]
    require(seq_lens.shape[0] == num_seqs, "one query row per sequence")
    if num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())  # a device sync: callers on the hot path pass it
    block_n = block_n or default_block_n(head_dim, kv_cache.dtype)
    if num_splits is None:
        num_splits = choose_num_splits(
            num_seqs,
            num_kv_heads,
            max_seq_len,
            num_compute_units(query.device),
            block_n,
            sliding_window,
        )
    attended = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window + block_n)
    split_len = triton.cdiv(triton.cdiv(max(attended, 1), num_splits), block_n) * block_n
    num_splits = triton.cdiv(max(attended, 1), split_len)  # drop splits that would be empty

    queries_per_kv = num_heads // num_kv_heads
    block_d = next_power_of_2(head_dim)
    if num_splits > 1:
        part_out = query.new_empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32)
        part_lse = query.new_empty(num_seqs, num_heads, num_splits, dtype=torch.float32)
    else:
        part_out = part_lse = out  # unused
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        kv_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        scale * LOG2E,
        split_len,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        *kv_cache.stride()[:4],
        block_tables.stride(0),
        QUERIES_PER_KV=queries_per_kv,
        IS_SPLIT=num_splits > 1,
        SLIDING_WINDOW=sliding_window or 0,
        BLOCK_SIZE=block_size,
        BLOCK_H=max(16, next_power_of_2(queries_per_kv)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        HEAD_DIM=head_dim,
        DOT_PRECISION=dot_precision(kv_cache.dtype),
        DOT_IN_FP32=dot_in_fp32(kv_cache.dtype),
        num_warps=4,
        num_stages=2,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_out,
            part_lse,
            out,
            num_splits,
            out.stride(0),
            out.stride(1),
            BLOCK_S=next_power_of_2(num_splits),
            BLOCK_D=block_d,
            HEAD_DIM=head_dim,
            num_warps=4,
        )
    return out


def paged_decode_attention_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Plain-torch `paged_decode_attention`, in float32, one sequence at a time."""
    out = torch.empty_like(query)
    for i in range(query.shape[0]):
        seq_len = int(seq_lens[i])
        out[i] = attend_ref(
            query[i : i + 1], kv_cache, block_tables[i], seq_len, scale, sliding_window
        )[0]
    return out
