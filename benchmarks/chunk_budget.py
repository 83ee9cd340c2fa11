"""The step's token budget (`--max-num-batched-tokens`) served and offline: what it does to
tokens/s, time to first token and inter-token latency.

    python benchmarks/chunk_budget.py                              # the 60M llama, 2048 vs 512
    python benchmarks/chunk_budget.py --budgets 2048,1024,512,256 --rounds 2 --json
    python benchmarks/chunk_budget.py --model DIR --concurrency 16 64
    python benchmarks/chunk_budget.py --vllm-venv /work/venv-vllm --offline-requests 0 --rounds 3

Each round starts `asyncengine serve --max-num-batched-tokens B` for each budget in turn (the
order alternates between rounds) and runs, for each concurrency N, a closed loop of N gRPC
streams (benchmarks/serving.py's client, in a process of its own), each streaming random
`--prompt-len`-token prompts with `--output-len` tokens out, one request after another. With
every output the same length, N streams start and end together: each wave's prompts arrive at
once and wait for one another's prefill, as they do under `vllm bench serve --max-concurrency`,
which `--vllm-venv` runs instead (over HTTP, as benchmarks/vs_vllm.py does; no e2e column).
It then times `LLM.generate` of `--offline-requests` requests of mixed lengths at each budget.

A budget sets how long one step may run. Chunked prefill is always on, so every budget serves
every prompt; a larger one prefills more prompts a step, and every prompt of the step waits for
the whole step's first tokens, as every decoding request does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def served(target: str, n: int, reqs: list[list[int]], max_tokens: int) -> dict[str, Any]:
    import serving

    return asyncio.run(serving.closed_loop(target, n, reqs, max_tokens))


def served_to_vllm_bench(
    ns: argparse.Namespace, model: str, http_port: int, n: int, seed: int, tmp: str
) -> dict[str, Any]:
    """The same load from `vllm bench serve` over HTTP (vs_vllm.py's run of it: random text
    prompts of `--prompt-len` tokens, `--output-len` out, ignore_eos), in this table's terms."""
    import vs_vllm

    args = argparse.Namespace(
        vllm_venv=ns.vllm_venv, min_serve_prompts=1, serve_prompts_per_conc=ns.waves,
        input_len=ns.prompt_len, output_len=ns.output_len, threads=ns.threads,
    )  # fmt: skip
    with open(Path(tmp) / "vllm-bench.log", "a") as log:
        got = vs_vllm.bench_serve(args, Path(model), f"http://127.0.0.1:{http_port}", n, seed, log)
    keys = {
        "tokens_per_s": "output_throughput",
        "ttft_p50_ms": "p50_ttft_ms",
        "ttft_p99_ms": "p99_ttft_ms",
        "itl_p50_ms": "p50_itl_ms",
        "itl_p99_ms": "p99_itl_ms",
    }
    row = {mine: round(float(got[theirs]), 2) for mine, theirs in keys.items()}
    return {"concurrency": n, "requests": got["completed"], **row}


def offline(model: str, ns: argparse.Namespace, budget: int) -> dict[str, Any]:
    """`LLM.generate` of the mixed requests (after one warm-up pass), in a process of its own."""
    import torch

    from asyncengine import LLM, SamplingParams

    torch.set_num_threads(ns.threads)
    llm = LLM(
        model=model, dtype=ns.dtype, device="cpu", seed=0, max_num_seqs=ns.max_num_seqs,
        max_model_len=ns.max_model_len, max_num_batched_tokens=budget,
    )  # fmt: skip
    rng = random.Random(ns.seed)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    lens = [(rng.randint(8, ns.prompt_len), rng.randint(8, ns.output_len))
            for _ in range(ns.offline_requests)]  # fmt: skip
    rates = []
    for _ in range(2):  # the first pass meets the batch shapes first
        prompts = [[rng.randrange(3, vocab) for _ in range(p)] for p, _ in lens]
        params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in lens]
        started = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rates.append(tokens / (time.perf_counter() - started))
    return {"offline_tokens_per_s": round(rates[-1], 1)}


