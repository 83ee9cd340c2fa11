"""store_kv: write this step's new K and V rows into their paged-cache slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .utils import check_kv_cache, check_same_device, next_power_of_2, require


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim] (any strides)
    value_ptr,  # [num_tokens, num_kv_heads, head_dim] (any strides)
    kv_cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim], head_dim stride 1
    slot_mapping_ptr,  # [num_tokens] int32/int64: block * block_size + offset, -1 = skip
    num_tokens,
    stride_k_tok,
    stride_k_head,
    stride_k_dim,
    stride_v_tok,
    stride_v_head,
    stride_v_dim,
    stride_c_kv,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HD: tl.constexpr,
):
    # a [BLOCK_T tokens, BLOCK_HD of (head, dim)] tile; K and V move together
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_hd = tl.program_id(1) * BLOCK_HD + tl.arange(0, BLOCK_HD)
    head, dim = offs_hd // HEAD_DIM, offs_hd % HEAD_DIM
    slot = tl.load(slot_mapping_ptr + offs_t, mask=offs_t < num_tokens, other=-1).to(tl.int64)
    mask = (slot >= 0)[:, None] & (offs_hd < NUM_KV_HEADS * HEAD_DIM)[None, :]
    tok = offs_t.to(tl.int64)[:, None]
    key = tl.load(
        key_ptr + tok * stride_k_tok + (head * stride_k_head + dim * stride_k_dim)[None, :],
        mask=mask,
    )
    value = tl.load(
        value_ptr + tok * stride_v_tok + (head * stride_v_head + dim * stride_v_dim)[None, :],
        mask=mask,
    )
    dst = ((slot // BLOCK_SIZE) * stride_c_block + (slot % BLOCK_SIZE) * stride_c_slot)[:, None] + (
        head * stride_c_head + dim
    )[None, :]
    tl.store(kv_cache_ptr + dst, key, mask=mask)
    tl.store(kv_cache_ptr + stride_c_kv + dst, value, mask=mask)


def store_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write key/value ([num_tokens, num_kv_heads, head_dim]) into `kv_cache` at `slot_mapping`.

    Slots are `block * block_size + offset`; a slot of -1 (a padding token) is skipped.
    """
    check_kv_cache(kv_cache)
    check_same_device(key, value, kv_cache, slot_mapping)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_tokens = key.shape[0]
    expected = (num_tokens, num_kv_heads, head_dim)
    require(
        tuple(key.shape) == expected and tuple(value.shape) == expected,
        f"key and value must be {expected}, got {tuple(key.shape)} and {tuple(value.shape)}",
    )
    require(
        key.dtype == value.dtype == kv_cache.dtype,
        f"key/value dtype ({key.dtype}/{value.dtype}) must match the cache ({kv_cache.dtype})",
    )
    require(
        slot_mapping.shape == (num_tokens,) and slot_mapping.dtype in (torch.int32, torch.int64),
        f"slot_mapping must be [{num_tokens}] int32/int64, got "
        f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}",
    )
    if num_tokens == 0:
        return
    width = num_kv_heads * head_dim
    block_hd = min(next_power_of_2(width), 1024)
    block_t = max(1, 4096 // block_hd)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(width, block_hd))
    _store_kv_kernel[grid](
        key,
        value,
        kv_cache,
        slot_mapping,
        num_tokens,
        *key.stride(),
        *value.stride(),
        *kv_cache.stride()[:4],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_T=block_t,
        BLOCK_HD=block_hd,
        num_warps=4,
    )


def store_kv_ref(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Plain-torch `store_kv`."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    assert bool((blocks < num_blocks).all())
    kv_cache[0, blocks, offsets] = key[keep]
    kv_cache[1, blocks, offsets] = value[keep]
