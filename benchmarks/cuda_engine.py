"""The whole engine on CUDA: KV sizing from a profiled forward, parity with transformers per
attention backend, swapping through the pinned host pool, and throughput per backend.

    python benchmarks/cuda_engine.py [--json]
    python benchmarks/cuda_engine.py --device cpu   # the same checks on the CPU (dev smoke run)

Every check prints one row, PASS or FAIL with its figures, and the script exits non-zero if any
failed; then it times offline throughput with each attention backend. On a random Llama
(hidden 512, 8 layers) built here, so it needs no download:

- sizing: `LLM()` sizes the cache from a profiled forward (CUDA) and logs `kv_cache_sized`; the
  parts add up within the memory budget and the swap pool is pinned host memory.
- parity-<backend>: greedy tokens of several prompts (float32) equal transformers' on the same
  device, apart from steps where transformers' top two logits are closer than --tie-margin.
- swap-<backend>: with a cache that forces preemption by swap, seeded sampled tokens equal those
  of a cache with room for everything, and every block comes back.
- throughput-<backend>: bfloat16, --num-requests requests of random lengths, output tokens/s.

Without CUDA (and without --device cpu) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from structlog.testing import capture_logs

from asyncengine import LLM, SamplingParams
from asyncengine.logging import configure_logging
from asyncengine.testing import make_random_model

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "양자역학 설명해줄래?",
    "def fibonacci(n: int) -> int:\n",
    "A paged key-value cache splits the memory of each sequence into fixed-size blocks. " * 8,
]
BACKENDS = ("torch", "triton")


def make_llm(model: Path, device: str, **overrides: Any) -> LLM:
    args: dict[str, Any] = {"device": device, "dtype": "float32", "seed": 0}
    return LLM(model=str(model), **{**args, **overrides})


def check_sizing(model: Path, device: str) -> dict[str, Any]:
    configure_logging("INFO")  # kv_cache_sized is an info line; captured, not printed
    try:
        with capture_logs() as logs:
            llm = make_llm(model, device, dtype="bfloat16")
    finally:
        configure_logging("WARNING")
    (sized,) = [e for e in logs if e["event"] == "kv_cache_sized"]
    parts = ["weights_gib", "activation_peak_gib", "non_torch_gib", "kv_cache_gib"]
    used = sum(sized[p] for p in parts)
    cpu_pool = llm.llm_engine.model_runner.cache_engine.cpu_cache  # type: ignore[union-attr]
    pinned = bool(cpu_pool) and cpu_pool[0].is_pinned()
    ok = (
        sized["num_gpu_blocks"] > 0
        and used <= sized["budget_gib"] + 0.01
        and (device != "cuda" or (sized["activation_measured"] and pinned))
    )
    detail = ", ".join(f"{p[:-4]} {sized[p]:.2f}" for p in parts)
    return {
        "check": "sizing",
        "ok": ok,
        "detail": f"{detail} of budget {sized['budget_gib']:.2f} GiB; "
        f"{sized['num_gpu_blocks']} device blocks, {sized['num_cpu_blocks']} host blocks"
        f"{' (pinned)' if pinned else ''}, activation measured: {sized['activation_measured']}",
        "kv_cache_sized": {k: v for k, v in sized.items() if k not in ("event", "log_level")},
    }


def hf_greedy(model: Path, device: str, prompt_ids: list[int], max_new: int) -> tuple[list, list]:
    """transformers' greedy continuation on `device` and each step's top-1 minus top-2 logit."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device).eval()
    hf.generation_config.eos_token_id = None
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new,
        eos_token_id=None,
        pad_token_id=hf.config.pad_token_id,
        output_scores=True,
        return_dict_in_generate=True,
    )
    ids = torch.tensor([prompt_ids], device=device)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return out.sequences[0, len(prompt_ids) :].tolist(), margins


