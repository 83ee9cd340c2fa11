"""Multi-LoRA throughput: one base model serving 0, 1, 4 and 16 adapters in mixed batches.

Every run generates the same requests (random token ids, `--prompt-len` in, `--output-len` out,
ignore_eos) in one `LLM.generate`; with N adapters the requests are spread evenly over them
(request i runs adapter i mod N). Each adapter is random, rank `--rank`, on all seven
projections. Mixed runs use `--max-loras` device slots (4 and 16 by default): with more
adapters than slots the scheduler runs them a slot's worth at a time.

The baseline is what serving without multi-LoRA costs: each adapter merged into its own copy of
the model (PEFT's `merge_and_unload`), the copies run one after another, each on its share of
the requests (model loading not counted). The goal (issue 28): 16 adapters mixed >= 0.7x the
base-only rate. Adapter load times are what `add_lora` took (read, check, host copy).

    python benchmarks/lora.py --quick                  # smoke test, ~1 min
    python benchmarks/lora.py --make-model 60m --threads 2 --json
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from machine import cpu_flags  # beside this file

MODELS = {"tiny": (64, 2), "60m": (768, 8)}  # hidden size, layers (make_sized_llama)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a llama-family model directory (default: --make-model)")
    parser.add_argument("--make-model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--adapters", default="0,1,4,16", help="adapter counts to run")
    parser.add_argument("--max-loras", default="4,16", help="device slot counts to run")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--no-merged", action="store_true", help="skip the merged baseline")
    parser.add_argument(
        "--repeat", type=int, default=3, help="timed runs of each load (the median is kept)"
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke test")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.prompt_len, args.output_len, args.repeat = 32, 16, 8, 1
    return args


def requests(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [
        [rng.randrange(3, vocab_size) for _ in range(args.prompt_len)]
        for _ in range(args.num_requests)
    ]


def timed_generate(
    llm: Any, prompts: list[list[int]], loras: list[Any] | None, output_len: int, repeat: int
) -> tuple[float, int]:
    """The median output tokens/s of `repeat` runs of the whole load, after one untimed run of
    it (the first meets every batch shape, and CPU primitives are built per shape: issue 27),
    and the tokens one run makes. Each run's prompts start apart, so no run reuses another's
    cached prefixes."""
    from asyncengine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    rates, num_tokens, vocab_size = [], 0, llm.llm_engine.vocab_size
    for run in range(repeat + 1):
        shifted = [[3 + (p[0] - 3 + run) % (vocab_size - 3), *p[1:]] for p in prompts]
        started = time.perf_counter()
        outs = llm.generate(shifted, params, use_tqdm=False, lora_request=loras)
        elapsed = time.perf_counter() - started
        num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        if run:  # the first is the warm-up
            rates.append(num_tokens / elapsed)
    return statistics.median(rates), num_tokens


def run_mixed(
    args: argparse.Namespace, model: Path, loras: list[Any], max_loras: int
) -> dict[str, Any]:
    from asyncengine import LLM

    enable = bool(loras)
    llm = LLM(
        model=str(model), dtype=args.dtype, device="cpu", max_num_seqs=args.num_requests,
        enable_lora=enable, max_loras=max_loras, max_lora_rank=max(args.rank, 1),
        max_cpu_loras=max(max_loras, len(loras)),
    )  # fmt: skip
    load_ms = []
    for lora in loras:
        started = time.perf_counter()
        llm.add_lora(lora)
        load_ms.append((time.perf_counter() - started) * 1000)
    prompts = requests(args, llm.llm_engine.vocab_size)
    per_request = [loras[i % len(loras)] if loras else None for i in range(len(prompts))]
    rate, _ = timed_generate(llm, prompts, per_request, args.output_len, args.repeat)
    llm.shutdown()
    return {
        "system": "mixed",
        "num_adapters": len(loras),
        "max_loras": max_loras if enable else 0,
        "tokens_per_s": rate,
        "load_ms_median": statistics.median(load_ms) if load_ms else None,
        "load_ms_max": max(load_ms) if load_ms else None,
    }


def run_merged(
    args: argparse.Namespace, model: Path, loras: list[Any], workdir: Path
) -> dict[str, Any]:
    """Each adapter merged into a model copy; the copies run their requests one after another."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncengine import LLM

    prompts = requests(args, AutoTokenizer.from_pretrained(model).vocab_size)
    total_s, num_tokens = 0.0, 0
    for index, lora in enumerate(loras):
        merged_dir = workdir / f"merged-{index}"
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        PeftModel.from_pretrained(base, lora.lora_path).merge_and_unload().save_pretrained(
            merged_dir
        )
        AutoTokenizer.from_pretrained(model).save_pretrained(merged_dir)
        llm = LLM(model=str(merged_dir), dtype=args.dtype, device="cpu", max_num_seqs=64)
        rate, share_tokens = timed_generate(
            llm, prompts[index :: len(loras)], None, args.output_len, args.repeat
        )
        total_s += share_tokens / rate
        num_tokens += share_tokens
        llm.shutdown()
    return {"system": "merged", "num_adapters": len(loras), "tokens_per_s": num_tokens / total_s}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.disable(logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    from asyncengine import LoRARequest
    from asyncengine.testing import make_random_lora, make_sized_llama

    counts = [int(n) for n in args.adapters.split(",")]
    slot_counts = [int(n) for n in args.max_loras.split(",")]
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        workdir = Path(tmp)
        model = Path(args.model) if args.model else make_sized_llama(
            workdir / "model", *MODELS[args.make_model]
        )  # fmt: skip
        loras = [
            LoRARequest(f"adapter-{i}", i, str(make_random_lora(
                workdir / f"lora-{i}", model, seed=i, r=args.rank, target_modules=TARGETS
            )))
            for i in range(1, max(counts) + 1)
        ]  # fmt: skip
        for num_adapters in counts:
            for max_loras in slot_counts if num_adapters else slot_counts[:1]:
                print(f"mixed: {num_adapters} adapters, max_loras {max_loras}", file=sys.stderr)
                results.append(run_mixed(args, model, loras[:num_adapters], max_loras))
        if not args.no_merged:
            for num_adapters in (n for n in counts if n):
                print(f"merged: {num_adapters} model copies", file=sys.stderr)
                results.append(run_merged(args, model, loras[:num_adapters], workdir))
    base = next(r["tokens_per_s"] for r in results if r["num_adapters"] == 0)
    for result in results:
        result["vs_base"] = result["tokens_per_s"] / base
    report = {
        "machine": {
            "cpu": platform.processor(),
            "flags": cpu_flags(),
            "threads": torch.get_num_threads(),
        },
        "args": vars(args),
        "results": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"cpu flags: {cpu_flags()}; threads {torch.get_num_threads()}")
        print_table(results)
    return 0


def print_table(results: list[dict[str, Any]]) -> None:
    print(f"{'system':8} {'adapters':>8} {'max_loras':>9} {'tok/s':>9} {'vs base':>8} "
          f"{'load ms (median/max)':>21}")  # fmt: skip
    for r in results:
        load = ""
        if r.get("load_ms_median") is not None:
            load = f"{r['load_ms_median']:.1f} / {r['load_ms_max']:.1f}"
        slots = str(r.get("max_loras", "")) if r["system"] == "mixed" else "-"
        print(f"{r['system']:8} {r['num_adapters']:>8} {slots:>9} {r['tokens_per_s']:>9.1f} "
              f"{r['vs_base']:>7.2f}x {load:>21}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
