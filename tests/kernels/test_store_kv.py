"""store_kv against its torch reference: every slot, skipped slots, strided inputs."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.mark.parametrize(
    "block_size, num_kv_heads, head_dim, dtype",
    [(8, 2, 64, F32), (16, 1, 80, F16), (16, 8, 96, BF16), (512, 2, 128, F32), (32, 4, 256, F16)],
)
def test_store_kv_writes_exactly_the_mapped_slots(
    kernels: ModuleType, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    num_blocks, num_tokens = 5, 37
    # key and value as the model has them: views into one fused qkv projection
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim).to(dtype)
    key = qkv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    value = qkv[:, 2 * num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slot_mapping = torch.randperm(num_blocks * block_size)[:num_tokens]
    slot_mapping[torch.randint(0, num_tokens, (5,))] = -1  # padding tokens: not stored
    # NaN everywhere first: a slot written by one and not the other stays NaN on one side
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    kv_cache = kv_cache.to(dtype)
    expected = kv_cache.clone()
    kernels.store_kv(key, value, kv_cache, slot_mapping)
    kernels.store_kv_ref(key, value, expected, slot_mapping)
    torch.testing.assert_close(kv_cache, expected, rtol=0, atol=0, equal_nan=True)
    assert int((~kv_cache[0].isnan()).all(-1).all(-1).sum()) == int((slot_mapping >= 0).sum())


def test_store_kv_int32_slots_and_no_tokens(kernels: ModuleType) -> None:
    kv_cache = torch.zeros(2, 4, 8, 2, 64)
    key, value = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    kernels.store_kv(key, value, kv_cache, torch.tensor([31, 0, 9], dtype=torch.int32))
    assert torch.equal(kv_cache[0, 3, 7], key[0]) and torch.equal(kv_cache[1, 1, 1], value[2])
    kernels.store_kv(key[:0], value[:0], kv_cache, torch.tensor([], dtype=torch.long))


def test_store_kv_rejects_mismatched_inputs(kernels: ModuleType) -> None:
    kv_cache = torch.zeros(2, 4, 8, 2, 64)
    slots = torch.arange(3)
    with pytest.raises(ValueError, match="key and value must be"):
        kernels.store_kv(torch.randn(3, 1, 64), torch.randn(3, 1, 64), kv_cache, slots)
    with pytest.raises(ValueError, match="dtype"):
        kernels.store_kv(torch.randn(3, 2, 64).half(), torch.randn(3, 2, 64), kv_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        kernels.store_kv(torch.randn(3, 2, 64), torch.randn(3, 2, 64), kv_cache, slots.float())
