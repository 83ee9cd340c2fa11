"""Prepacked CPU linears: the same product as `F.linear`, through a bounded set of row counts
(oneDNN) or the bf16_linear op's column tiles (bfloat16 on AVX512-BF16, 32 outputs a tile)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from asyncengine.config import cpu_bf16_flag
from asyncengine.worker import cpu_ops
from asyncengine.worker.cpu_linear import PackedLinear, padded_rows

DTYPES = [
    torch.float32,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(
            not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no oneDNN bf16 here"
        ),
    ),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (5, 64), (3, 7, 64), (17, 64), (333, 64)])
@pytest.mark.parametrize("out_features", [96, 100])  # whole column tiles, or not
def test_a_packed_linear_is_f_linear_whatever_the_row_count(dtype, shape, out_features) -> None:
    torch.manual_seed(0)
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN: linears are not packed")
    linear = nn.Linear(64, out_features, bias=True).to(dtype)
    # (not `_can_pack`: a packed product that differs must fail here, not skip)
    x = torch.randn(*shape, dtype=dtype)
    with torch.inference_mode():
        expected = nn.functional.linear(x, linear.weight, linear.bias)
        packed = PackedLinear(linear)
        got = packed(x)
    # AMX keeps oneDNN's layout; AVX512-BF16 alone takes the op's column tiles where they fit
    op_here = cpu_bf16_flag() == "avx512_bf16" and cpu_ops.bf16_linear_available()
    assert packed.bf16_tiles == (op_here and dtype == torch.bfloat16 and out_features % 32 == 0)
    assert got.shape == expected.shape == (*shape[:-1], out_features)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


def test_row_counts_are_padded_to_a_bounded_set_with_at_most_an_eighth_more() -> None:
    counts = {rows: padded_rows(rows) for rows in range(1, 8193)}
    assert all(counts[rows] == rows for rows in range(1, 17))  # a decode of few rows: exact
    assert all(rows <= padded <= rows * 9 / 8 for rows, padded in counts.items())
    # oneDNN builds one primitive per count it sees: 8 per doubling, not one per step's size
    assert len(set(counts.values())) == 16 + 8 * 9
    assert all(padded_rows(padded) == padded for padded in counts.values())


@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (3, 7, 64), (40, 64)])
def test_a_gated_linear_keeps_its_columns_and_ends_in_silu_times_up(has_bias, shape) -> None:
    if not (cpu_bf16_flag() == "avx512_bf16" and cpu_ops.bf16_linear_available()):
        pytest.skip("a gate/up projection is paired only in bf16_linear's tiles (AVX512-BF16)")
    from transformers.activations import ACT2FN

    torch.manual_seed(0)
    linear = nn.Linear(64, 2 * 96, bias=has_bias).to(torch.bfloat16)  # gate, then up
    x = torch.randn(*shape, dtype=torch.bfloat16)
    with torch.inference_mode():
        plain, gated = PackedLinear(linear), PackedLinear(linear, gated=True)
        assert gated.is_gated and not plain.is_gated
        expected = plain(x)
        assert torch.equal(gated(x), expected)  # the columns in the linear's order
        gate, up = expected.chunk(2, dim=-1)
        got = gated.silu_and_mul(x)
    assert got.shape == (*shape[:-1], 96)
    is_equal = got == ACT2FN["silu"](gate) * up
    assert is_equal.float().mean() >= 0.99
    torch.testing.assert_close(got.float(), (ACT2FN["silu"](gate) * up).float(), atol=0, rtol=2**-7)
