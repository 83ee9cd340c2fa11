"""The step loop's own overhead, with a model runner that returns tokens instantly.

Two figures, the ones the loop is judged by:
  1. tokens/s the AsyncLLMEngine loop delivers to N concurrent `async for` streams;
  2. CPU time per step of schedule() and update() (incl. detokenization) at N running requests.

    python benchmarks/async_overhead.py [--num-streams 256] [--max-tokens 128] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from typing import Any

from asyncengine import AsyncLLMEngine, EngineArgs, SamplingParams
from asyncengine.engine.llm_engine import LLMEngine
from asyncengine.logging import configure_logging
from asyncengine.testing import make_random_model
from asyncengine.worker.fake_runner import FakeModelRunner, count_up


def make_engine(model_dir: str, num_streams: int, block_size: int) -> LLMEngine:
    args = EngineArgs(
        model=model_dir,
        device="cpu",
        block_size=block_size,
        max_num_seqs=num_streams,
        max_num_batched_tokens=max(2048, num_streams),
        num_gpu_blocks_override=num_streams * 64,
        num_cpu_blocks_override=0,
    )
    config = args.create_engine_config()
    vocab_size = int(config.model_config.hf_config.vocab_size)
    return LLMEngine(config, FakeModelRunner(config, count_up(vocab_size)))


def prompts(num: int) -> list[list[int]]:
    return [[4 + (i * 7 + j) % 400 for j in range(16 + i % 48)] for i in range(num)]


async def stream_throughput(engine: LLMEngine, num_streams: int, max_tokens: int) -> dict[str, Any]:
    async_engine = AsyncLLMEngine(engine)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    num_outputs = 0

    async def consume(i: int, prompt: list[int]) -> int:
        nonlocal num_outputs
        async for out in async_engine.generate(prompt, params, request_id=f"s{i}"):  # noqa: B007
            num_outputs += 1
        return len(out.outputs[0].token_ids)

    started = time.perf_counter()
    counts = await asyncio.gather(*(consume(i, p) for i, p in enumerate(prompts(num_streams))))
    seconds = time.perf_counter() - started
    await async_engine.shutdown()
    return {
        "streams": num_streams,
        "tokens": sum(counts),
        "seconds": seconds,
        "tokens_per_s": sum(counts) / seconds,
        "outputs_delivered": num_outputs,
    }


def step_cpu_time(engine: LLMEngine, num_running: int, num_steps: int) -> dict[str, Any]:
    params = SamplingParams(max_tokens=num_steps + 64, ignore_eos=True)
    for i, prompt in enumerate(prompts(num_running)):
        engine.add_request(f"r{i}", prompt, params)
    while engine.get_stats().num_waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()  # get every request past its prefill
    schedule_s, update_s = [], []
    for _ in range(num_steps):
        t0 = time.process_time()
        plan = engine.schedule()
        t1 = time.process_time()
        result = engine.execute(plan)
        t2 = time.process_time()
        engine.update(plan, result)
        t3 = time.process_time()
        assert len(plan.scheduled) == num_running
        schedule_s.append(t1 - t0)
        update_s.append(t3 - t2)
    engine.abort_request([f"r{i}" for i in range(num_running)])
    schedule_us = statistics.median(schedule_s) * 1e6
    update_us = statistics.median(update_s) * 1e6
    return {
        "running": num_running,
        "schedule_us": schedule_us,
        "update_us": update_us,
        "per_request_us": (schedule_us + update_us) / num_running,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-streams", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50, help="steps timed for the CPU figure")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args()
    configure_logging("WARNING")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_random_model(tmp, "llama"))
        for n in ns.num_streams:
            engine = make_engine(model_dir, n, ns.block_size)
            stream = asyncio.run(stream_throughput(engine, n, ns.max_tokens))
            step = step_cpu_time(make_engine(model_dir, n, ns.block_size), n, ns.steps)
            rows.append({**stream, **step})
    if ns.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"fake runner, {ns.max_tokens} tokens per stream, block size {ns.block_size}")
    print(
        f"{'streams':>8} {'tokens/s':>10} {'sched us/step':>14} {'update us/step':>15} "
        f"{'us/req/step':>12}"
    )
    for r in rows:
        print(
            f"{r['streams']:>8} {r['tokens_per_s']:>10.0f} {r['schedule_us']:>14.0f} "
            f"{r['update_us']:>15.0f} {r['per_request_us']:>12.1f}"
        )


if __name__ == "__main__":
    main()
