"""Where detokenization runs: its share of the engine's step, against what it would add to the
front process if it ran there (as vLLM v1 does, in its front's OutputProcessor).

Steps an `LLMEngine` with a model (the bundled default model unless --model) over N running
requests and times, per step: the whole step, the forward, `update()` (token appends, stop
checks, detokenization), and the detokenizers' own calls inside it. It also times what a step's
outputs cost to cross to the front process (msgspec encode in the engine process, decode in
the front), the price either placement pays per output.

    python benchmarks/detokenize.py [--concurrency 1 16 64 256] [--max-tokens 64] [--json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from typing import Any

import msgspec
import torch
from machine import cpu_flags  # beside this file

from asyncengine import EngineArgs, SamplingParams
from asyncengine.engine.llm_engine import LLMEngine
from asyncengine.engine.messages import StepOutputs


class _Timed:
    """A detokenizer whose calls add their time to `totals`."""

    def __init__(self, inner: Any, totals: dict[str, float]) -> None:
        self.inner, self.totals = inner, totals

    def decode_next(self, token_ids: list[int], is_final: bool = False) -> str:
        started = time.perf_counter()
        text = self.inner.decode_next(token_ids, is_final)
        self.totals["detokenize_s"] += time.perf_counter() - started
        self.totals["num_tokens"] += 1
        return str(text)


def measure(model: str, num_requests: int, max_tokens: int) -> dict[str, Any]:
    args = EngineArgs(
        model=model,
        device="cpu",
        max_num_seqs=max(num_requests, 1),
        max_num_batched_tokens=max(2048, num_requests * 16),
        num_cpu_blocks_override=0,
    )
    engine = LLMEngine.from_engine_args(args)
    totals = {"detokenize_s": 0.0, "num_tokens": 0.0}
    new_detokenizer = engine._new_detokenizer
    engine._new_detokenizer = lambda prompt, skip: _Timed(new_detokenizer(prompt, skip), totals)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    words = [
        "The",
        "following",
        "methods",
        "can",
        "be",
        "defined",
        "to",
        "return",
        "the",
        "value",
        "of",
    ]
    for i in range(num_requests):
        engine.add_request(f"r{i}", " ".join(words[: 3 + i % 9]), params)
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(StepOutputs)
    step_s = execute_s = update_s = channel_s = 0.0
    num_steps = num_outputs = 0
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        plan = engine.schedule()
        scheduled = time.perf_counter()
        result = engine.execute(plan)
        executed = time.perf_counter()
        outputs = engine.update(plan, result)
        updated = time.perf_counter()
        for out in outputs:
            out.prompt, out.prompt_token_ids = None, []
        decoder.decode(encoder.encode(StepOutputs(outputs, [], engine.get_stats())))
        channel_s += time.perf_counter() - updated
        step_s += updated - started
        execute_s += executed - scheduled
        update_s += updated - executed
        num_steps += 1
        num_outputs += len(outputs)
    detok_s = totals["detokenize_s"]
    return {
        "concurrency": num_requests,
        "steps": num_steps,
        "step_ms": round(1e3 * step_s / num_steps, 2),
        "forward_ms": round(1e3 * execute_s / num_steps, 2),
        "update_ms": round(1e3 * update_s / num_steps, 3),
        "detokenize_ms": round(1e3 * detok_s / num_steps, 3),
        "detokenize_share": round(detok_s / step_s, 4),
        "detokenize_us_per_token": round(1e6 * detok_s / max(totals["num_tokens"], 1), 2),
        "channel_us_per_output": round(1e6 * channel_s / max(num_outputs, 1), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF model directory (default: the bundled model)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args()
    torch.set_num_threads(ns.threads)
    if ns.model is None:
        from asyncengine import default_model

        ns.model = default_model.path()
    rows = [measure(ns.model, n, ns.max_tokens) for n in ns.concurrency]
    if ns.json:
        config = {k: v for k, v in vars(ns).items() if k != "json"}
        print(json.dumps({"config": config, "cpu": cpu_flags(), "results": rows}, indent=2))
        return
    print(f"{platform.processor() or platform.machine()}, flags: {cpu_flags()}, "
          f"{ns.threads} torch thread(s), {ns.max_tokens} tokens per request")  # fmt: skip
    head = ["N", "step ms", "forward ms", "update ms", "detok ms", "detok share",
            "detok us/token", "channel us/output"]  # fmt: skip
    keys = ["concurrency", "step_ms", "forward_ms", "update_ms", "detokenize_ms",
            "detokenize_share", "detokenize_us_per_token", "channel_us_per_output"]  # fmt: skip
    print("  ".join(f"{h:>17}" for h in head))
    for row in rows:
        print("  ".join(f"{row[k]:>17}" for k in keys))


if __name__ == "__main__":
    main()
