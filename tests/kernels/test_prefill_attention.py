"""paged_prefill_attention against its float32 torch reference, under the interpreter."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from kv_inputs import assert_close, make_paged_kv

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# block_size, head_dim, num_heads, num_kv_heads, dtype, sliding_window, block_q, block_n,
# max_context (None: the wrapper's tiles)
CASES = [
    (16, 64, 4, 4, F32, None, None, None, 40),  # MHA, defaults
    (8, 128, 8, 1, F32, None, 2, 16, 30),  # GQA 8, 2 tokens x 8 heads per program
    (16, 80, 6, 2, F16, None, 8, 32, 50),  # GQA 3 (padded rows), head_dim 80
    (512, 96, 4, 2, BF16, None, 16, 64, 600),  # tiles inside a 512-token block
    (32, 256, 4, 2, F32, 24, 8, 16, 80),  # sliding window, head_dim 256
    (8, 64, 8, 2, F16, 7, 4, 16, 30),  # window shorter than a q block
    (64, 128, 16, 2, BF16, None, None, None, 100),  # GQA 8, default tiles
]


@pytest.mark.parametrize(
    "block_size, head_dim, num_heads, num_kv_heads, dtype, window, block_q, block_n, max_context",
    CASES,
)
def test_prefill_matches_reference(
    kernels: ModuleType,
    block_size: int,
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    window: int | None,
    block_q: int | None,
    block_n: int | None,
    max_context: int,
) -> None:
    # a fresh prompt, a cached prefix / resumed request, a single new token, another resume
    context_lens = [0, int(torch.randint(1, max_context + 1, ())), max_context, 3]
    new_lens = [int(n) for n in torch.randint(1, 40, (4,))]
    new_lens[2] = 1
    seq_lens = [c + n for c, n in zip(context_lens, new_lens)]
    kv = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(new_lens).cumsum(0)], dtype=torch.int32)
    query = torch.randn(sum(new_lens), num_heads, head_dim).to(dtype)
    out = torch.full_like(query, float("nan"))
    scale = head_dim**-0.5
    kernels.paged_prefill_attention(
        query, kv.kv_cache, kv.block_tables, kv.seq_lens, query_start_loc, scale,
        sliding_window=window, out=out, block_q=block_q, block_n=block_n,
    )  # fmt: skip
    expected = kernels.paged_prefill_attention_ref(
        query, kv.kv_cache, kv.block_tables, kv.seq_lens, query_start_loc, scale, window
    )
    assert_close(out, expected, dtype)


def test_prefill_of_a_whole_prompt_matches_sdpa(kernels: ModuleType) -> None:
    # an independent check of the reference's causal convention
    seq_len, num_heads, num_kv_heads, head_dim = 45, 4, 2, 64
    kv = make_paged_kv([seq_len], 16, num_kv_heads, head_dim, torch.float32)
    query = torch.randn(seq_len, num_heads, head_dim)
    out = kernels.paged_prefill_attention(
        query, kv.kv_cache, kv.block_tables, kv.seq_lens,
        torch.tensor([0, seq_len], dtype=torch.int32), 0.125,
    )  # fmt: skip
    key, value = kv.kv_cache[:, kv.block_tables[0].long()].flatten(1, 2)[:, :seq_len]
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1),
        is_causal=True, scale=0.125, enable_gqa=True,
    ).transpose(0, 1)  # fmt: skip
    assert_close(out, expected, torch.float32)


def test_prefill_rejects_bad_query_start_loc(kernels: ModuleType) -> None:
    kv = make_paged_kv([10, 4], 8, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="query_start_loc"):
        kernels.paged_prefill_attention(
            torch.randn(6, 4, 64), kv.kv_cache, kv.block_tables, kv.seq_lens,
            torch.tensor([0, 6]), 1.0,
        )  # fmt: skip
