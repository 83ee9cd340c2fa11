"""Scale-out: three replicas behind one client channel with grpc's round_robin policy and
grpc.health.v1 health checking. One replica drains mid-run; no request is lost and the rest of
the load goes to the two live replicas only.

The replicas are in-process servers with the fake runner (scripted tokens): what is under test
is the server, the balancing and the drain, and engines in one process cannot run forwards
concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import grpc
from asyncengine_client import AsyncClient, Finished, FinishReason, Usage
from grpc_health.v1 import health_pb2, health_pb2_grpc

from asyncengine.server.state import LIVENESS_SERVICE
from asyncengine.v1 import control_pb2 as cpb

from .conftest import Served, scrape, value
from .utils import stubs

NUM_REQUESTS = 90
DRAIN_AFTER = 30  # completed requests before replica 0 drains
CONCURRENCY = 6
MAX_NEW_TOKENS = 6


async def finished_count(served: Served) -> int:
    samples = await scrape(served.metrics_port)
    return int(value(samples, "asyncengine_requests_finished_total", reason="length"))


async def run_load(replicas: list[Served]) -> dict[str, Any]:
    done: list[tuple[FinishReason, int]] = []
    counts_at_drain: list[int] = []
    health_after_drain: dict[str, int] = {}
    next_index = iter(range(NUM_REQUESTS))

    async def drain_first() -> None:
        async with grpc.aio.insecure_channel(replicas[0].target) as chan:
            # returns once replica 0 is idle: its in-flight requests finished in the grace
            await stubs(chan)[1].Drain(cpb.DrainRequest(grace_period_ms=10_000))
            health = health_pb2_grpc.HealthStub(chan)
            for service in ("", LIVENESS_SERVICE):
                request = health_pb2.HealthCheckRequest(service=service)
                health_after_drain[service] = (await health.Check(request)).status
        counts_at_drain.extend([await finished_count(r) for r in replicas])

    async with AsyncClient([r.target for r in replicas], timeout=60) as client:
        # calls go only to replicas whose channel is up and healthy: wait for all three
        while not all([await finished_count(r) for r in replicas]):
            await worker(client, -1, done)
        warmup = len(done)
        counts_at_start = [await finished_count(r) for r in replicas]
        drain_task: asyncio.Task[None] | None = None

        async def loop() -> None:
            nonlocal drain_task
            for i in next_index:
                if i == DRAIN_AFTER and drain_task is None:
                    drain_task = asyncio.create_task(drain_first())
                await worker(client, i, done)

        await asyncio.gather(*(loop() for _ in range(CONCURRENCY)))
        assert drain_task is not None
        await drain_task
        final = [await finished_count(r) for r in replicas]
    return {
        "done": done[warmup:],
        "at_start": counts_at_start,
        "at_drain": counts_at_drain,
        "final": final,
        "health_after_drain": health_after_drain,
    }


async def worker(client: AsyncClient, i: int, done: list[tuple[FinishReason, int]]) -> None:
    """Stream one request to its end; record its finish reason and completion tokens."""
    reason, tokens = FinishReason.UNSPECIFIED, -1
    stream = client.generate_stream(
        [5, 6 + i % 300, 7], max_new_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True
    )
    async with contextlib.aclosing(stream) as events:
        async for event in events:
            if isinstance(event, Finished):
                reason = event.reason
            elif isinstance(event, Usage):
                tokens = event.completion_tokens
    done.append((reason, tokens))


def test_round_robin_spreads_load_and_a_drained_replica_gets_none(serving: Any) -> None:
    flags = ("--metrics-port", "0", "--max-num-seqs", "8", "--num-gpu-blocks-override", "256")

    async def main() -> dict[str, Any]:
        async with contextlib.AsyncExitStack() as stack:
            replicas = [
                await stack.enter_async_context(serving(*flags, fake_runner=True)) for _ in range(3)
            ]
            return await run_load(replicas)

    r = asyncio.run(main())
    # every request completed, exactly once, in full
    assert len(r["done"]) == NUM_REQUESTS
    assert set(r["done"]) == {(FinishReason.LENGTH, MAX_NEW_TOKENS)}
    at_start, at_drain, final = r["at_start"], r["at_drain"], r["final"]
    counts = (at_start, at_drain, final)
    assert sum(final) - sum(at_start) == NUM_REQUESTS
    # before the drain every replica took a share (round-robin: about a third each)
    before = [d - s for d, s in zip(at_drain, at_start)]
    assert min(before) >= 0.15 * sum(before), counts
    # readiness follows the drain, liveness does not (a probe must not kill a draining pod)
    assert r["health_after_drain"] == {
        "": health_pb2.HealthCheckResponse.NOT_SERVING,
        LIVENESS_SERVICE: health_pb2.HealthCheckResponse.SERVING,
    }
    # the drained replica took nothing after its drain; the two live ones shared the rest
    assert final[0] == at_drain[0], counts
    after = [f - d for f, d in zip(final[1:], at_drain[1:])]
    assert sum(after) >= NUM_REQUESTS // 4 and min(after) >= 0.3 * sum(after), counts
