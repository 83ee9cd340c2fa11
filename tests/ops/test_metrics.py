"""The Prometheus endpoint, scraped during real load on an in-process server: the gauges agree with
GetServerInfo taken around the scrape, and the counters and histograms add up to what the
streams themselves report."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from asyncengine.v1 import control_pb2 as cpb
from asyncengine.v1 import generation_pb2 as pb

from .conftest import Samples, scrape, value
from .utils import greedy_request, read_rest, read_until, stubs

PROMPT_LEN = 10
INFO = cpb.GetServerInfoRequest()


def prompt(i: int) -> list[int]:
    return [5 + (i * 7 + j) % 400 for j in range(PROMPT_LEN)]


def usage_of(responses: list[pb.GenerateResponse]) -> pb.Usage:
    assert responses[-1].WhichOneof("event") == "usage", responses[-1]
    return responses[-1].usage


def count(samples: Samples, histogram: str) -> float:
    return value(samples, f"asyncengine_{histogram}_count")


async def wait_for_load(control: Any, running: int, waiting: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        load = (await control.GetServerInfo(INFO)).load
        if (load.running, load.waiting) == (running, waiting):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"load never reached running={running} waiting={waiting}: {load}")


async def wait_for_first_step(port: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if value(await scrape(port), "asyncengine_generation_tokens_total") > 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("no token was generated")


def test_metrics_follow_the_load_and_agree_with_get_server_info(serving: Any) -> None:
    flags = ("--metrics-port", "0", "--max-num-seqs", "2", "--max-model-len", "2048",
             "--num-gpu-blocks-override", "512")  # fmt: skip

    async def main() -> dict[str, Any]:
        async with serving(*flags) as served, grpc.aio.insecure_channel(served.target) as chan:
            generation, control = stubs(chan)
            port = served.metrics_port
            idle = await scrape(port)
            # two long requests run (max_num_seqs 2), two wait behind them
            ids = [f"long-{i}" for i in range(4)]
            calls = [
                generation.GenerateStream(greedy_request(prompt(i), None, request_id=request_id))
                for i, request_id in enumerate(ids)
            ]
            heads = [await read_until(call, "accepted") for call in calls]
            await wait_for_load(control, running=2, waiting=2)
            await wait_for_first_step(port)  # the token counter moves under load
            before = (await control.GetServerInfo(INFO)).load
            during = await scrape(port)
            after = (await control.GetServerInfo(INFO)).load
            await control.Abort(cpb.AbortRequest(request_ids=ids))
            longs = [h + await read_rest(call) for h, call in zip(heads, calls)]
            shorts = await asyncio.gather(
                *(read_rest(generation.GenerateStream(greedy_request(prompt(10 + i), 8)))
                  for i in range(12))
            )  # fmt: skip
            return {
                "idle": idle, "before": before, "during": during, "after": after,
                "longs": longs, "shorts": shorts, "final": await scrape(port),
                "info": (await control.GetServerInfo(INFO)).load,
            }  # fmt: skip

    r = asyncio.run(main())
    idle, during, final, before, after = r["idle"], r["during"], r["final"], r["before"], r["after"]
    assert value(idle, "asyncengine_requests_running") == 0
    assert value(idle, "asyncengine_generation_tokens_total") == 0
    # gauges during the load, between two GetServerInfo calls
    for state in ("running", "waiting", "swapped"):
        gauge = value(during, f"asyncengine_requests_{state}")
        assert getattr(before, state) == gauge == getattr(after, state), state
    usage = value(during, "asyncengine_block_usage_ratio", pool="gpu")
    assert 0 < before.block_usage_ratio <= usage <= after.block_usage_ratio  # decodes only grow
    assert value(during, "asyncengine_kv_blocks", pool="gpu") == before.gpu_blocks_total == 512
    # the counters once everything ended: 4 cancelled (2 never ran), 12 finished by length
    longs, shorts, info = r["longs"], r["shorts"], r["info"]
    assert all(s[-2].finished.reason == pb.LENGTH for s in shorts)
    assert all(s[-2].finished.reason == pb.CANCELLED for s in longs)
    num_ran = sum(usage_of(s).completion_tokens > 0 for s in longs)
    assert num_ran == 2
    completion = sum(usage_of(s).completion_tokens for s in longs + shorts)
    generated = value(final, "asyncengine_generation_tokens_total")
    # a token sampled for a request aborted while its step ran counts but is never sent
    assert completion <= generated <= completion + len(longs)
    assert value(final, "asyncengine_prompt_tokens_total") == PROMPT_LEN * (num_ran + 12)
    finished = {
        reason: value(final, "asyncengine_requests_finished_total", reason=reason)
        for reason in ("stop", "length", "cancelled", "deadline", "aborted", "error")
    }
    assert finished == {"stop": 0, "length": 12, "cancelled": 4, "deadline": 0, "aborted": 0,
                        "error": 0}  # fmt: skip
    assert count(final, "time_to_first_token_seconds") == num_ran + 12
    assert count(final, "request_queue_time_seconds") == num_ran + 12
    assert count(final, "e2e_request_latency_seconds") == 12
    assert count(final, "inter_token_latency_seconds") == 12
    num_steps = count(final, "step_forward_seconds")
    assert num_steps == count(final, "step_schedule_seconds") == count(final, "step_update_seconds")
    assert num_steps >= 8 and value(final, "asyncengine_step_forward_seconds_sum") > 0
    queries = value(final, "asyncengine_prefix_cache_queries_total")
    assert queries >= PROMPT_LEN * (num_ran + 12)
    assert 0 <= value(final, "asyncengine_prefix_cache_hits_total") <= queries
    # and idle again: the same zeros in both views
    assert value(final, "asyncengine_requests_running") == info.running == 0
    assert value(final, "asyncengine_block_usage_ratio", pool="gpu") == info.block_usage_ratio == 0


def test_preemption_and_swap_counters_match_get_server_info(serving: Any) -> None:
    """Three requests of 5 blocks each in a 10-block cache: someone is swapped out."""
    flags = ("--metrics-port", "0", "--max-num-seqs", "4", "--num-gpu-blocks-override", "10",
             "--preemption-mode", "swap")  # fmt: skip

    async def main() -> tuple[list[Any], Samples, Any]:
        async with serving(*flags) as served, grpc.aio.insecure_channel(served.target) as chan:
            generation, control = stubs(chan)
            ends = await asyncio.gather(
                *(read_rest(generation.GenerateStream(greedy_request(prompt(i) * 2, 60)))
                  for i in range(3))
            )  # fmt: skip
            return ends, await scrape(served.metrics_port), await control.GetServerInfo(INFO)

    ends, final, info = asyncio.run(main())
    assert all(e[-2].finished.reason == pb.LENGTH for e in ends)
    load = info.load
    assert load.preemptions_swap > 0
    preempted = value(final, "asyncengine_preemptions_total", mode="swap")
    assert preempted == load.preemptions_swap
    assert value(final, "asyncengine_preemptions_total", mode="recompute") == (
        load.preemptions_recompute
    )
    out = value(final, "asyncengine_swapped_blocks_total", direction="out")
    back_in = value(final, "asyncengine_swapped_blocks_total", direction="in")
    assert out >= preempted and 0 < back_in <= out
    assert value(final, "asyncengine_block_usage_ratio", pool="cpu") == 0
    assert value(final, "asyncengine_kv_blocks", pool="cpu") == load.cpu_blocks_total == 16
    assert sum(usage_of(e).preemptions for e in ends) == preempted + load.preemptions_recompute


def test_requests_the_server_ended_are_counted_and_finished_by_why(serving: Any) -> None:
    """Control.Abort: cancelled; a time limit, of a stream or of a batch: deadline; a drain:
    aborted. Each request's Finished (or batch result) names the same reason."""
    flags = ("--metrics-port", "0", "--max-num-seqs", "8")
    time_limited = pb.StoppingOptions(ignore_eos=True, time_limit_ms=100)

    async def main() -> tuple[list[Any], Any, int, Samples]:
        async with serving(*flags) as served, grpc.aio.insecure_channel(served.target) as chan:
            generation, control = stubs(chan)
            # unlimited but for the server: each would run to the end of the context
            aborted = generation.GenerateStream(greedy_request(prompt(0), None, request_id="a"))
            await read_until(aborted, "delta")
            await control.Abort(cpb.AbortRequest(request_ids=["a"]))
            ends = [await read_rest(aborted)]
            timed = greedy_request(prompt(1), None)
            timed.stopping.CopyFrom(time_limited)
            ends.append(await read_rest(generation.GenerateStream(timed)))
            batch = await generation.Generate(
                pb.GenerateBatchRequest(
                    prompts=[pb.Prompt(token_ids=pb.TokenIds(ids=prompt(i))) for i in (2, 3)],
                    sampling=pb.SamplingOptions(temperature=0.0),
                    stopping=time_limited,
                )
            )
            drained = generation.GenerateStream(greedy_request(prompt(4), None))
            await read_until(drained, "delta")
            num_drained = (await control.Drain(cpb.DrainRequest(grace_period_ms=50))).aborted
            ends.append(await read_rest(drained))
            return ends, batch, num_drained, await scrape(served.metrics_port)

    (aborted, timed, drained), batch, num_drained, final = asyncio.run(main())
    assert aborted[-2].finished.reason == pb.CANCELLED
    assert timed[-2].finished.reason == pb.TIME_LIMIT
    assert [r.finish_reason for r in batch.results] == [pb.TIME_LIMIT] * 2
    assert all(0 < r.usage.completion_tokens < 1000 for r in batch.results)
    assert drained[-2].finished.reason == pb.ABORTED_BY_SERVER and num_drained == 1
    finished = {
        reason: value(final, "asyncengine_requests_finished_total", reason=reason)
        for reason in ("stop", "length", "cancelled", "deadline", "aborted", "error")
    }
    assert finished == {"stop": 0, "length": 0, "cancelled": 1, "deadline": 3, "aborted": 1,
                        "error": 0}  # fmt: skip
