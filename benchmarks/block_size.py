"""KV block size: the memory it wastes (a model) and the throughput it gets (measured on CPU).

1. KV waste (computed, not measured on a device): for a workload of mixed lengths, the share of
   allocated KV slots that hold no token, averaged over every step of every request, with paged
   blocks of B tokens (a request holds ceil(tokens / B) blocks) against contiguous preallocation
   of max_model_len slots per request (what a server without paging reserves).
2. Throughput: the same requests through the engine (`LLM.generate`, the CPU torch attention
   path) for each block size, with enough blocks that nothing is preempted, so the figure is
   the cost of the block size itself (gathering and padding whole blocks, longer tables).

    python benchmarks/block_size.py [--block-sizes 16 64 256 512 1024] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from asyncengine import LLM, SamplingParams
from asyncengine.logging import configure_logging
from asyncengine.testing import make_random_model

SMALL_MODEL: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip


def workload(num: int, prompt: tuple[int, int], output: tuple[int, int], seed: int) -> list[Any]:
    """(prompt length, output length) of `num` requests, uniform in the given ranges."""
    rng = random.Random(seed)
    return [(rng.randint(*prompt), rng.randint(*output)) for _ in range(num)]


def kv_waste(lengths: list[tuple[int, int]], block_size: int | None, max_model_len: int) -> float:
    """Unused share of allocated KV slots over every generation step (None: contiguous)."""
    used = allocated = 0
    for num_prompt, num_output in lengths:
        for num_tokens in range(num_prompt + 1, num_prompt + num_output + 1):
            used += num_tokens
            if block_size is None:
                allocated += max_model_len
            else:
                allocated += math.ceil(num_tokens / block_size) * block_size
    return 1 - used / allocated


def throughput(
    model: str, lengths: list[tuple[int, int]], block_size: int, ns: argparse.Namespace
) -> dict[str, Any]:
    vocab = 4096
    rng = random.Random(ns.seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(p)] for p, _ in lengths]
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in lengths]
    # room for every request at once: no preemption, whatever the block size
    num_blocks = sum(math.ceil((p + o) / block_size) for p, o in lengths) + 1
    llm = LLM(model=model, device="cpu", dtype="float32", block_size=block_size,
              max_num_seqs=len(lengths), max_num_batched_tokens=ns.max_num_batched_tokens,
              max_model_len=ns.max_model_len, num_gpu_blocks_override=num_blocks,
              num_cpu_blocks_override=0, enable_prefix_caching=False)  # fmt: skip
    llm.generate(prompts[:2], [SamplingParams(max_tokens=4)] * 2, use_tqdm=False)  # warm-up
    best = float("inf")
    for _ in range(ns.repeats):
        started = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - started)
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert num_tokens == sum(o for _, o in lengths)
    return {"block_size": block_size, "seconds": round(best, 3),
            "tokens_per_s": round(num_tokens / best, 1), "num_blocks": num_blocks}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64, 256, 512, 1024])
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--waste-requests", type=int, default=1000)
    parser.add_argument("--prompt", type=int, nargs=2, default=[16, 512], metavar=("MIN", "MAX"))
    parser.add_argument("--output", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--requests", type=int, default=32, help="requests of the timed run")
    parser.add_argument("--timed-output", type=int, nargs=2, default=[16, 128])
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per size (best kept)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args()
    configure_logging("WARNING")
    torch.set_num_threads(ns.threads)

    lengths = workload(ns.waste_requests, tuple(ns.prompt), tuple(ns.output), ns.seed)
    waste = [{"block_size": b, "kv_waste": round(kv_waste(lengths, b, ns.max_model_len), 4)}
             for b in ns.block_sizes]  # fmt: skip
    contiguous = round(kv_waste(lengths, None, ns.max_model_len), 4)
    rows = []
    if not ns.skip_throughput:
        timed = workload(ns.requests, tuple(ns.prompt), tuple(ns.timed_output), ns.seed + 1)
        with tempfile.TemporaryDirectory() as tmp:
            model = str(make_random_model(Path(tmp) / "model", "llama", vocab_size=4096,
                                          max_position_embeddings=ns.max_model_len,
                                          **SMALL_MODEL))  # fmt: skip
            for b in ns.block_sizes:
                rows.append(throughput(model, timed, b, ns))
                print(json.dumps(rows[-1]), file=sys.stderr)
    config = {k: v for k, v in vars(ns).items() if k != "json"}
    result = {"config": config, "kv_waste": waste, "contiguous_kv_waste": contiguous,
              "throughput": rows}  # fmt: skip
    if ns.json:
        print(json.dumps(result, indent=2))
        return
    print(f"KV waste, {ns.waste_requests} requests, prompt {ns.prompt}, output {ns.output}; "
          f"contiguous preallocation of {ns.max_model_len}: {contiguous:.1%}")  # fmt: skip
    by_size = {r["block_size"]: r for r in rows}
    print(f"{'block':>6} {'KV waste':>9} {'tok/s (CPU)':>12}")
    for w in waste:
        tps = by_size.get(w["block_size"], {}).get("tokens_per_s", "-")
        print(f"{w['block_size']:>6} {w['kv_waste']:>9.1%} {tps:>12}")


if __name__ == "__main__":
    main()
