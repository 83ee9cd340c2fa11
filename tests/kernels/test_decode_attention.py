"""paged_decode_attention against its float32 torch reference, under the interpreter."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from kv_inputs import assert_close, make_paged_kv, random_seq_lens

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# block_size, head_dim, num_heads, num_kv_heads, dtype, num_splits, sliding_window, block_n,
# max_len (None: splits / tile from the wrapper's heuristics)
CASES = [
    (16, 64, 4, 4, F32, None, None, None, 100),  # MHA, defaults
    (8, 128, 8, 1, F32, 3, None, 16, 60),  # GQA 8, tiles of 2 blocks, 3 splits
    (16, 80, 6, 2, F16, 2, None, 32, 70),  # GQA 3 (padded rows), head_dim 80
    (512, 96, 4, 2, BF16, 4, None, 64, 700),  # tiles inside a 512-token block
    (32, 256, 8, 2, F32, None, 40, 16, 120),  # GQA 4, sliding window, head_dim 256
    (1024, 64, 2, 1, F16, 2, 300, None, 1100),  # block 1024, window across the block edge
    (64, 128, 16, 2, BF16, None, None, None, 200),  # GQA 8, default tile
    (8, 64, 4, 2, F32, 6, None, 16, 40),  # more splits than short sequences fill
]


@pytest.mark.parametrize(
    "block_size, head_dim, num_heads, num_kv_heads, dtype, num_splits, window, block_n, max_len",
    CASES,
)
def test_decode_matches_reference(
    kernels: ModuleType,
    block_size: int,
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    num_splits: int | None,
    window: int | None,
    block_n: int | None,
    max_len: int,
) -> None:
    seq_lens = random_seq_lens(3, block_size, max_len)
    kv = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype)
    query = torch.randn(len(seq_lens), num_heads, head_dim).to(dtype)
    out = torch.full_like(query, float("nan"))
    scale = head_dim**-0.5
    kernels.paged_decode_attention(
        query, kv.kv_cache, kv.block_tables, kv.seq_lens, scale,
        max_seq_len=max(seq_lens), sliding_window=window, out=out,
        num_splits=num_splits, block_n=block_n,
    )  # fmt: skip
    expected = kernels.paged_decode_attention_ref(
        query, kv.kv_cache, kv.block_tables, kv.seq_lens, scale, sliding_window=window
    )
    assert_close(out, expected, dtype)


def test_decode_reads_rows_of_a_strided_query(kernels: ModuleType) -> None:
    # the model's query is a view into a fused qkv projection: rows are not back to back
    seq_lens = [5, 23]
    kv = make_paged_kv(seq_lens, 8, 2, 64, torch.float32)
    qkv = torch.randn(2, 4 * 64 + 2 * 2 * 64)
    query = qkv[:, : 4 * 64].view(2, 4, 64)
    out = kernels.paged_decode_attention(query, kv.kv_cache, kv.block_tables, kv.seq_lens, 0.125)
    expected = kernels.paged_decode_attention_ref(
        query, kv.kv_cache, kv.block_tables, kv.seq_lens, 0.125
    )
    assert_close(out, expected, torch.float32)


def test_split_heuristic_fills_the_device_only_when_needed(kernels: ModuleType) -> None:
    sms = 132  # H200: a target of 4 programs per SM
    assert kernels.choose_num_splits(64, 8, 32768, sms, 64) == 1  # the batch fills it
    assert kernels.choose_num_splits(16, 8, 4096, sms, 64) == 4
    assert kernels.choose_num_splits(1, 8, 32768, sms, 64) == 64  # capped
    assert kernels.choose_num_splits(1, 8, 4096, sms, 64) == 16  # >= 256 keys per split
    assert kernels.choose_num_splits(1, 8, 300, sms, 64) == 1  # too short to split
    assert kernels.choose_num_splits(1, 8, 32768, sms, 64, sliding_window=1000) == 4


def test_decode_rejects_bad_inputs(kernels: ModuleType) -> None:
    kv = make_paged_kv([10], 8, 2, 64, torch.float32)
    query = torch.randn(1, 3, 64)  # 3 heads over 2 KV heads
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        kernels.paged_decode_attention(query, kv.kv_cache, kv.block_tables, kv.seq_lens, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        kernels.paged_decode_attention(
            torch.randn(1, 4, 64).half(), kv.kv_cache, kv.block_tables, kv.seq_lens, 1.0
        )
    with pytest.raises(ValueError, match="block_tables"):
        kernels.paged_decode_attention(
            torch.randn(1, 4, 64), kv.kv_cache, kv.block_tables.long(), kv.seq_lens, 1.0
        )
