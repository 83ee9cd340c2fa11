"""The CPU ops (asyncengine/worker/cpu_ops.py): decode and prefill attention against their
plain-torch references, the torch backend's attention over mixed prefill + decode batches
against plain attention, and the pointwise layers against transformers' own (the model code
they replace)."""

from __future__ import annotations

import shutil
import zlib
from collections.abc import Callable, Iterator

import pytest
import torch

from asyncengine.testing import torch_threads
from asyncengine.worker import cpu_ops
from asyncengine.worker.attention import paged_attention
from asyncengine.worker.forward_context import AttentionMetadata

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
TOLERANCE = {F32: (1e-5, 1e-5), F16: (5e-3, 5e-3), BF16: (2e-2, 2e-2)}  # (atol, rtol)


@pytest.fixture(scope="module", autouse=True)
def ops_built() -> None:
    if not cpu_ops.load():
        if shutil.which("c++") or shutil.which("g++"):
            pytest.fail("a C++ compiler is on PATH but the CPU ops did not build (see the log)")
        pytest.skip("no C++ compiler: the CPU ops cannot be built here")


@pytest.fixture(autouse=True)
def _fresh_seed(request: pytest.FixtureRequest) -> Iterator[None]:
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield


def make_paged_kv(
    seq_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    unused: float = float("nan"),
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_cache, block_tables): random blocks in shuffled order, sequences sharing their first
    block where they span several; every slot no sequence holds is `unused` (NaN: a read past a
    sequence's end or before its window shows in the output). Padding names real blocks."""
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 2
    free = torch.randperm(num_blocks).tolist()
    tables = [[free.pop() for _ in range(n)] for n in needed]
    donor = max(range(len(tables)), key=lambda i: len(tables[i]))
    for table in tables:
        if len(tables[donor]) > 1 and len(table) > 1:
            table[0] = tables[donor][0]  # a shared, full prefix block
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), unused)
    filled: set[int] = set()
    for table, n in zip(tables, seq_lens):
        for i, block in enumerate(table):
            used = min(block_size, n - i * block_size)
            if block not in filled:  # a shared block is filled once
                cache[:, block, :used] = torch.randn(2, used, num_kv_heads, head_dim)
                filled.add(block)
    width = max(needed)
    padded = [t + torch.randint(0, num_blocks, (width - len(t),)).tolist() for t in tables]
    return cache.to(dtype), torch.tensor(padded, dtype=torch.int32)


def seq_lens_for(block_size: int, num_seqs: int = 5) -> list[int]:
    """One of length 1, one ending exactly on a block edge, one a block and a bit, the rest
    random up to three blocks (at most 1,500 tokens)."""
    max_len = min(3 * block_size, 1500)
    lens = [1, block_size, block_size + 1]
    lens += torch.randint(1, max_len + 1, (num_seqs - len(lens),)).tolist()
    return lens


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


# block_size, num_heads, num_kv_heads, head_dim, dtype, sliding_window
CASES = [
    *[(bs, 8, 2, 64, F32, None) for bs in (8, 16, 32, 64, 128, 256, 512, 1024)],
    *[(bs, 12, 3, 64, BF16, None) for bs in (8, 16, 32, 64, 128, 256, 512, 1024)],
    (16, 4, 4, 128, F32, None),  # MHA
    (16, 8, 1, 64, BF16, None),  # one KV head for all
    (32, 6, 2, 80, F16, None),  # head_dim not a power of two
    # where AVX-512 keeps V's sums in registers: every dtype, head_dim 64 and 128
    (16, 8, 2, 64, F16, None),
    (16, 4, 2, 128, BF16, None),
    (16, 8, 4, 128, F32, 20),
    (8, 8, 2, 64, F32, 5),  # window shorter than a block
    (16, 8, 2, 64, BF16, 40),  # window across block edges
    # bf16 query heads by fours in bf16 pairs (AVX512-BF16): head_dim 96; 80 and 3 a KV head not
    (16, 8, 1, 96, BF16, None),
    (16, 6, 2, 80, BF16, None),
    (1024, 4, 2, 64, F32, 700),  # window inside one big block
    (64, 16, 2, 256, F32, 100),  # GQA 8, head_dim 256
]


