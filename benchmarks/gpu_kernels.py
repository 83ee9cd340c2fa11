"""Paged decode attention on CUDA: the Triton kernel vs SDPA on a contiguous cache.

For a Llama-3-8B-shaped layer (32 query heads, 8 KV heads, head_dim 128, bf16, block 16) and
every decode batch x context in the grid, reports the median kernel time (CUDA events, warm-up,
L2 flushed before each timed launch, several input sets), the bytes it must move, the achieved
bandwidth and its fraction of a measured device-to-device copy, next to torch's
scaled_dot_product_attention over the same K/V laid out contiguously. Before timing, every kernel
is checked against its torch reference on small inputs.

    python benchmarks/gpu_kernels.py [--batches 1,16,64,256] [--contexts 512,4096,32768] [--json]
    python benchmarks/gpu_kernels.py --interpret-smoke   # no GPU: a tiny case, Triton's interpreter

Without CUDA (and without --interpret-smoke) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import statistics
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
SPEC_GBPS = {"H200": 4800.0, "H100": 3352.0, "A100": 1935.0}  # vendor HBM bandwidth


def import_kernels() -> ModuleType:
    """asyncengine.kernels, installed or else from this checkout."""
    try:
        return importlib.import_module("asyncengine.kernels")
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        return importlib.import_module("asyncengine.kernels")


# -- timing ----------------------------------------------------------------------------------


class Timer:
    """Median of CUDA-event times, each launch after an L2 flush (the FlashInfer "cold" way)."""

    def __init__(self, warmup: int, iters: int) -> None:
        self.warmup, self.iters = warmup, iters
        # larger than any L2 (50 MB on H100/H200); zeroing it also hides the CPU launch cost
        self.flush_buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def median_ms(self, fns: list[Any]) -> float:
        for i in range(self.warmup):
            fns[i % len(fns)]()
        torch.cuda.synchronize()
        events = []
        for i in range(self.iters):
            self.flush_buf.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[i % len(fns)]()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events)


def copy_bandwidth_gbps(timer: Timer, num_bytes: int = 2 << 30) -> float:
    """Device-to-device copy: read + write bytes per second, the practical ceiling."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = timer.median_ms([lambda: dst.copy_(src)])
    return 2 * num_bytes / (ms * 1e-3) / 1e9


# -- sanity checks on the device -------------------------------------------------------------


