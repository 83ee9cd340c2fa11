"""The inner loop shared by the decode and prefill kernels: online softmax over paged KV tiles."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Running max before any key was seen: finite, so a row whose keys are all masked so far keeps
# alpha = exp2(0) = 1 and p = exp2(-inf) = 0 instead of producing inf - inf = NaN.
NO_MAX = -1.0e30


@triton.jit
def _attend_kv_tiles(
    q,  # [BLOCK_M, BLOCK_D] cache dtype: the query rows (pre-scaling happens on the scores)
    acc,  # [BLOCK_M, BLOCK_D] float32: running sum of p @ V
    l_i,  # [BLOCK_M] float32: running sum of p
    m_i,  # [BLOCK_M] float32: running max of the log2-scaled scores
    row_pos,  # [BLOCK_M] int32: position of each row's query token (causal / window bound)
    start,  # first key position to visit
    end,  # one past the last key position to visit
    k_cache_ptr,  # K of one KV head: base + kv_head * stride_head (slots via the table)
    v_cache_ptr,  # V of the same KV head
    block_table_ptr,  # [max_num_blocks] int32: this sequence's row of the block table
    stride_block,
    stride_slot,
    qk_scale,  # softmax scale * log2(e)
    SLIDING_WINDOW: tl.constexpr,  # 0 = none; else a key is seen iff pos - window < key <= pos
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_N: tl.constexpr,  # keys per tile (a tile may span blocks or lie inside one)
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # the interpreter's dot multiplies bfloat16's uint16 storage
):
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    for tile_start in range(start, end, BLOCK_N):
        key_pos = tile_start + tl.arange(0, BLOCK_N)
        in_range = key_pos < end
        # one table entry per key: correct for any block_size / BLOCK_N ratio, cached reads
        block = tl.load(block_table_ptr + key_pos // BLOCK_SIZE, mask=in_range, other=0)
        slot_off = block.to(tl.int64) * stride_block + (key_pos % BLOCK_SIZE) * stride_slot
        kv_off = slot_off[:, None] + offs_d[None, :]
        kv_mask = in_range[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if DOT_IN_FP32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s = s * qk_scale
        visible = in_range[None, :] & (key_pos[None, :] <= row_pos[:, None])
        if SLIDING_WINDOW > 0:
            visible = visible & (key_pos[None, :] > row_pos[:, None] - SLIDING_WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        p_v = p.to(v.dtype)
        if DOT_IN_FP32:
            acc = acc * alpha[:, None] + tl.dot(
                p_v.to(tl.float32), v.to(tl.float32), input_precision="ieee"
            )
        else:
            acc = acc * alpha[:, None] + tl.dot(p_v, v, input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    return acc, l_i, m_i


def attend_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """float32 attention of a sequence's last `len(query)` tokens over its first `seq_len`."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    kv = kv_cache[:, block_table[:num_blocks].long()].flatten(1, 2)[:, :seq_len].float()
    key, value = kv[0], kv[1]  # [seq_len, num_kv_heads, head_dim]
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), key) * scale
    q_pos = torch.arange(seq_len - query.shape[0], seq_len, device=query.device)[:, None]
    k_pos = torch.arange(seq_len, device=query.device)[None, :]
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, value)
