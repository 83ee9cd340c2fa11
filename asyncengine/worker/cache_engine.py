"""The KV cache tensors of both pools, and the block moves (swap, copy) between them."""

from __future__ import annotations

import torch

from asyncengine.core.scheduler import SchedulerOutput


class CacheEngine:
    """Per layer, one tensor per pool: [2 (K, V), num_blocks, block_size, kv_heads, head_dim].

    With `use_triton_kernels`, block moves use asyncengine.kernels: one launch per list of
    pairs for all layers, and swaps through one staging copy.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        dtype: torch.dtype,
        device: str,
        use_triton_kernels: bool = False,
    ) -> None:
        self.device = device
        self.use_triton_kernels = use_triton_kernels

        def pool(num_blocks: int, where: str, pin: bool, zeroed: bool) -> list[torch.Tensor]:
            shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
            new = torch.zeros if zeroed else torch.empty
            return [
                new(shape, dtype=dtype, device=where, pin_memory=pin) for _ in range(num_layers)
            ]

        # Attention may read slots past a sequence's end (padding, a block's unused tail) and
        # weighs them by exactly 0; zeroing the device pool once keeps them finite (0 * NaN is
        # NaN). The swap pool only ever receives copies of device blocks, so it may stay empty.
        self.gpu_cache = pool(num_gpu_blocks, device, pin=False, zeroed=True)
        self.cpu_cache = pool(num_cpu_blocks, "cpu", pin=device == "cuda", zeroed=False)

    @staticmethod
    def bytes_per_block(
        num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    def apply(self, plan: SchedulerOutput) -> None:
        """Swap out, swap in, then copy-on-write copies: all before the forward that needs them."""
        if self.use_triton_kernels:
            self._apply_with_kernels(plan)
            return
        if plan.blocks_to_swap_out:
            self._move(self.gpu_cache, self.cpu_cache, plan.blocks_to_swap_out)
        if plan.blocks_to_swap_in:
            self._move(self.cpu_cache, self.gpu_cache, plan.blocks_to_swap_in)
        if plan.blocks_to_copy:
            self._move(self.gpu_cache, self.gpu_cache, plan.blocks_to_copy)

    def _apply_with_kernels(self, plan: SchedulerOutput) -> None:
        from asyncengine.kernels import copy_blocks, swap_in_blocks, swap_out_blocks

        swap_out_blocks(self.gpu_cache, self.cpu_cache, plan.blocks_to_swap_out)
        swap_in_blocks(self.cpu_cache, self.gpu_cache, plan.blocks_to_swap_in)
        if plan.blocks_to_copy:
            pairs = torch.tensor(plan.blocks_to_copy, dtype=torch.long, device=self.device)
            copy_blocks(self.gpu_cache, self.gpu_cache, pairs)

    @staticmethod
    def _move(
        src_cache: list[torch.Tensor], dst_cache: list[torch.Tensor], pairs: list[tuple[int, int]]
    ) -> None:
        # one gather and one scatter per layer for the whole list of pairs
        src_device, dst_device = src_cache[0].device, dst_cache[0].device
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=src_device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=dst_device)
        for src_layer, dst_layer in zip(src_cache, dst_cache):
            blocks = src_layer.index_select(1, src).to(dst_device)
            dst_layer.index_copy_(1, dst, blocks)
