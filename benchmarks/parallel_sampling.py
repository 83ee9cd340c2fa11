"""Parallel sampling: n samples of one request (fork + copy-on-write) against n separate requests.

    python benchmarks/parallel_sampling.py [--model DIR | --hidden 256 --layers 4]
        [--num-gpu-blocks N] [--json]

Every prompt gets `--n` seeded samples, either as one request with `n` (the prompt is computed
once and its blocks shared) or as `n` requests seeded the documented way (`seed + i`), with prefix
caching off and on. All three must produce the same tokens (the script checks it); the table
shows throughput, the most device blocks in use, and preemptions. `--num-gpu-blocks` makes the
cache small enough to preempt, so the forked groups are swapped out and back in as groups.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from asyncengine import LLM, SamplingParams
from asyncengine.logging import configure_logging
from asyncengine.testing import make_sized_llama

SYSTEMS = {  # name -> (one request with n samples?, prefix caching?)
    "fork": (True, False),
    "separate": (False, False),
    "separate+cache": (False, True),
}


def run(
    llm: LLM, prompts: list[list[int]], n: int, max_tokens: int, grouped: bool, seed: int
) -> tuple[dict[str, float], list[list[list[int]]]]:
    """Generate every prompt's samples; return the figures and the samples' token ids."""
    engine = llm.llm_engine

    def params(seed: int, n: int) -> SamplingParams:
        return SamplingParams(
            n=n, temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True
        )

    tag = f"bench-{time.monotonic_ns()}"
    before = engine.get_stats()
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        prompt_seed = seed + i * n
        if grouped:
            engine.add_request(f"{tag}-{i}", prompt, params(prompt_seed, n))
        else:
            for j in range(n):
                engine.add_request(f"{tag}-{i}-{j}", prompt, params(prompt_seed + j, 1))
    finished, peak_blocks = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        stats = engine.get_stats()
        peak_blocks = max(peak_blocks, stats.num_gpu_blocks - stats.num_free_gpu_blocks)
    seconds = time.perf_counter() - started
    after = engine.get_stats()
    if grouped:
        samples = [
            [c.token_ids for c in finished[f"{tag}-{i}"].outputs] for i in range(len(prompts))
        ]
    else:
        samples = [
            [finished[f"{tag}-{i}-{j}"].outputs[0].token_ids for j in range(n)]
            for i in range(len(prompts))
        ]
    num_tokens = sum(len(tokens) for per_prompt in samples for tokens in per_prompt)
    figures = {
        "seconds": seconds,
        "output_tokens_per_s": num_tokens / seconds,
        "peak_gpu_blocks": peak_blocks,
        "preempted_swap": after.num_preemptions_swap - before.num_preemptions_swap,
        "preempted_recompute": after.num_preemptions_recompute - before.num_preemptions_recompute,
    }
    return figures, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF model directory (default: a random Llama)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-gpu-blocks", type=int, help="a small cache, to preempt")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=3, help="medians over this many rounds")
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args()
    configure_logging("WARNING")
    torch.set_num_threads(ns.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = ns.model or str(make_sized_llama(tmp, ns.hidden, ns.layers))
        llms = {
            name: LLM(
                model=model,
                device="cpu",
                dtype="float32",
                block_size=ns.block_size,
                enable_prefix_caching=caching,
                max_num_seqs=ns.num_prompts * ns.n,
                num_gpu_blocks_override=ns.num_gpu_blocks,
                preemption_mode="swap" if ns.num_gpu_blocks else "auto",
                seed=0,
            )
            for name, (_, caching) in SYSTEMS.items()
        }
        vocab = int(llms["fork"].llm_engine.vocab_size)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in SYSTEMS}
        mismatches = []
        for round_index in range(ns.rounds + 1):  # round 0 warms up and is not counted
            generator = torch.Generator().manual_seed(round_index)
            prompts = torch.randint(3, vocab, (ns.num_prompts, ns.prompt_len), generator=generator)
            samples = {}
            # systems take turns within a round, so drift on a shared machine hits all alike
            for name, llm in llms.items():
                figures, samples[name] = run(
                    llm, prompts.tolist(), ns.n, ns.max_tokens, SYSTEMS[name][0], 1000 * round_index
                )
                if round_index:
                    runs[name].append(figures)
            mismatches += [name for name in SYSTEMS if samples[name] != samples["fork"]]
    rows = [
        {"system": name, **{k: statistics.median(r[k] for r in results) for k in results[0]}}
        for name, results in runs.items()
    ]
    report(rows, ns, mismatches)
    if mismatches:
        sys.exit(f"samples differ from the forked ones: {sorted(set(mismatches))}")


def report(rows: list[dict[str, Any]], ns: argparse.Namespace, mismatches: list[str]) -> None:
    if ns.json:
        print(json.dumps({"rows": rows, "identical_samples": not mismatches}, indent=2))
        return
    cache = f"{ns.num_gpu_blocks} blocks" if ns.num_gpu_blocks else "room for all"
    print(
        f"{ns.num_prompts} prompts x n={ns.n}, {ns.prompt_len} prompt tokens, {ns.max_tokens} "
        f"output tokens per sample, block size {ns.block_size}, cache: {cache}, "
        f"{ns.threads} threads, median of {ns.rounds}"
    )
    print(f"{'system':<16} {'tok/s':>8} {'peak blocks':>12} {'swapped':>8} {'recomputed':>11}")
    for r in rows:
        print(
            f"{r['system']:<16} {r['output_tokens_per_s']:>8.1f} {r['peak_gpu_blocks']:>12.0f} "
            f"{r['preempted_swap']:>8.0f} {r['preempted_recompute']:>11.0f}"
        )
    by = {r["system"]: r for r in rows}
    for other in ("separate", "separate+cache"):
        speed = by["fork"]["output_tokens_per_s"] / by[other]["output_tokens_per_s"]
        blocks = by["fork"]["peak_gpu_blocks"] / by[other]["peak_gpu_blocks"]
        print(f"fork / {other}: throughput {speed:.2f}x, peak blocks {blocks:.2f}x")
    print(f"samples identical in all systems: {'yes' if not mismatches else 'NO'}")


if __name__ == "__main__":
    main()