def sanity_checks(kernels: ModuleType) -> list[dict[str, Any]]:
    """Each kernel against its torch reference on small random paged inputs."""
    results = []
    gen = torch.Generator(device="cpu").manual_seed(0)

    def check(name: str, fn: Any) -> None:
        try:
            err, tol = fn()
            results.append({"check": name, "max_abs_err": err, "tol": tol, "ok": err <= tol})
        except Exception as exc:  # report and go on: the timing below may still work
            results.append({"check": name, "error": f"{type(exc).__name__}: {exc}", "ok": False})

    def paged(seq_lens: list[int], block_size: int, dtype: torch.dtype) -> tuple[Any, ...]:
        num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
        perm = torch.randperm(num_blocks, generator=gen)
        width = max(-(-n // block_size) for n in seq_lens)
        tables, used = [], 0
        for n in seq_lens:
            k = -(-n // block_size)
            row = perm[used : used + k].tolist()
            tables.append(row + [0] * (width - k))
            used += k
        cache = torch.randn(2, num_blocks, block_size, 2, 128, generator=gen).to(dtype)
        bt = torch.tensor(tables, dtype=torch.int32)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        return cache.cuda(), bt.cuda(), lens.cuda()

    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        tag = str(dtype).removeprefix("torch.")

        def decode(dtype: torch.dtype = dtype, tol: float = tol) -> tuple[float, float]:
            cache, bt, lens = paged([1, 37, 300, 1000], 16, dtype)
            q = torch.randn(4, 8, 128, generator=gen).to(dtype).cuda()
            worst = 0.0
            for splits in (1, 3):
                out = kernels.paged_decode_attention(q, cache, bt, lens, 0.088, num_splits=splits)
                ref = kernels.paged_decode_attention_ref(q, cache, bt, lens, 0.088)
                worst = max(worst, (out.float() - ref.float()).abs().max().item())
            return worst, tol

        def prefill(dtype: torch.dtype = dtype, tol: float = tol) -> tuple[float, float]:
            new, ctx = [17, 1, 64, 5], [0, 40, 100, 513]
            cache, bt, lens = paged([a + b for a, b in zip(new, ctx)], 16, dtype)
            qsl = torch.tensor([0, *torch.tensor(new).cumsum(0)], dtype=torch.int32).cuda()
            q = torch.randn(sum(new), 8, 128, generator=gen).to(dtype).cuda()
            out = kernels.paged_prefill_attention(q, cache, bt, lens, qsl, 0.088)
            ref = kernels.paged_prefill_attention_ref(q, cache, bt, lens, qsl, 0.088)
            return (out.float() - ref.float()).abs().max().item(), tol

        check(f"decode {tag}", decode)
        check(f"prefill {tag}", prefill)

    def store() -> tuple[float, float]:
        cache = torch.full((2, 6, 16, 8, 128), float("nan"), dtype=DTYPE, device="cuda")
        expected = cache.clone()
        key, value = torch.randn(2, 50, 8, 128, generator=gen).to(DTYPE).cuda()
        slots = torch.randperm(96, generator=gen)[:50].cuda()
        slots[::7] = -1
        kernels.store_kv(key, value, cache, slots)
        kernels.store_kv_ref(key, value, expected, slots)
        same = torch.equal(cache.nan_to_num(7.0), expected.nan_to_num(7.0))
        return (0.0 if same else math.inf), 0.0

    def copy_and_swap() -> tuple[float, float]:
        gpu = [torch.randn(2, 8, 16, 8, 128, device="cuda").to(DTYPE) for _ in range(3)]
        cpu = [torch.zeros(2, 5, 16, 8, 128, dtype=DTYPE).pin_memory() for _ in range(3)]
        expected_gpu = [t.clone() for t in gpu]
        kernels.copy_blocks(gpu, gpu, torch.tensor([[0, 5], [3, 6]], device="cuda"))
        kernels.copy_blocks_ref(expected_gpu, expected_gpu, torch.tensor([[0, 5], [3, 6]]))
        kernels.swap_out_blocks(gpu, cpu, [(1, 0), (7, 4)])
        kernels.swap_in_blocks(cpu, gpu, [(4, 2)])
        kernels.swap_blocks_ref(expected_gpu, expected_gpu, [(7, 2)])
        ok = all(torch.equal(a, b) for a, b in zip(gpu, expected_gpu))
        ok = ok and all(torch.equal(c[:, 0], g[:, 1].cpu()) for c, g in zip(cpu, gpu))
        return (0.0 if ok else math.inf), 0.0

    check("store_kv bf16", store)
    check("copy_blocks + swap bf16", copy_and_swap)
    return results


# -- the decode grid -------------------------------------------------------------------------


def decode_bytes(batch: int, context: int, with_table: bool) -> int:
    kv = batch * context * 2 * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
    q_and_out = 2 * batch * NUM_HEADS * HEAD_DIM * DTYPE.itemsize
    table = batch * (context // BLOCK_SIZE) * 4 + batch * 4 if with_table else 0
    return kv + q_and_out + table


def bench_case(
    kernels: ModuleType, timer: Timer, batch: int, context: int, num_sets: int
) -> dict[str, Any]:
    row: dict[str, Any] = {"batch": batch, "context": context}
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq
    scale = HEAD_DIM**-0.5
    kv_cache: torch.Tensor | None = None
    table: torch.Tensor | None = None  # input set 0's, for SDPA over the same K/V
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    triton_out: torch.Tensor | None = None
    try:
        kv_cache = torch.empty(
            2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda"
        ).normal_()
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        sets = []  # each: its own query and its own random (non-contiguous) block tables
        for i in range(num_sets):
            perm = torch.randperm(num_blocks, device="cuda").to(torch.int32)
            q = query if i == 0 else torch.randn_like(query)
            sets.append((q, perm.view(batch, blocks_per_seq), torch.empty_like(query)))
        table = sets[0][1]
        row["num_splits"] = kernels.choose_num_splits(
            batch,
            NUM_KV_HEADS,
            context,
            torch.cuda.get_device_properties(0).multi_processor_count,
            kernels.decode_attention.default_block_n(HEAD_DIM, DTYPE),
        )
        fns = [
            lambda q=q, bt=bt, o=o: kernels.paged_decode_attention(
                q, kv_cache, bt, seq_lens, scale, max_seq_len=context, out=o
            )
            for q, bt, o in sets
        ]
        ms = timer.median_ms(fns)
        row["triton_ms"] = ms
        row["triton_gbps"] = decode_bytes(batch, context, True) / (ms * 1e-3) / 1e9
        triton_out = fns[0]().clone()
        del sets, fns
    except Exception as exc:
        row["triton_error"] = _short(exc)
    try:  # SDPA over the same K/V laid out [batch, kv_heads, context, dim]
        if kv_cache is not None and table is not None:
            k, v = (
                kv_cache[i][table.flatten().long()]
                .view(batch, context, NUM_KV_HEADS, HEAD_DIM)
                .transpose(1, 2)
                .contiguous()
                for i in (0, 1)
            )
        else:  # the paged setup failed: SDPA on its own random K/V
            shape = (batch, NUM_KV_HEADS, context, HEAD_DIM)
            k = torch.randn(shape, dtype=DTYPE, device="cuda")
            v = torch.randn(shape, dtype=DTYPE, device="cuda")
        kv_cache = None  # free it before timing SDPA
        # GQA folded: the 4 query heads of a KV head are its 4 query rows (K/V not repeated)
        q = query.view(batch, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, HEAD_DIM)

        def sdpa() -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)

        ms = timer.median_ms([sdpa])
        row["sdpa_ms"] = ms
        row["sdpa_gbps"] = decode_bytes(batch, context, False) / (ms * 1e-3) / 1e9
        if triton_out is not None:
            ref = sdpa().reshape(batch, NUM_HEADS, HEAD_DIM)
            row["max_abs_err_vs_sdpa"] = (triton_out.float() - ref.float()).abs().max().item()
    except Exception as exc:
        row["sdpa_error"] = _short(exc)
    return row  # the caller frees this case's memory before the next


def _short(exc: BaseException) -> str:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return "out of memory"
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:120]


# -- output ----------------------------------------------------------------------------------


def print_table(report: dict[str, Any]) -> None:
    copy = report["copy_gbps"]
    spec = report.get("spec_gbps")
    print(f"device: {report['device']}   d2d copy: {copy:.0f} GB/s (read+write)", end="")
    print(f"   spec: {spec:.0f} GB/s" if spec else "")
    print(
        f"layer: {NUM_HEADS} q heads / {NUM_KV_HEADS} kv heads, head_dim {HEAD_DIM}, "
        f"bf16, block {BLOCK_SIZE}; median of {report['iters']} cold launches, "
        f"{report['num_sets']} input sets"
    )
    for check in report["checks"]:
        status = "ok  " if check["ok"] else "FAIL"
        detail = check.get("error") or f"max |err| {check['max_abs_err']:.2e} (tol {check['tol']})"
        print(f"  check {status} {check['check']}: {detail}")
    header = (
        f"{'batch':>5} {'context':>7} {'splits':>6} {'MB':>9} | {'triton ms':>9} {'GB/s':>6} "
        f"{'/copy':>6} | {'sdpa ms':>9} {'GB/s':>6} {'/copy':>6} | {'tri/sdpa':>8} {'err':>8}"
    )
    print(header)
    print("-" * len(header))
    for row in report["rows"]:
        mb = decode_bytes(row["batch"], row["context"], True) / 1e6

        def cols(row: dict[str, Any], name: str) -> str:
            if f"{name}_ms" not in row:
                reason = row.get(f"{name}_error", "not run")
                return f"{'n/a':>9} {'':>6} {'':>6}" + (f"  ({reason})" if reason else "")
            gbps = row[f"{name}_gbps"]
            return f"{row[f'{name}_ms']:9.4f} {gbps:6.0f} {gbps / copy:6.1%}"

        speed = (
            f"{row['sdpa_ms'] / row['triton_ms']:8.2f}x"
            if "sdpa_ms" in row and "triton_ms" in row
            else f"{'':>9}"
        )
        err = f"{row['max_abs_err_vs_sdpa']:8.1e}" if "max_abs_err_vs_sdpa" in row else ""
        triton_cols, sdpa_cols = cols(row, "triton"), cols(row, "sdpa")
        line = f"{row['batch']:>5} {row['context']:>7} {row.get('num_splits', '-'):>6} "
        print(f"{line}{mb:9.1f} | {triton_cols} | {sdpa_cols} | {speed} {err}")
    print("tri/sdpa > 1: the paged Triton kernel is faster than SDPA on a contiguous cache")


def interpret_smoke() -> int:
    """A tiny decode and prefill in Triton's interpreter on the CPU: proves the script's path."""
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    kernels = import_kernels()
    torch.manual_seed(0)
    cache = torch.randn(2, 6, 16, 2, 64)
    table = torch.tensor([[3, 0, 5], [1, 4, 2]], dtype=torch.int32)
    lens = torch.tensor([40, 7], dtype=torch.int32)
    query = torch.randn(2, 8, 64)
    out = kernels.paged_decode_attention(query, cache, table, lens, 0.125, num_splits=2)
    ref = kernels.paged_decode_attention_ref(query, cache, table, lens, 0.125)
    err = (out - ref).abs().max().item()
    print(f"interpret smoke: decode 2 seqs x 8 heads, 2 splits: max |err| {err:.1e}")
    return 0 if err < 1e-4 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--contexts", default="512,4096,32768")
    parser.add_argument("--iters", type=int, default=30, help="timed launches per case")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--num-sets", type=int, default=3, help="input sets cycled through")
    parser.add_argument("--no-check", action="store_true", help="skip the sanity checks")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--json-out", help="also write the JSON report to this file")
    parser.add_argument("--interpret-smoke", action="store_true", help=interpret_smoke.__doc__)
    args = parser.parse_args()
    if args.interpret_smoke:
        return interpret_smoke()
    if not torch.cuda.is_available():
        print("gpu_kernels.py: no CUDA device; nothing to measure (try --interpret-smoke)")
        return 0
    kernels = import_kernels()
    name = torch.cuda.get_device_name(0)
    timer = Timer(args.warmup, args.iters)
    report: dict[str, Any] = {
        "device": name,
        "triton": __import__("triton").__version__,
        "torch": torch.__version__,
        "iters": args.iters,
        "num_sets": args.num_sets,
        "spec_gbps": next((v for k, v in SPEC_GBPS.items() if k in name), None),
        "copy_gbps": copy_bandwidth_gbps(timer),
        "checks": [] if args.no_check else sanity_checks(kernels),
        "rows": [],
    }
    for batch in (int(b) for b in args.batches.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            try:
                row = bench_case(kernels, timer, batch, context, args.num_sets)
            except Exception as exc:  # never let one case end the run
                traceback.print_exc(file=sys.stderr)
                row = {"batch": batch, "context": context, "triton_error": _short(exc)}
            gc.collect()
            torch.cuda.empty_cache()
            report["rows"].append(row)
            if not args.json:
                print(f"  done batch {batch} context {context}", file=sys.stderr)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