def run(ns: argparse.Namespace, model: str, tmp: str) -> list[dict[str, Any]]:
    import serving

    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rows = []
    for r in range(ns.rounds):
        for budget in ns.budgets if r % 2 == 0 else ns.budgets[::-1]:
            flags = ["--device", "cpu", "--dtype", ns.dtype, "--torch-threads", str(ns.threads),
                     "--max-num-seqs", str(ns.max_num_seqs), "--max-model-len",
                     str(ns.max_model_len), "--max-num-batched-tokens", str(budget),
                     "--log-level", "WARNING"]  # fmt: skip
            server = serving.Server(model, flags, tmp)
            try:
                server.wait_serving()
                for i, n in enumerate(ns.concurrency):
                    # prompts of their own each run: one sent again is served from the cache
                    seed = 1000 * r + i
                    if ns.vllm_venv is not None:
                        row = served_to_vllm_bench(ns, model, server.http_port, n, seed, tmp)
                    else:
                        reqs = serving.prompts(ns.waves * n, ns.prompt_len, vocab, seed)
                        row = serving.fresh(served, f"127.0.0.1:{server.port}", n, reqs,
                                            ns.output_len)  # fmt: skip
                    rows.append({"round": r, "budget": budget, **row})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            finally:
                server.stop()
            if ns.offline_requests:
                row = serving.fresh(offline, model, ns, budget)
                rows.append({"round": r, "budget": budget, "concurrency": "offline", **row})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def summary(rows: list[dict[str, Any]], ns: argparse.Namespace) -> list[dict[str, Any]]:
    """Medians over the rounds, per budget and concurrency."""
    out = []
    for budget in ns.budgets:
        for n in [*ns.concurrency, "offline"]:
            mine = [r for r in rows if r["budget"] == budget and r["concurrency"] == n]
            if not mine:
                continue
            keys = [k for k, v in mine[0].items() if isinstance(v, float) and k != "wall_s"]
            med = {k: round(statistics.median(r[k] for r in mine), 1) for k in keys}
            out.append({"budget": budget, "concurrency": n, **med})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a local HF model directory (default: a random 60M llama)")
    p.add_argument("--budgets", type=lambda s: [int(b) for b in s.split(",")],
                   default=[2048, 512])  # fmt: skip
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    p.add_argument("--waves", type=int, default=4, help="requests per stream")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--offline-requests", type=int, default=48, help="0: no offline rows")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--vllm-venv",
        type=Path,
        help="serve to `vllm bench serve` from this venv (benchmarks/vs_vllm.py --install) over "
        "HTTP instead of this repo's gRPC client",
    )
    p.add_argument("--json", action="store_true")
    ns = p.parse_args()
    sys.path.insert(0, str(HERE))  # serving.py, for the spawned clients too
    os.environ.setdefault("OMP_NUM_THREADS", str(ns.threads))

    from asyncengine.testing import make_sized_llama

    with tempfile.TemporaryDirectory() as tmp:
        model = ns.model or str(make_sized_llama(Path(tmp) / "model", 768, 8))
        rows = run(ns, model, tmp)
    from machine import cpu_flags  # beside this file

    table = summary(rows, ns)
    machine = {"cpu": f"{platform.machine()} ({cpu_flags()})", "cores": os.cpu_count()}
    if ns.json:
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(ns).items()}
        print(json.dumps({"config": config, **machine, "summary": table, "runs": rows}))
        return
    print(f"the step's token budget: {ns.prompt_len}-token prompts, {ns.output_len} tokens out, "
          f"{ns.rounds} round(s), medians; CPU {machine['cpu']}, {machine['cores']} cores, "
          f"{ns.threads} threads, dtype {ns.dtype}")  # fmt: skip
    head = ["budget", "N", "tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "e2e p50"]
    print("  ".join(f"{h:>9}" for h in head))
    for r in table:
        if r["concurrency"] == "offline":
            cells = [r["budget"], "offline", r["offline_tokens_per_s"], *["-"] * 5]
        else:
            keys = ["tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
                    "e2e_p50_ms"]  # fmt: skip
            cells = [r["budget"], r["concurrency"], *(r.get(k, "-") for k in keys)]
        print("  ".join(f"{c:>9}" for c in cells))


if __name__ == "__main__":
    main()
