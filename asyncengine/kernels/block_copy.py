"""Block copy and swap: one launch moves a whole list of (src, dst) block pairs of every layer.

`copy_blocks` copies blocks between two lists of per-layer caches on one device (copy-on-write
copies, or gathers into / scatters out of a staging buffer laid out like a cache). The kernel
reads each layer's base address from a table, so all layers and pairs share one launch; the copy
is bitwise, so any dtype works. GPU <-> CPU swaps go through a staging buffer: swap-out gathers
the blocks on the device (one launch), makes one device-to-host copy into pinned memory and
scatters them on the CPU; swap-in does the reverse. Both run on the current stream: the forward
that follows reads the swapped-in blocks and may overwrite the swapped-out ones, so a side stream
would only add the event waits that restore this order.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .utils import check_same_device, next_power_of_2, require

_BITWISE_TYPES = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


@triton.jit
def _copy_blocks_kernel(
    src_ptrs,  # [num_layers] int64: address of each layer's source [2, num_blocks, ...] tensor
    dst_ptrs,  # [num_layers] int64: address of each layer's destination tensor
    block_pairs_ptr,  # [num_pairs, 2] int64: (src block, dst block)
    src_stride_kv,
    src_stride_block,
    dst_stride_kv,
    dst_stride_block,
    block_numel,  # elements of one block of K (or of V): block_size * num_kv_heads * head_dim
    ELEM: tl.constexpr,  # an integer type as wide as the cache's element
    BLOCK: tl.constexpr,
):
    pair = tl.program_id(0)
    layer = tl.program_id(1) // 2
    kv = tl.program_id(1) % 2
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_numel
    src_block = tl.load(block_pairs_ptr + 2 * pair)
    dst_block = tl.load(block_pairs_ptr + 2 * pair + 1)
    src = tl.load(src_ptrs + layer).to(tl.pointer_type(ELEM))
    dst = tl.load(dst_ptrs + layer).to(tl.pointer_type(ELEM))
    src = src + kv * src_stride_kv + src_block * src_stride_block
    dst = dst + kv * dst_stride_kv + dst_block * dst_stride_block
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@functools.lru_cache(maxsize=64)
def _address_table(addresses: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # the caches live as long as the engine, so their table is built once; staging buffers
    # from the caching allocator mostly come back at the same addresses
    return torch.tensor(addresses, dtype=torch.int64, device=device)


def _check_layers(caches: Sequence[torch.Tensor], name: str) -> None:
    require(len(caches) > 0, f"{name} must hold at least one layer")
    first = caches[0]
    require(
        first.dim() >= 3 and first.shape[0] == 2,
        f"{name} layers must be [2, num_blocks, ...], got {tuple(first.shape)}",
    )
    block_shape = first.shape[2:]
    contiguous = torch.empty(block_shape, device="meta").stride()
    require(
        tuple(first.stride()[2:]) == tuple(contiguous),
        f"{name}: each block of a layer must be contiguous",
    )
    for cache in caches[1:]:
        require(
            cache.shape[2:] == block_shape
            and cache.stride() == first.stride()
            and cache.dtype == first.dtype
            and cache.device == first.device,
            f"{name}: every layer must have the same block shape, strides, dtype and device",
        )


def copy_blocks(
    src_caches: Sequence[torch.Tensor],
    dst_caches: Sequence[torch.Tensor],
    block_pairs: torch.Tensor,
) -> None:
    """For every layer l and pair (s, d): dst_caches[l][:, d] = src_caches[l][:, s].

    Caches are per layer [2, num_blocks, block_size, num_kv_heads, head_dim] (the block count
    may differ between src and dst); block_pairs is [num_pairs, 2] int64 on their device.
    """
    _check_layers(src_caches, "src_caches")
    _check_layers(dst_caches, "dst_caches")
    src, dst = src_caches[0], dst_caches[0]
    check_same_device(src, dst, block_pairs)
    require(len(src_caches) == len(dst_caches), "src and dst must have the same number of layers")
    require(
        src.shape[2:] == dst.shape[2:] and src.dtype == dst.dtype,
        "src and dst blocks must have the same shape and dtype",
    )
    require(
        block_pairs.dim() == 2
        and block_pairs.shape[1] == 2
        and block_pairs.dtype == torch.int64
        and block_pairs.is_contiguous(),
        f"block_pairs must be a contiguous [num_pairs, 2] int64 tensor, got "
        f"{tuple(block_pairs.shape)} {block_pairs.dtype}",
    )
    num_pairs = block_pairs.shape[0]
    if num_pairs == 0:
        return
    block_numel = src[0, 0].numel()
    chunk = min(next_power_of_2(block_numel), 4096)
    grid = (num_pairs, 2 * len(src_caches), triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](
        _address_table(tuple(t.data_ptr() for t in src_caches), src.device),
        _address_table(tuple(t.data_ptr() for t in dst_caches), dst.device),
        block_pairs,
        src.stride(0),
        src.stride(1),
        dst.stride(0),
        dst.stride(1),
        block_numel,
        ELEM=_BITWISE_TYPES[src.element_size()],
        BLOCK=chunk,
        num_warps=4,
    )


def copy_blocks_ref(
    src_caches: Sequence[torch.Tensor],
    dst_caches: Sequence[torch.Tensor],
    block_pairs: torch.Tensor,
) -> None:
    """Plain-torch `copy_blocks` (pairs applied in order)."""
    for s, d in block_pairs.tolist():
        for src, dst in zip(src_caches, dst_caches):
            dst[:, d] = src[:, s]


def _staging(
    like: torch.Tensor, num_layers: int, num_pairs: int, device: torch.device
) -> torch.Tensor:
    # laid out like a cache of num_pairs blocks per layer, so copy_blocks can fill or drain it
    shape = (num_layers, 2, num_pairs, *like.shape[2:])
    pin = device.type == "cpu" and torch.cuda.is_available()
    return torch.empty(shape, dtype=like.dtype, device=device, pin_memory=pin)


def swap_out_blocks(
    device_caches: Sequence[torch.Tensor],
    host_caches: Sequence[torch.Tensor],
    block_pairs: list[tuple[int, int]],
) -> None:
    """Copy device blocks to host blocks, (device block, host block) per pair, every layer."""
    if not block_pairs:
        return
    device, num_layers = device_caches[0].device, len(device_caches)
    staging = _staging(device_caches[0], num_layers, len(block_pairs), device)
    gather = [(s, j) for j, (s, _) in enumerate(block_pairs)]
    copy_blocks(device_caches, list(staging), torch.tensor(gather, device=device))
    host = staging
    if device.type != "cpu":
        host = _staging(device_caches[0], num_layers, len(block_pairs), torch.device("cpu"))
        host.copy_(staging, non_blocking=True)
        torch.cuda.current_stream(device).synchronize()  # the CPU scatter reads it next
    dst = torch.tensor([d for _, d in block_pairs])
    for layer, cache in enumerate(host_caches):
        cache.index_copy_(1, dst, host[layer])


def swap_in_blocks(
    host_caches: Sequence[torch.Tensor],
    device_caches: Sequence[torch.Tensor],
    block_pairs: list[tuple[int, int]],
) -> None:
    """Copy host blocks to device blocks, (host block, device block) per pair, every layer."""
    if not block_pairs:
        return
    device, num_layers = device_caches[0].device, len(device_caches)
    host = _staging(host_caches[0], num_layers, len(block_pairs), torch.device("cpu"))
    src = torch.tensor([s for s, _ in block_pairs])
    for layer, cache in enumerate(host_caches):
        torch.index_select(cache, 1, src, out=host[layer])
    # pinned source: the copy is asynchronous and the caching host allocator keeps the buffer
    # alive until it is done
    staging = host.to(device, non_blocking=True)
    scatter = [(j, d) for j, (_, d) in enumerate(block_pairs)]
    copy_blocks(list(staging), device_caches, torch.tensor(scatter, device=device))


def swap_blocks_ref(
    src_caches: Sequence[torch.Tensor],
    dst_caches: Sequence[torch.Tensor],
    block_pairs: list[tuple[int, int]],
) -> None:
    """Plain-torch `swap_out_blocks` / `swap_in_blocks`: one block at a time."""
    for s, d in block_pairs:
        for src, dst in zip(src_caches, dst_caches):
            dst[:, d] = src[:, s].to(dst.device)
