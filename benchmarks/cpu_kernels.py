"""The CPU path's kernels, measured: GEMMs at the engine's batch shapes, and the candidates for
paged decode and prefill attention that asyncengine/worker chose between.

gemm: every linear layer of a model (default the 60M Llama of issue 15: hidden 768, 8 layers,
      12 heads, 3 KV heads, MLP 2304, vocab 2048) at batch sizes M, float32 and bfloat16,
      through `F.linear` (what transformers runs), through the oneDNN-prepacked weights of
      asyncengine/worker/cpu_linear.py, and in bfloat16 through the C++ bf16_linear op (CPUs
      with AVX512-BF16). "model" is the sum of one layer of each kind times the layer count,
      plus the LM head, each layer's weights hot in the caches from its last call; "from
      memory" runs a forward's linears in order over weights of their own for every layer, as
      a model much larger than the caches reads them on every step (GF/s of wall time).
attention: one decode step of `--num-seqs` sequences (lengths uniform in [9, 288], shuffled
      blocks) through each candidate: the padded gather + masked SDPA (the plain-torch path),
      SDPA per sequence (no padding, no mask), FlexAttention compiled for the CPU with a paged
      block mask (`--flex`: ~20 s to compile), and the C++ op of asyncengine/worker/cpu_ops.py.
prefill: `--prefill-seqs` fresh prompts of each of `--prompt-lens` tokens, causal, through
      torch's SDPA (its CPU flash kernel) a sequence at a time after gathering its K/V from the
      blocks (the plain-torch path) and through the C++ prefill op, which reads the blocks in
      place; GF/s counts the causal half of QK^T and PV.

Times are the best of `--repeats` runs of CPU time (one thread: the work itself, barely moved
by other jobs on a shared box) and of wall time.

    python benchmarks/cpu_kernels.py                    # every table, one thread
    python benchmarks/cpu_kernels.py --only prefill --threads 2
    python benchmarks/cpu_kernels.py --threads 2 --flex --json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from asyncengine.worker import cpu_ops
from asyncengine.worker.attention import _decode_attention, _prefill_attention, gather_kv
from asyncengine.worker.cpu_linear import _BATCH_HINT
from asyncengine.worker.forward_context import AttentionMetadata

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FLEX_FAILURES: list[dict[str, Any]] = []  # (dtype, block size) where FlexAttention did not compile


def best_times(fn: Callable[[], object], repeats: int, inner: int) -> tuple[float, float]:
    """(best CPU seconds, best wall seconds) per call over `repeats` runs of `inner` calls."""
    fn()
    cpu, wall = float("inf"), float("inf")
    for _ in range(repeats):
        c, w = time.process_time(), time.perf_counter()
        for _ in range(inner):
            fn()
        cpu = min(cpu, (time.process_time() - c) / inner)
        wall = min(wall, (time.perf_counter() - w) / inner)
    return cpu, wall


def linear_shapes(args: argparse.Namespace) -> dict[str, tuple[int, int, int]]:
    """name -> (in_features, out_features, layers of it)."""
    h, kv = args.hidden, args.num_kv_heads * args.head_dim
    q = args.num_heads * args.head_dim
    return {
        "qkv": (h, q + 2 * kv, args.num_layers),
        "o": (q, h, args.num_layers),
        "gate_up": (h, 2 * args.intermediate, args.num_layers),
        "down": (args.intermediate, h, args.num_layers),
        "lm_head": (h, args.vocab, 1),
    }


def bench_gemm(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        weights = {
            name: torch.randn(n, k, dtype=dtype) * 0.02
            for name, (k, n, _) in linear_shapes(args).items()
        }
        products = linear_products(weights, dtype)
        forwards = {  # every layer with weights of its own: a forward's linears, in order
            kind: [
                (name, product(weights[name].clone()))
                for name, (_, _, count) in linear_shapes(args).items()
                for _ in range(count)
            ]
            for kind, product in products.items()
        }
        for m in args.batch_sizes:
            total = dict.fromkeys(products, 0.0)
            flops = 0
            for name, (k, n, count) in linear_shapes(args).items():
                x = torch.randn(m, k, dtype=dtype)
                w = weights[name]
                inner = max(1, int(2e8 // (2 * m * k * n)))
                row: dict[str, Any] = {"dtype": dtype_name, "m": m, "layer": name}
                for kind, product in products.items():
                    run = product(w)
                    seconds, _ = best_times(lambda: run(x), args.repeats, inner)  # noqa: B023
                    total[kind] += seconds * count
                    row[f"{kind}_gflops"] = 2 * m * k * n / seconds / 1e9
                flops += 2 * m * k * n * count
                rows.append(row)
            row = {"dtype": dtype_name, "m": m, "layer": "model"}
            for kind, seconds in total.items():
                row[f"{kind}_gflops"] = flops / seconds / 1e9
            rows.append(row)
            inputs = {
                name: torch.randn(m, k, dtype=dtype)
                for name, (k, _, _) in linear_shapes(args).items()
            }
            row = {"dtype": dtype_name, "m": m, "layer": "from memory"}
            for kind, layers in forwards.items():
                inner = max(1, int(2e9 // (flops + 1)))
                _, seconds = best_times(  # wall time: the memory stream is the point here
                    lambda: [run(inputs[name]) for name, run in layers],  # noqa: B023
                    args.repeats,
                    inner,
                )
                row[f"{kind}_gflops"] = flops / seconds / 1e9
            rows.append(row)
            print(f"  gemm {dtype_name} M={m} done", file=sys.stderr, flush=True)
    return rows


Product = Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]


def linear_products(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Product]:
    """kind -> (weight -> x -> x @ weight.T): `F.linear`, and each packed product that fits
    every weight."""

    def plain(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: F.linear(x, w)

    def onednn(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, _BATCH_HINT)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    def bf16_op(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        packed = cpu_ops.pack_bf16_weight(w)
        return lambda x: cpu_ops.bf16_linear(x, packed)

    products: dict[str, Product] = {"plain": plain, "packed": onednn}
    fits = all(w.shape[0] % cpu_ops.BF16_LINEAR_COLUMNS == 0 for w in weights.values())
    if dtype == torch.bfloat16 and fits and cpu_ops.bf16_linear_available():
        products["bf16_op"] = bf16_op
    return products


def make_decode_batch(
    num_seqs: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    lens: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[int], list[list[int]]]:
    """(kv_cache, block_tables, seq_lens, tables): blocks in shuffled order, as after churn;
    sequence lengths uniform in [9, 288] unless given."""
    rng = random.Random(0)
    lens = lens or [rng.randint(9, 288) for _ in range(num_seqs)]
    needed = [-(-n // block_size) for n in lens]
    num_blocks = sum(needed) + 1
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in needed]
    width = max(needed)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    return cache, padded, lens, tables


def attention_candidates(
    args: argparse.Namespace, block_size: int, dtype: torch.dtype
) -> dict[str, Callable[[], torch.Tensor]]:
    num_heads, num_kv_heads, dim = args.num_heads, args.num_kv_heads, args.head_dim
    cache, tables, lens, table_lists = make_decode_batch(
        args.num_seqs, block_size, num_kv_heads, dim, dtype
    )
    num_seqs = len(lens)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    query = torch.randn(num_seqs, num_heads, dim).to(dtype)
    scale = dim**-0.5
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(num_seqs, dtype=torch.long),
        block_tables=tables,
        seq_lens=seq_lens,
        query_start_loc=list(range(num_seqs + 1)),
        context_lens=[n - 1 for n in lens],
        seq_lens_list=lens,
        num_decodes=num_seqs,
        max_seq_len=max(lens),
    )
    group = num_heads // num_kv_heads

    def padded_masked_sdpa() -> torch.Tensor:
        meta.scratch.clear()  # the mask is built once per forward, so once per call here
        return _decode_attention(query, cache, meta, scale, None, meta.scratch)

    def sdpa_per_sequence() -> torch.Tensor:
        out = torch.empty_like(query)
        for i, n in enumerate(lens):
            key, value = gather_kv(cache, tables[i], n)
            out[i] = F.scaled_dot_product_attention(
                query[i].view(num_kv_heads, group, dim),
                key.transpose(0, 1),
                value.transpose(0, 1),
                scale=scale,
            ).reshape(num_heads, dim)
        return out

    def cpp_op() -> torch.Tensor:
        return cpu_ops.paged_decode_attention(query, cache, tables, seq_lens, scale)

    candidates = {
        "padded + masked SDPA": padded_masked_sdpa,
        "SDPA per sequence": sdpa_per_sequence,
    }
    if args.flex:
        try:
            candidates["FlexAttention (compiled)"] = flex_candidate(
                query, cache, table_lists, lens, scale
            )
        except Exception as exc:  # inductor's CPU template fails on some shapes and dtypes
            message = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            print(f"  flex ({dtype}, block {block_size}) failed: {message}", file=sys.stderr)
            FLEX_FAILURES.append({"dtype": str(dtype), "block_size": block_size, "error": message})
    if cpu_ops.load():
        candidates["C++ op (chosen)"] = cpp_op
    return candidates


def flex_candidate(
    query: torch.Tensor, cache: torch.Tensor, tables: list[list[int]], lens: list[int], scale: float
) -> Callable[[], torch.Tensor]:
    """The whole cache as one KV sequence and the decode queries as one query sequence; the
    block mask lets query i see the slots its table holds (one query per mask row, so blocks of
    other sequences are skipped, not masked). Building the mask per step is not timed."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    num_blocks, block_size = cache.shape[1], cache.shape[2]
    owner = torch.full((num_blocks * block_size,), -1, dtype=torch.int32)
    for seq, (table, n) in enumerate(zip(tables, lens)):
        for slot in range(n):
            owner[table[slot // block_size] * block_size + slot % block_size] = seq
    start = time.perf_counter()
    block_mask = create_block_mask(
        lambda b, h, q_idx, kv_idx: owner[kv_idx] == q_idx,
        1, 1, len(lens), num_blocks * block_size, device="cpu", BLOCK_SIZE=(1, block_size),
    )  # fmt: skip
    compiled = torch.compile(flex_attention)
    keys, values = (cache[i].flatten(0, 1).transpose(0, 1)[None] for i in (0, 1))
    queries = query.transpose(0, 1)[None]

    def run() -> torch.Tensor:
        out = compiled(queries, keys, values, block_mask=block_mask, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)

    run()
    print(f"  flex: mask + compile {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return run


def bench_attention(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for dtype_name in args.dtypes:
        for block_size in args.block_sizes:
            candidates = attention_candidates(args, block_size, DTYPES[dtype_name])
            reference = None
            timings = {}
            for name, fn in candidates.items():
                out = fn().float()
                reference = out if reference is None else reference
                error = float((out - reference).abs().max())
                timings[name] = (*best_times(fn, args.repeats, 5), error)
            base_cpu = timings["padded + masked SDPA"][0]
            for name, (cpu, wall, error) in timings.items():
                rows.append(
                    {
                        "dtype": dtype_name, "block_size": block_size, "candidate": name,
                        "cpu_ms": cpu * 1e3, "wall_ms": wall * 1e3,
                        "speedup_vs_padded": base_cpu / cpu, "max_abs_diff_vs_padded": error,
                    }
                )  # fmt: skip
            print(f"  attention {dtype_name} bs={block_size} done", file=sys.stderr, flush=True)
    return rows


def prefill_candidates(
    args: argparse.Namespace, length: int, dtype: torch.dtype
) -> dict[str, Callable[[], torch.Tensor]]:
    """`--prefill-seqs` fresh prompts of `length` tokens, their K/V already in shuffled blocks."""
    n, num_heads, dim, block_size = args.prefill_seqs, args.num_heads, args.head_dim, 16
    cache, tables, _, _ = make_decode_batch(
        n, block_size, args.num_kv_heads, dim, dtype, lens=[length] * n
    )
    query = torch.randn(n * length, num_heads, dim).to(dtype)
    starts = torch.arange(0, n * length + 1, length, dtype=torch.int32)
    seq_lens = torch.full((n,), length, dtype=torch.int32)
    scale = dim**-0.5

    def sdpa_per_sequence() -> torch.Tensor:
        out = torch.empty_like(query)
        for i in range(n):
            key, value = gather_kv(cache, tables[i], length)
            rows = slice(i * length, (i + 1) * length)
            out[rows] = _prefill_attention(query[rows], key, value, 0, scale, None)
        return out

    def cpp_op() -> torch.Tensor:
        return cpu_ops.paged_prefill_attention(query, cache, tables, starts, seq_lens, scale)

    candidates = {"gather + SDPA per sequence": sdpa_per_sequence}
    if cpu_ops.load():
        candidates["C++ op (chosen)"] = cpp_op
    return candidates


def bench_prefill(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for dtype_name in args.dtypes:
        for length in args.prompt_lens:
            candidates = prefill_candidates(args, length, DTYPES[dtype_name])
            n = args.prefill_seqs
            flops = n * 2 * 2 * args.num_heads * args.head_dim * length * (length + 1) / 2
            reference = candidates["gather + SDPA per sequence"]().float()
            base_cpu = None
            for name, fn in candidates.items():
                error = float((fn().float() - reference).abs().max())
                cpu, wall = best_times(fn, args.repeats, 2)
                base_cpu = base_cpu or cpu
                rows.append(
                    {
                        "dtype": dtype_name, "prompt_len": length, "num_seqs": n, "candidate": name,
                        "cpu_ms": cpu * 1e3, "wall_ms": wall * 1e3, "gflops": flops / wall / 1e9,
                        "speedup_vs_sdpa": base_cpu / cpu, "max_abs_diff_vs_sdpa": error,
                    }
                )  # fmt: skip
            print(f"  prefill {dtype_name} {length} tokens done", file=sys.stderr, flush=True)
    return rows


def format_tables(
    gemm: list[dict[str, Any]], attention: list[dict[str, Any]], prefill: list[dict[str, Any]]
) -> str:
    lines = []
    if gemm:
        lines += [
            f"{'dtype':<9} {'M':>5} {'layer':<11} {'F.linear GF/s':>13} {'packed GF/s':>11} "
            f"{'packed/plain':>12} {'bf16 op GF/s':>12} {'op/packed':>9}",
        ]
        for r in gemm:
            op = r.get("bf16_op_gflops")
            lines.append(
                f"{r['dtype']:<9} {r['m']:>5} {r['layer']:<11} {r['plain_gflops']:>13.0f} "
                f"{r['packed_gflops']:>11.0f} {r['packed_gflops'] / r['plain_gflops']:>12.2f} "
                + (f"{op:>12.0f} {op / r['packed_gflops']:>9.2f}" if op else f"{'-':>12} {'-':>9}")
            )
        lines.append("")
    if attention:
        lines.append(
            f"{'dtype':<9} {'block':>5} {'candidate':<26} {'cpu ms':>8} {'wall ms':>8} "
            f"{'x padded':>8} {'max diff':>9}"
        )
        for r in attention:
            lines.append(
                f"{r['dtype']:<9} {r['block_size']:>5} {r['candidate']:<26} {r['cpu_ms']:>8.3f} "
                f"{r['wall_ms']:>8.3f} {r['speedup_vs_padded']:>8.2f} "
                f"{r['max_abs_diff_vs_padded']:>9.1e}"
            )
        lines.append("")
    if prefill:
        lines.append(
            f"{'dtype':<9} {'tokens':>6} {'seqs':>4} {'candidate':<26} {'cpu ms':>8} "
            f"{'wall ms':>8} {'GF/s':>6} {'x SDPA':>6} {'max diff':>9}"
        )
        for r in prefill:
            lines.append(
                f"{r['dtype']:<9} {r['prompt_len']:>6} {r['num_seqs']:>4} {r['candidate']:<26} "
                f"{r['cpu_ms']:>8.2f} {r['wall_ms']:>8.2f} {r['gflops']:>6.0f} "
                f"{r['speedup_vs_sdpa']:>6.2f} {r['max_abs_diff_vs_sdpa']:>9.1e}"
            )
    return "\n".join(lines).rstrip()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", choices=("gemm", "attention", "prefill"), help="one table")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--batch-sizes", default="1,16,48,128,512,2048", help="GEMM rows (M)")
    p.add_argument("--block-sizes", default="16,128,1024")
    p.add_argument("--num-seqs", type=int, default=48)
    p.add_argument("--prompt-lens", default="64,256,1024", help="prefill: tokens per prompt")
    p.add_argument("--prefill-seqs", type=int, default=4, help="prefill: prompts per call")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--intermediate", type=int, default=2304)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--num-heads", type=int, default=12)
    p.add_argument("--num-kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--flex", action="store_true", help="also FlexAttention (compiles, ~20 s)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the tables")
    p.add_argument("--json-out", help="also write the JSON report to this file")
    args = p.parse_args(argv)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    args.batch_sizes = [int(m) for m in args.batch_sizes.split(",")]
    args.block_sizes = [int(b) for b in args.block_sizes.split(",")]
    args.prompt_lens = [int(n) for n in args.prompt_lens.split(",")]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        gemm = bench_gemm(args) if args.only in (None, "gemm") else []
        attention = bench_attention(args) if args.only in (None, "attention") else []
        prefill = bench_prefill(args) if args.only in (None, "prefill") else []
    config = {k: v for k, v in vars(args).items() if k not in ("json", "json_out")}
    config.update(torch=torch.__version__)
    report = {
        "config": config,
        "gemm": gemm,
        "attention": attention,
        "prefill": prefill,
        "flex_failures": FLEX_FAILURES,
    }
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(json.dumps(report, indent=2) + "\n")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"threads={args.threads} torch={torch.__version__}")
        print(format_tables(gemm, attention, prefill))
        for failure in FLEX_FAILURES:
            print(f"FlexAttention did not compile for {failure}")


if __name__ == "__main__":
    main()