def check_parity(model: Path, device: str, backend: str, max_new: int, tie: float) -> dict:
    llm = make_llm(model, device, attention_backend=backend)
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    mismatches = []
    for i, out in enumerate(outs):
        expected, margins = hf_greedy(model, device, out.prompt_token_ids, max_new)
        got = out.outputs[0].token_ids
        first = next((j for j, (a, b) in enumerate(zip(got, expected)) if a != b), None)
        if first is not None and margins[first] >= tie:  # a real difference, not a near-tie
            mismatches.append(f"prompt {i} step {first} (margin {margins[first]:.4f})")
    return {
        "check": f"parity-{backend}",
        "ok": not mismatches,
        "detail": f"{len(PROMPTS)} prompts x {max_new} tokens"
        + (f"; differs at {', '.join(mismatches)}" if mismatches else ": equal to transformers"),
    }


def check_swap(model: Path, device: str, backend: str) -> dict[str, Any]:
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=96, ignore_eos=True, n=1 + i % 3)
        for i in range(len(PROMPTS))
    ]
    roomy = make_llm(model, device, attention_backend=backend)
    tight = make_llm(
        model,
        device,
        attention_backend=backend,
        num_gpu_blocks_override=24,
        num_cpu_blocks_override=256,
        preemption_mode="swap",
    )
    expected = [[c.token_ids for c in o.outputs] for o in roomy.generate(PROMPTS, params)]
    got = [[c.token_ids for c in o.outputs] for o in tight.generate(PROMPTS, params)]
    stats = tight.get_stats()
    all_back = (
        stats.num_free_gpu_blocks == stats.num_gpu_blocks
        and stats.num_free_cpu_blocks == stats.num_cpu_blocks
    )
    return {
        "check": f"swap-{backend}",
        "ok": got == expected and stats.num_preemptions_swap > 0 and all_back,
        "detail": f"{stats.num_preemptions_swap} samples swapped out and back; tokens "
        f"{'equal' if got == expected else 'DIFFER'}; every block back: {all_back}",
    }


def time_throughput(model: Path, device: str, backend: str, num_requests: int) -> dict:
    llm = make_llm(model, device, attention_backend=backend, dtype="bfloat16")
    rng = random.Random(0)
    vocab = int(llm.llm_engine.vocab_size)
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.randint(128, 512))] for _ in range(num_requests)
    ]
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "backend": backend,
        "requests": num_requests,
        "output_tokens_per_s": num_tokens / seconds,
    }


def run_check(fn: Any, *args: Any) -> dict[str, Any]:
    try:
        return dict(fn(*args))
    except Exception as exc:  # a failing check is a row, not the end of the run
        name = fn.__name__.removeprefix("check_")
        return {
            "check": name,
            "ok": False,
            "detail": f"raised {exc!r}",
            "trace": traceback.format_exc(),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--tie-margin", type=float, default=1e-3)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--json-out", help="also write the JSON report to this file")
    ns = parser.parse_args()
    if ns.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check (use --device cpu for a smoke run)")
        return 0
    configure_logging("WARNING")
    backends = BACKENDS if ns.device == "cuda" else ("torch",)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_random_model(
            tmp,
            "llama",
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=2,
        )
        checks = [run_check(check_sizing, model, ns.device)]
        for backend in backends:
            checks.append(
                run_check(check_parity, model, ns.device, backend, ns.max_new_tokens, ns.tie_margin)
            )
            checks.append(run_check(check_swap, model, ns.device, backend))
        timings = []
        if ns.device == "cuda":
            timings = [time_throughput(model, ns.device, b, ns.num_requests) for b in backends]
    report(checks, timings, ns)
    return 0 if all(c["ok"] for c in checks) else 1


def report(checks: list[dict], timings: list[dict], ns: argparse.Namespace) -> None:
    document = json.dumps({"checks": checks, "throughput": timings}, indent=2)
    if ns.json_out:
        Path(ns.json_out).write_text(document)
    if ns.json:
        print(document)
        return
    device = torch.cuda.get_device_name() if ns.device == "cuda" else "cpu"
    print(f"engine checks on {device}, torch {torch.__version__}")
    for c in checks:
        print(f"{'PASS' if c['ok'] else 'FAIL'}  {c['check']:<16} {c['detail']}")
        if "trace" in c:
            print(c["trace"], file=sys.stderr)
    for t in timings:
        print(
            f"throughput-{t['backend']:<6} {t['requests']} requests, 128 output tokens each: "
            f"{t['output_tokens_per_s']:,.0f} tokens/s"
        )


if __name__ == "__main__":
    sys.exit(main())