@pytest.mark.parametrize(
    "block_size, num_heads, num_kv_heads, head_dim, dtype, window", CASES, ids=str
)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_decode_op_matches_reference(
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    window: int | None,
    num_threads: int,
) -> None:
    seq_lens = seq_lens_for(block_size)
    cache, tables = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype)
    query = torch.randn(len(seq_lens), num_heads, head_dim).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)  # one sequence per thread, or one KV head per thread
    try:
        out = cpu_ops.paged_decode_attention(query, cache, tables, lens, scale, window)
    finally:
        torch.set_num_threads(previous)
    expected = cpu_ops.paged_decode_attention_ref(query, cache, tables, lens, scale, window)
    assert_close(out, expected, dtype)


def test_decode_op_checks_its_inputs() -> None:
    cache, tables = make_paged_kv([10], 8, 2, 64, F32)
    lens = torch.tensor([10], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        cpu_ops.paged_decode_attention(torch.randn(1, 3, 64), cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        cpu_ops.paged_decode_attention(torch.randn(1, 4, 64).half(), cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="int32"):
        cpu_ops.paged_decode_attention(torch.randn(1, 4, 64), cache, tables.long(), lens, 1.0)


# num_heads, num_kv_heads, head_dim, dtype, sliding_window; (context_len, new tokens) per sequence
PREFILL_SHAPES = [(0, 1), (0, 7), (0, 33), (17, 9), (5, 70), (100, 40), (0, 130)]
PREFILL_CASES = [
    (8, 2, 64, F32, None),
    (12, 3, 64, BF16, None),
    (12, 12, 64, BF16, None),  # MHA: one query head a KV head
    (6, 2, 80, F16, None),  # head_dim not a multiple of 16: V's sum in plain loops
    (4, 2, 128, F32, None),
    (16, 2, 256, BF16, None),
    (6, 2, 80, BF16, None),  # bf16 pairs: head_dim a multiple of 16, not of 32
    (4, 2, 72, BF16, None),  # head_dim not a multiple of 16: bf16 in the float32 loops
    (4, 1, 128, BF16, 90),  # a window reaching back into the context, in bf16 pairs
    (8, 2, 64, F32, 24),  # a window inside a block of query rows
    (8, 8, 64, BF16, 5),  # a window shorter than a vector of keys
    (4, 1, 128, F32, 90),  # a window reaching back into the context
]


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, dtype, window", PREFILL_CASES, ids=str)
@pytest.mark.parametrize("block_size", [8, 16, 128])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_prefill_op_matches_reference(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    window: int | None,
    block_size: int,
    num_threads: int,
) -> None:
    """Fresh prompts, chunks after a context, one-token and long queries in one call: query rows
    cross the op's groups of 16 and its work items, keys its vectors of 16 and the blocks."""
    seq_lens = [context + new for context, new in PREFILL_SHAPES]
    cache, tables = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype)
    starts = [0]
    for _, new in PREFILL_SHAPES:
        starts.append(starts[-1] + new)
    query = torch.randn(starts[-1], num_heads, head_dim).to(dtype)
    args = (
        cache,
        tables,
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        head_dim**-0.5,
        window,
    )
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        out = cpu_ops.paged_prefill_attention(query, *args)
    finally:
        torch.set_num_threads(previous)
    assert_close(out, cpu_ops.paged_prefill_attention_ref(query, *args), dtype)


def test_prefill_op_checks_its_inputs() -> None:
    cache, tables = make_paged_kv([10], 8, 2, 64, F32)
    lens = torch.tensor([10], dtype=torch.int32)
    starts = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        cpu_ops.paged_prefill_attention(
            torch.randn(4, 4, 64), cache, tables, starts.long(), lens, 1.0
        )
    with pytest.raises(ValueError, match="dtype"):
        cpu_ops.paged_prefill_attention(
            torch.randn(4, 4, 64).half(), cache, tables, starts, lens, 1.0
        )
    with pytest.raises(RuntimeError, match="query_start_loc must run"):  # 4 rows said, 5 given
        cpu_ops.paged_prefill_attention(torch.randn(5, 4, 64), cache, tables, starts, lens, 1.0)
    with pytest.raises(RuntimeError, match="new tokens but seq_len"):  # more new tokens than held
        cpu_ops.paged_prefill_attention(
            torch.randn(11, 4, 64),
            cache,
            tables,
            torch.tensor([0, 11], dtype=torch.int32),
            lens,
            1.0,
        )


def plain_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    context_len: int,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Causal attention of one sequence's new tokens, float32, a head and a token at a time."""
    group = query.shape[1] // key.shape[1]
    out = torch.empty(query.shape, dtype=torch.float32)
    for t in range(query.shape[0]):
        pos = context_len + t
        start = 0 if window is None else max(0, pos + 1 - window)
        for head in range(query.shape[1]):
            k, v = (
                key[start : pos + 1, head // group].float(),
                value[start : pos + 1, head // group],
            )
            weights = torch.softmax(k @ query[t, head].float() * scale, 0)
            out[t, head] = weights @ v.float()
    return out


@pytest.mark.parametrize("block_size", [8, 16, 64, 512, 1024])
@pytest.mark.parametrize(("dtype", "window"), [(F32, None), (BF16, None), (F32, 24)])
@pytest.mark.parametrize("has_cpu_op", [True, False])
def test_mixed_prefill_and_decode_batch_matches_plain_attention(
    monkeypatch: pytest.MonkeyPatch,
    block_size: int,
    dtype: torch.dtype,
    window: int | None,
    has_cpu_op: bool,
) -> None:
    unused = float("nan")
    if not has_cpu_op:  # the plain-torch decode that runs where the op cannot be built
        monkeypatch.setattr(cpu_ops, "is_loaded", lambda: False)
        unused = 1e3  # it reads padding slots (finite: stale K/V) and masks them out
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    # (context_len, new tokens): three decodes; short queries (drafts under verification after
    # a context, a short prompt); a fresh prompt, a chunk after a context, a short query
    shape = [(0, 1), (block_size + 2, 1), (40, 1), (block_size + 3, 6), (0, 4), (5, 8),
             (0, 30), (block_size + 5, 17), (3, 5)]  # fmt: skip
    seq_lens = [c + n for c, n in shape]
    cache, tables = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, unused)
    # the new tokens' K/V are already in the cache (torch_attention stores them first)
    starts = [0]
    for _, n in shape:
        starts.append(starts[-1] + n)
    query = torch.randn(starts[-1], num_heads, head_dim).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.long),
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=starts,
        context_lens=[c for c, _ in shape],
        seq_lens_list=seq_lens,
        num_decodes=3,
        max_seq_len=max(seq_lens),
    )
    scale = head_dim**-0.5
    out = paged_attention(query, cache, meta, scale, window)
    for i, (context_len, _) in enumerate(shape):
        blocks = tables[i, : -(-seq_lens[i] // block_size)].long()
        key, value = cache[:, blocks].flatten(1, 2)[:, : seq_lens[i]]
        rows = slice(starts[i], starts[i + 1])
        expected = plain_attention(query[rows], key, value, context_len, scale, window)
        assert_close(out[rows], expected, dtype)


def assert_same_rounding(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: equal to ~1 ulp. bf16: equal but for a few values one bf16 step apart (where
    the float32 sums, taken in another order, straddle a rounding boundary)."""
    if dtype == F32:
        torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-6)
        return
    assert actual.dtype == expected.dtype == dtype
    is_equal = actual == expected
    assert is_equal.float().mean() >= 0.99, f"only {is_equal.float().mean():.1%} bit-equal"
    torch.testing.assert_close(actual.float(), expected.float(), atol=0, rtol=2**-7)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize(("rows", "dim"), [(1, 64), (37, 768), (300, 1000)])
def test_rms_norm_matches_transformers(dtype: torch.dtype, rows: int, dim: int) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(dim, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.rand(dim) + 0.5)
    x = (torch.randn(rows, dim) * 3).to(dtype)
    with torch.inference_mode():
        assert_same_rounding(cpu_ops.rms_norm(x, hf.weight, 1e-6), hf(x), dtype)


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize(("rows", "dim"), [(1, 64), (37, 768), (300, 1000)])
def test_add_rms_norm_is_the_residual_add_then_transformers_norm(
    dtype: torch.dtype, rows: int, dim: int
) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(dim, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.rand(dim) + 0.5)
    x, residual = (torch.randn(rows, dim) * 3).to(dtype), (torch.randn(rows, dim) * 3).to(dtype)
    with torch.inference_mode():
        summed = residual + x  # transformers' decoder layer: `residual + hidden_states`
        expected = hf(summed)
        alone = cpu_ops.rms_norm(summed, hf.weight, 1e-6)
        out, new_residual = cpu_ops.add_rms_norm(x, residual, hf.weight, 1e-6)
    assert new_residual.data_ptr() == residual.data_ptr()  # the sum went into it
    assert torch.equal(residual, summed)  # one rounding of a float32 sum, as torch's add
    # the norm's arithmetic is rms_norm's (tested against transformers above), in one pass
    assert torch.equal(out, alone)
    # against transformers: its mean of squares sums in another order, so a value at a
    # rounding boundary of the normed x can round the other way, and the weight's product
    # after it round again: two bf16 steps at most
    if dtype == F32:
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    else:
        assert (out == expected).float().mean() >= 0.99
        torch.testing.assert_close(out.float(), expected.float(), atol=0, rtol=2**-6)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize(("num_heads", "head_dim"), [(4, 64), (3, 128), (2, 80)])
def test_rotary_embedding_matches_transformers_in_place_on_a_strided_view(
    dtype: torch.dtype, num_heads: int, head_dim: int
) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    num_tokens, max_positions = 29, 4096
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos() * 1.1, freqs.sin() * 1.1  # an attention scaling, as llama3's
    positions = torch.randint(0, max_positions, (num_tokens,))
    # x is the first heads of a wider row, as q is of the fused qkv projection
    fused = torch.randn(num_tokens, (num_heads + 3) * head_dim).to(dtype)
    x = fused[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    rest = fused[:, num_heads * head_dim :].clone()
    # transformers: [batch, heads, tokens, dim], cos/sin doubled and cast to x's dtype
    hf_cos, hf_sin = (torch.cat([t, t], -1)[positions][None].to(dtype) for t in (cos, sin))
    expected, _ = apply_rotary_pos_emb(
        x.transpose(0, 1)[None], x.transpose(0, 1)[None], hf_cos, hf_sin
    )
    out = cpu_ops.rotary_embedding_(x, positions, cos, sin)
    assert out.data_ptr() == x.data_ptr()
    assert_same_rounding(x, expected[0].transpose(0, 1), dtype)
    assert torch.equal(fused[:, num_heads * head_dim :], rest), "wrote outside the view"


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize(("rows", "n"), [(1, 128), (48, 2304), (257, 100), (3, 7)])
def test_silu_and_mul_matches_transformers(dtype: torch.dtype, rows: int, n: int) -> None:
    from transformers.activations import ACT2FN

    x = (torch.randn(rows, 2 * n) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    assert_same_rounding(cpu_ops.silu_and_mul(x), ACT2FN["silu"](gate) * up, dtype)


@pytest.mark.parametrize(
    ("block_size", "num_kv_heads", "head_dim", "dtype"),
    [(8, 2, 64, F32), (16, 1, 80, F16), (16, 8, 96, BF16), (512, 2, 128, F32)],
)
def test_store_kv_op_writes_exactly_the_mapped_slots(
    block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    num_blocks, num_tokens, width = 5, 37, num_kv_heads * head_dim
    # key and value as the model has them: views into one fused qkv projection
    qkv = torch.randn(num_tokens, 3 * width).to(dtype)
    key = qkv[:, width : 2 * width].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, 2 * width :].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[torch.randint(0, num_tokens, (5,))] = -1  # padding tokens: not stored
    # NaN everywhere first: a slot written by one and not the other stays NaN on one side
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    kv_cache = kv_cache.to(dtype)
    expected = kv_cache.clone()
    torch.ops.asyncengine.store_kv(kv_cache, key, value, slots)
    kept = slots >= 0
    blocks, offsets = slots[kept] // block_size, slots[kept] % block_size
    expected[0, blocks, offsets], expected[1, blocks, offsets] = key[kept], value[kept]
    torch.testing.assert_close(kv_cache, expected, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(RuntimeError, match="is past the cache's"):
        torch.ops.asyncengine.store_kv(kv_cache, key, value, slots + num_blocks * block_size)
    with pytest.raises(RuntimeError, match="heads contiguous"):
        torch.ops.asyncengine.store_kv(kv_cache, key.transpose(1, 2), value, slots)


def needs_bf16_linear() -> None:
    if not cpu_ops.bf16_linear_available():
        # built with -march=native: without AVX512-BF16 the op is compiled out and bfloat16
        # linears stay with oneDNN (tests/test_cpu_linear.py covers that path)
        pytest.skip("this CPU has no AVX512-BF16: the bf16_linear op is not built here")


def over_rows_bias_and_threads(test: Callable[..., None]) -> Callable[..., None]:
    """A bf16_linear test at row counts of one pass (up to 12), of two even passes (13, 16)
    and of more, with and without a bias, on one thread and two."""
    for name, values in (
        ("rows", [1, 7, 12, 13, 16, 40, 131]),
        ("has_bias", [False, True]),
        ("num_threads", [1, 2]),
    ):
        test = pytest.mark.parametrize(name, values)(test)
    return test


@over_rows_bias_and_threads
@pytest.mark.parametrize(("k", "n"), [(64, 32), (96, 160), (2, 64)])
def test_bf16_linear_matches_a_float32_product_rounded_once(
    rows: int, k: int, n: int, has_bias: bool, num_threads: int
) -> None:
    needs_bf16_linear()
    x = torch.randn(rows, k, dtype=BF16)
    weight = torch.randn(n, k, dtype=BF16)
    bias = torch.randn(n, dtype=BF16) if has_bias else None
    with torch_threads(num_threads):
        got = cpu_ops.bf16_linear(x, cpu_ops.pack_bf16_weight(weight), bias)
    expected = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
    assert got.dtype == BF16 and got.shape == (rows, n)
    # one rounding to bf16 of a sum taken in float32: within one bf16 step (2^-7 relative to
    # the value's power of two, so 2^-7 of its size at most) of the exact product
    error = (got.double() - expected).abs()
    assert (error <= expected.abs() * 2**-7 + 1e-4).all(), error.max()


@over_rows_bias_and_threads
@pytest.mark.parametrize(("k", "n"), [(64, 64), (96, 320)])
def test_bf16_linear_silu_mul_is_the_product_then_transformers_silu_times_up(
    rows: int, k: int, n: int, has_bias: bool, num_threads: int
) -> None:
    from transformers.activations import ACT2FN

    needs_bf16_linear()
    x = torch.randn(rows, k, dtype=BF16)
    weight = torch.randn(n, k, dtype=BF16)  # a gate's n / 2 rows over an up projection's
    bias = torch.randn(n, dtype=BF16) if has_bias else None
    paired_bias = None if bias is None else cpu_ops.pair_gate_up(bias)
    with torch_threads(num_threads):
        # the product (tested above against float64) as the MLP takes it apart
        gate, up = cpu_ops.bf16_linear(x, cpu_ops.pack_bf16_weight(weight), bias).chunk(2, -1)
        paired = cpu_ops.pack_bf16_weight(cpu_ops.pair_gate_up(weight))
        got = cpu_ops.bf16_linear_silu_mul(x, paired, paired_bias)
        # the same paired weight's plain product, its columns put back in order
        unpaired = cpu_ops.unpair_gate_up(cpu_ops.bf16_linear(x, paired, paired_bias))
    assert got.shape == (rows, n // 2)
    assert_same_rounding(got, ACT2FN["silu"](gate) * up, BF16)
    assert torch.equal(unpaired, torch.cat([gate, up], -1))


def test_bf16_linear_checks_its_inputs() -> None:
    needs_bf16_linear()
    weight = cpu_ops.pack_bf16_weight(torch.randn(64, 32, dtype=BF16))
    with pytest.raises(RuntimeError, match="x has 30 columns, the weight 32"):
        cpu_ops.bf16_linear(torch.randn(3, 30, dtype=BF16), weight)
    with pytest.raises(RuntimeError, match="x: a contiguous 2-D bfloat16"):
        cpu_ops.bf16_linear(torch.randn(3, 32), weight)
    with pytest.raises(RuntimeError, match="bias: a contiguous bfloat16"):
        cpu_ops.bf16_linear(torch.randn(3, 32, dtype=BF16), weight, torch.randn(63, dtype=BF16))
    with pytest.raises(ValueError, match="needs a bfloat16"):
        cpu_ops.pack_bf16_weight(torch.randn(48, 32, dtype=BF16))
    with pytest.raises(RuntimeError, match=r"out: a contiguous bfloat16 \[rows, N / 2\]"):
        torch.ops.asyncengine.bf16_linear_silu_mul(
            torch.empty(3, 64, dtype=BF16), torch.randn(3, 32, dtype=BF16), weight, None
        )
