"""Prefix caching: throughput and TTFT with caching on and off, on a shared-prefix workload and
on a workload with no shared prefix at all (the cost of caching when it never hits).

    python benchmarks/prefix.py [--model DIR | --hidden 256 --layers 4] [--json]

All requests arrive at once; each system runs the same workload after an untimed warm-up.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from typing import Any

import torch

from asyncengine import LLM, SamplingParams
from asyncengine.logging import configure_logging
from asyncengine.testing import make_sized_llama


def workloads(
    num_requests: int, prefix_len: int, suffix_len: int, vocab: int, seed: int = 0
) -> dict[str, Any]:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    system = tokens(prefix_len)
    return {
        "shared-prefix": [system + tokens(suffix_len) for _ in range(num_requests)],
        "no-shared-prefix": [tokens(prefix_len + suffix_len) for _ in range(num_requests)],
    }


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    stats_before = engine.get_stats()
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", prompt, params)
    ttfts, num_tokens = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.metrics and out.metrics.first_token_time:
                ttfts.append(out.metrics.first_token_time - out.metrics.arrival_time)
                num_tokens += len(out.outputs[0].token_ids)
    seconds = time.perf_counter() - started
    stats = engine.get_stats()
    queries = stats.num_prefix_cache_queries - stats_before.num_prefix_cache_queries
    hits = stats.num_prefix_cache_hits - stats_before.num_prefix_cache_hits
    return {
        "seconds": seconds,
        "output_tokens_per_s": num_tokens / seconds,
        "requests_per_s": len(prompts) / seconds,
        "ttft_p50_s": statistics.median(ttfts),
        "hit_rate": hits / queries if queries else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF model directory (default: a random Llama)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=3, help="medians over this many rounds")
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args()
    configure_logging("WARNING")
    torch.set_num_threads(ns.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = ns.model or str(make_sized_llama(tmp, ns.hidden, ns.layers))
        llms = {
            caching: LLM(
                model=model,
                device="cpu",
                dtype="float32",
                enable_prefix_caching=caching,
                max_num_seqs=ns.num_requests,
            )
            for caching in (False, True)
        }
        vocab = int(llms[False].llm_engine.vocab_size)
        runs: dict[tuple[str, bool], list[dict[str, float]]] = {}
        for llm in llms.values():
            run(llm, workloads(4, 64, 8, vocab)["no-shared-prefix"], 4)  # warm-up
        # rounds alternate on and off so drift on a shared machine hits both alike; every
        # round draws fresh prompts, so nothing is cached across rounds
        for round_index in range(1, ns.rounds + 1):
            loads = workloads(ns.num_requests, ns.prefix_len, ns.suffix_len, vocab, round_index)
            for name, prompts in loads.items():
                for caching, llm in llms.items():
                    runs.setdefault((name, caching), []).append(run(llm, prompts, ns.max_tokens))
    rows = [
        {
            "workload": name,
            "prefix_caching": caching,
            **{k: statistics.median(r[k] for r in results) for k in results[0]},
        }
        for (name, caching), results in runs.items()
    ]
    report(rows, ns)


def report(rows: list[dict[str, Any]], ns: argparse.Namespace) -> None:
    if ns.json:
        print(json.dumps(rows, indent=2))
        return
    print(
        f"{ns.num_requests} requests, prefix {ns.prefix_len} + suffix {ns.suffix_len} tokens, "
        f"{ns.max_tokens} output tokens each, {ns.threads} threads, median of {ns.rounds}"
    )
    print(f"{'workload':<18} {'caching':>8} {'tok/s':>8} {'req/s':>7} {'TTFT p50':>9} {'hits':>6}")
    for r in rows:
        print(
            f"{r['workload']:<18} {'on' if r['prefix_caching'] else 'off':>8} "
            f"{r['output_tokens_per_s']:>8.1f} {r['requests_per_s']:>7.2f} "
            f"{r['ttft_p50_s']:>8.3f}s {r['hit_rate']:>6.0%}"
        )
    by = {(r["workload"], r["prefix_caching"]): r for r in rows}
    for name in ("shared-prefix", "no-shared-prefix"):
        ratio = by[(name, True)]["output_tokens_per_s"] / by[(name, False)]["output_tokens_per_s"]
        print(f"{name}: caching on / off throughput = {ratio:.3f}")


if __name__ == "__main__":
    main()
