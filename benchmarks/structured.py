"""Structured outputs: grammar compile time, the per-step mask cost, and constrained throughput.

    python benchmarks/structured.py [--model DIR] [--device cpu|cuda] [--json]

Three tables, on the bundled default model unless `--model` names another:

1. compile time of three JSON schemas (flat, nested, 300 properties), cold (a fresh compiler)
   and cached (the same spec again);
2. the per-step mask cost at batch 1, 16 and 64 constrained rows: filling the bitmask (CPU) and
   applying it to the logits, matchers inside a JSON string (a costly state);
3. output tokens/s of a batch that is 50% constrained against the same batch unconstrained
   (medians of interleaved rounds, no prefix caching). The constrained half writes a JSON string
   that cannot end before max_tokens, so both batches make exactly the same number of tokens
   and the ratio is the cost of constraining (goal >= 0.9x);
4. what the whitespace default costs: of `--num-requests` seeded samples of a small schema
   (`max_tokens` each), how many finish by their grammar and parse, and their mean length in
   tokens, with any whitespace between JSON tokens (the default, vLLM's) and with
   `disable_any_whitespace`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from asyncengine import LLM, SamplingParams, default_model
from asyncengine.core.request import Request
from asyncengine.engine.structured_output import StructuredOutputManager
from asyncengine.logging import configure_logging
from asyncengine.sampling_params import StructuredOutputsParams
from asyncengine.worker.sampler import _apply_grammar_masks

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 8},
            "owner": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 32},
                    "emails": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["name"],
            },
        },
        "required": ["id", "tags", "owner"],
    },
    "300-props": {
        "type": "object",
        "properties": {f"k{i}": {"type": "string", "pattern": "[a-z]{2,5}"} for i in range(300)},
        "required": ["k0"],
    },
}
# a string that cannot end before max_tokens: every constrained sample runs its full length
ENDLESS = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 100_000}},
    "required": ["text"],
}


def compile_times(llm: LLM) -> list[dict[str, Any]]:
    engine = llm.llm_engine
    rows = []
    for name, schema in SCHEMAS.items():
        # a fresh manager: nothing cached, and the compiler's TokenizerInfo built untimed
        manager = StructuredOutputManager(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
        manager.compile(StructuredOutputsParams(regex="x"))
        params = StructuredOutputsParams(json=schema)
        cold = manager.compile(params).compile_s
        started = time.perf_counter()
        cached = manager.compile(params)
        cached_s = time.perf_counter() - started
        assert cold is not None and cached.compile_s is None
        rows.append({"schema": name, "cold_ms": cold * 1e3, "cached_ms": cached_s * 1e3})
    return rows


def mask_costs(llm: LLM, device: str, rounds: int) -> list[dict[str, Any]]:
    engine = llm.llm_engine
    manager = StructuredOutputManager(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    constraint = manager.compile(StructuredOutputsParams(json=SCHEMAS["nested"]))
    prefix = engine.tokenize('{"id": 7, "tags": ["a"], "owner": {"name": "Ada')[1:]
    rows = []
    for batch in (1, 16, 64):
        reqs = [Request(f"mask-{batch}-{i}", [0], SamplingParams()) for i in range(batch)]
        for req in reqs:
            manager.add(req.group_id, constraint)
        manager.prepare(reqs)
        for req in reqs:
            for token_id in prefix:
                req.append_token(token_id)
                manager.accept(req)
        logits = torch.randn(batch, engine.vocab_size, device=device)
        fills, applies = [], []
        for _ in range(rounds):
            started = time.perf_counter()
            masks = manager.fill_masks(reqs)
            filled = time.perf_counter()
            assert masks is not None and len(masks.rows) == batch
            _apply_grammar_masks(logits, masks)
            if device == "cuda":
                torch.cuda.synchronize()
            applies.append(time.perf_counter() - filled)
            fills.append(filled - started)
        for req in reqs:
            manager.release(req.group_id)
        fill, apply = statistics.median(fills), statistics.median(applies)
        rows.append({"batch": batch, "fill_ms": fill * 1e3, "apply_ms": apply * 1e3,
                     "per_row_us": (fill + apply) / batch * 1e6})  # fmt: skip
    return rows


def throughput(llm: LLM, num_requests: int, max_tokens: int, rounds: int) -> list[dict[str, Any]]:
    prompts = [f"Write record number {i} as JSON:" for i in range(num_requests)]
    endless = StructuredOutputsParams(json=ENDLESS)

    def params(i: int, constrained: bool) -> SamplingParams:
        so = endless if constrained and i % 2 == 0 else None
        return SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True,
                              structured_outputs=so)  # fmt: skip

    batches = {
        name: [params(i, constrained) for i in range(num_requests)]
        for name, constrained in (("unconstrained", False), ("50% constrained", True))
    }
    llm.generate(prompts[:2], batches["50% constrained"][:2], use_tqdm=False)  # the compile
    rates: dict[str, list[float]] = {name: [] for name in batches}
    for _ in range(rounds):  # interleaved, so a noisy neighbour slows both alike
        for name, batch in batches.items():
            started = time.perf_counter()
            outs = llm.generate(prompts, batch, use_tqdm=False)
            seconds = time.perf_counter() - started
            num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            assert num_tokens == num_requests * max_tokens, num_tokens
            rates[name].append(num_tokens / seconds)
    base = statistics.median(rates["unconstrained"])
    return [
        {"batch": name, "tokens_per_s": statistics.median(r), "ratio": statistics.median(r) / base}
        for name, r in rates.items()
    ]


def whitespace(llm: LLM, num_requests: int, max_tokens: int) -> list[dict[str, Any]]:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
              "required": ["name"]}  # fmt: skip
    prompts = [f"Write record number {i} as JSON:" for i in range(num_requests)]
    rows = []
    for compact in (False, True):
        so = StructuredOutputsParams(json=schema, disable_any_whitespace=compact)
        batch = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens,
                                structured_outputs=so) for i in range(num_requests)]  # fmt: skip
        samples = [o.outputs[0] for o in llm.generate(prompts, batch, use_tqdm=False)]
        parsed = sum(s.finish_reason == "stop" and _parses(s.text) for s in samples)
        mean_tokens = statistics.mean(len(s.token_ids) for s in samples)
        rows.append({"whitespace": "none extra" if compact else "any (default)",
                     "finished_and_parsed": f"{parsed}/{num_requests}",
                     "mean_tokens": mean_tokens})  # fmt: skip
    return rows


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def table(title: str, rows: list[dict[str, Any]]) -> str:
    columns = list(rows[0])
    cells = [[f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in columns]
             for r in rows]  # fmt: skip
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = [title, "  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=default_model.path())
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args()
    configure_logging("WARNING")
    torch.set_num_threads(ns.threads)
    # no prefix caching: every round computes every prompt
    llm = LLM(model=ns.model, device=ns.device, max_num_seqs=ns.num_requests, seed=0,
              enable_prefix_caching=False)  # fmt: skip
    results = {
        "compile": compile_times(llm),
        "mask": mask_costs(llm, ns.device, max(ns.rounds, 20)),
        "throughput": throughput(llm, ns.num_requests, ns.max_tokens, ns.rounds),
        "whitespace": whitespace(llm, ns.num_requests, ns.max_tokens),
    }
    if ns.json:
        json.dump(results, sys.stdout, indent=2)
        print()
        return
    print(table("grammar compile time (ms)", results["compile"]), end="\n\n")
    print(table("per-step mask cost (ms: bitmask fill on the CPU, apply)", results["mask"]))
    print()
    print(table(f"throughput, {ns.num_requests} requests x {ns.max_tokens} tokens",
                results["throughput"]))  # fmt: skip
    print()
    print(table(f"JSON whitespace, {ns.num_requests} samples, max_tokens {ns.max_tokens}",
                results["whitespace"]))  # fmt: skip


if __name__ == "__main__":
    main()
