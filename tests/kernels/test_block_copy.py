"""copy_blocks and the swap paths against their torch references: bit-exact, every layer."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def make_layers(num_layers: int, num_blocks: int, block_size: int, dtype: torch.dtype,
                fill: str = "randn") -> list[torch.Tensor]:  # fmt: skip
    shape = (2, num_blocks, block_size, 2, 64)
    if fill == "nan":
        return [torch.full(shape, float("nan")).to(dtype) for _ in range(num_layers)]
    return [torch.randn(shape).to(dtype) for _ in range(num_layers)]


def assert_layers_equal(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for layer, (a, e) in enumerate(zip(actual, expected, strict=True)):
        torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True, msg=f"layer {layer}")


@pytest.mark.parametrize("block_size, dtype", [(8, F32), (16, F16), (512, BF16)])
def test_copy_on_write_copies_within_one_pool(
    kernels: ModuleType, block_size: int, dtype: torch.dtype
) -> None:
    caches = make_layers(3, 9, block_size, dtype)
    # distinct destinations, a source used twice, out of order
    order = torch.randperm(9).tolist()
    pairs = torch.tensor([[order[0], order[3]], [order[1], order[4]], [order[0], order[5]]])
    expected = [c.clone() for c in caches]
    kernels.copy_blocks(caches, caches, pairs)
    kernels.copy_blocks_ref(expected, expected, pairs)
    assert_layers_equal(caches, expected)


def test_copy_between_pools_of_different_sizes(kernels: ModuleType) -> None:
    src = make_layers(2, 6, 16, F16)
    dst = make_layers(2, 11, 16, F16, fill="nan")  # untouched blocks must stay NaN
    pairs = torch.tensor([[5, 10], [0, 0], [3, 7]])
    expected = [d.clone() for d in dst]
    kernels.copy_blocks(src, dst, pairs)
    kernels.copy_blocks_ref(src, expected, pairs)
    assert_layers_equal(dst, expected)


@pytest.mark.parametrize("block_size, dtype", [(8, BF16), (512, F32)])
def test_swap_out_then_in_round_trips(
    kernels: ModuleType, block_size: int, dtype: torch.dtype
) -> None:
    device_pool = make_layers(2, 7, block_size, dtype)
    host_pool = make_layers(2, 5, block_size, dtype, fill="nan")
    out_pairs = [(6, 0), (2, 3), (4, 1)]
    expected_host = [h.clone() for h in host_pool]
    kernels.swap_out_blocks(device_pool, host_pool, out_pairs)
    kernels.swap_blocks_ref(device_pool, expected_host, out_pairs)
    assert_layers_equal(host_pool, expected_host)

    in_pairs = [(3, 5), (0, 0), (1, 2)]
    expected_device = [d.clone() for d in device_pool]
    kernels.swap_in_blocks(host_pool, device_pool, in_pairs)
    kernels.swap_blocks_ref(expected_host, expected_device, in_pairs)
    assert_layers_equal(device_pool, expected_device)


def test_empty_pair_lists_are_no_ops(kernels: ModuleType) -> None:
    caches = make_layers(1, 2, 8, F32)
    before = caches[0].clone()
    kernels.copy_blocks(caches, caches, torch.empty(0, 2, dtype=torch.long))
    kernels.swap_out_blocks(caches, caches, [])
    kernels.swap_in_blocks(caches, caches, [])
    assert torch.equal(caches[0], before)


def test_copy_blocks_rejects_mismatched_layers(kernels: ModuleType) -> None:
    with pytest.raises(ValueError, match="same block shape"):
        kernels.copy_blocks(
            [torch.zeros(2, 4, 8, 2, 64), torch.zeros(2, 4, 8, 2, 32)],
            [torch.zeros(2, 4, 8, 2, 64)] * 2,
            torch.tensor([[0, 1]]),
        )
