"""The soak's phases that a canary stream watches: hostile requests, big bodies and a burst.

soak.py runs them against its server; each returns what the canary saw (its normal gap, its
worst gap while the phase ran, its errors) and what the phase's own requests ended with.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import string
import sys
import time
from collections import Counter
from typing import Any

import big_bodies  # beside this file: soak.py runs as a script, so benchmarks/ is on the path
import grpc

from asyncengine.v1 import generation_pb2 as pb
from asyncengine.v1 import generation_pb2_grpc

STREAM_METHOD = "/asyncengine.v1.Generation/GenerateStream"


def words(rng: random.Random, num: int) -> str:
    vocab = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(500)]
    return " ".join(rng.choices(vocab, k=num))


# -- the canary and the hostile requests ------------------------------------------------------


class Canary:
    """Greedy streams one after another; the arrival time of every message."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.starts: set[int] = set()  # indexes in `times` of each stream's first message
        # ... of each message up to and including its stream's first token: the gaps before
        # them are the wait in admission's queue (behind --max-queued-requests others), a
        # documented limit and not a stall. A wait past --heartbeat-interval has a Heartbeat
        # in it, so the wait is more than the one gap before the first token
        self.queued: set[int] = set()
        self.first_tokens: dict[int, int] = {}  # each stream's first token -> its first message
        self.errors: Counter[str] = Counter()
        self.stop = asyncio.Event()

    async def run(self, target: str, num_tokens: int) -> None:
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=list(range(3, 19))),
            sampling=pb.SamplingOptions(temperature=0.0),
            stopping=pb.StoppingOptions(max_new_tokens=num_tokens, ignore_eos=True),
        )
        async with grpc.aio.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            while not self.stop.is_set():
                call = stub.GenerateStream(request, timeout=600)
                start = len(self.times)
                self.starts.add(start)
                has_token = False
                try:
                    while (message := await call.read()) is not grpc.aio.EOF:
                        if not has_token:
                            self.queued.add(len(self.times))
                            if message.WhichOneof("event") == "delta":
                                has_token = True
                                self.first_tokens[len(self.times)] = start
                        self.times.append(time.perf_counter())
                        if self.stop.is_set():
                            call.cancel()
                            break
                except grpc.aio.AioRpcError as exc:
                    self.errors[exc.code().name] += 1
                    await asyncio.sleep(0.05)  # refused while admission is full: retry, not spin

    def gaps(self, start: float, end: float, within_streams: bool = False) -> list[float]:
        """Gaps between messages that overlap [start, end] (the one spanning `end` included);
        `within_streams` leaves out those between one stream's end and the next's start (where
        admission may refuse the canary for a while: a documented limit, not a stall) and those
        up to each stream's first token (its wait in admission's queue)."""
        return [b - a for a, b in self.spans(start, end, within_streams)]

    def spans(self, start: float, end: float, within_streams: bool = False) -> list[tuple]:
        """(from, to) of each gap of `gaps`."""
        pairs = zip(range(1, len(self.times)), self.times, self.times[1:])
        skip = self.starts | self.queued if within_streams else set()
        spans = [(a, b) for i, a, b in pairs if b >= start and a <= end and i not in skip]
        if self.times and self.times[-1] < end:
            spans.append((self.times[-1], end))  # still silent when the window closed
        return spans


async def send_raw(channel: grpc.aio.Channel, payload: bytes, timeout_s: float) -> dict[str, Any]:
    """Send pre-serialized GenerateRequest bytes (so serializing is not timed); status and time."""
    method = channel.unary_stream(STREAM_METHOD)
    started = time.perf_counter()
    status, num_messages = "OK", 0
    try:
        async for _ in method(payload, timeout=timeout_s):
            num_messages += 1
    except grpc.aio.AioRpcError as exc:
        status = exc.code().name
    ended = time.perf_counter()
    return {"status": status, "latency_s": ended - started, "messages": num_messages,
            "bytes": len(payload), "window": (started, ended)}  # fmt: skip


def hostile_payloads(ns: argparse.Namespace) -> dict[str, bytes]:
    text = words(random.Random(ns.seed), (8 << 20) // 5)[: 8 << 20]
    big = pb.GenerateRequest(text=text, stopping=pb.StoppingOptions(max_new_tokens=16))
    stops = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=list(range(3, 19))),
        stopping=pb.StoppingOptions(max_new_tokens=16, ignore_eos=True),
    )
    stops.stopping.stop.extend(f"stop{i}" for i in range(ns.num_stops))
    return {"big_prompt": big.SerializeToString(), "many_stops": stops.SerializeToString()}


async def hostile_phase(target: str, ns: argparse.Namespace) -> dict[str, Any]:
    """The canary's gaps while each hostile request is refused (or, today, served)."""
    payloads = hostile_payloads(ns)
    canary = Canary()
    task = asyncio.create_task(canary.run(target, ns.canary_tokens))
    await asyncio.sleep(ns.canary_warmup)
    normal_from = time.perf_counter() - ns.canary_warmup / 2
    results = {}
    async with grpc.aio.insecure_channel(target) as channel:
        for name, payload in payloads.items():
            what = "8 MiB text prompt" if name == "big_prompt" else f"{ns.num_stops:,} stop strings"
            results[name] = {"what": what, **await send_raw(channel, payload, ns.hostile_timeout)}
            await asyncio.sleep(1.0)
    canary.stop.set()
    await task
    first = min(r["window"][0] for r in results.values())
    normal = canary.gaps(normal_from, first)
    normal_ms = statistics.median(normal) * 1000 if normal else float("nan")
    for result in results.values():
        worst_ms = max(canary.gaps(*result.pop("window")), default=float("nan")) * 1000
        result.update(latency_ms=round(result.pop("latency_s") * 1000, 1),
                      canary_worst_gap_ms=round(worst_ms, 1),
                      canary_excess_ms=round(worst_ms - normal_ms, 1))  # fmt: skip
    return {"canary_gap_p50_ms": round(normal_ms, 2),
            "canary_gap_max_normal_ms": round(max(normal, default=0) * 1000, 1),
            "canary_messages": len(canary.times), "canary_errors": dict(canary.errors),
            "requests": results}  # fmt: skip


def gap_figures(canary: Canary, normal: tuple[float, float], during: tuple[float, float]) -> dict:
    """The canary's median gap over `normal`, its worst within a stream over `during` and the
    difference (ms), its worst gap counting those between streams (admission's refusals),
    and its longest wait for a first token (in admission's queue, left out of the first)."""
    normal_gaps = canary.gaps(*normal, within_streams=True)
    normal_ms = statistics.median(normal_gaps) * 1000 if normal_gaps else float("nan")
    worst_ms = max(canary.gaps(*during, within_streams=True), default=float("nan")) * 1000
    any_ms = max(canary.gaps(*during), default=float("nan")) * 1000
    # the canary's waits for its first token (in admission's queue) that ended in the phase,
    # from its stream's first message (Accepted)
    times = canary.times
    waits = [times[i] - times[start] for i, start in canary.first_tokens.items()
             if during[0] <= times[i] <= during[1]]  # fmt: skip
    # when the worst gap began, from the phase's start (at once: the requests' arrival)
    spans = canary.spans(*during, within_streams=True)
    worst_at_s = max(spans, key=lambda ab: ab[1] - ab[0], default=during)[0] - during[0]
    return {"canary_gap_p50_ms": round(normal_ms, 2), "canary_worst_gap_ms": round(worst_ms, 1),
            "canary_excess_ms": round(worst_ms - normal_ms, 1),
            "canary_worst_gap_at_s": round(worst_at_s, 2),
            "canary_worst_gap_across_streams_ms": round(any_ms, 1),
            "canary_first_token_wait_ms": round(max(waits, default=0) * 1000, 1)}  # fmt: skip


# -- big bodies (benchmarks/big_bodies.py sends each from a process of its own) ---------------


async def big_body_phase(
    target: str, http: str, names: list[str], canary_tokens: int
) -> dict[str, Any]:
    """Each of issue 24's big bodies, one after another: its status, and the worst gap of
    big_bodies' canary while it was sent, read and refused, beyond the canary's median gap."""
    results = {}
    for name in names:
        row = await big_bodies.measure(name, target, http, canary_tokens)
        worst_ms, normal_ms = row["worst_gap_s"] * 1000, row["median_gap_s"] * 1000
        results[name] = {"status": row["status"], "took_s": round(row["took_s"], 2),
                         "canary_gap_p50_ms": round(normal_ms, 2),
                         "canary_worst_gap_ms": round(worst_ms, 1),
                         "canary_excess_ms": round(worst_ms - normal_ms, 1)}  # fmt: skip
    return results


# -- a burst of streams opened at once (tests/server/test_burst.py's, from a child) -----------

# opens argv[2] streams at once over argv[3] connections of its own and prints, as JSON, how
# each ended and every refusal that counted more admitted requests than its limit; it runs in a
# process of its own so that the canary's gaps are the server's, not this client's
BURST = r"""
import asyncio, collections, json, re, sys, grpc
from asyncengine.v1 import generation_pb2 as pb, generation_pb2_grpc
REFUSAL = re.compile(r"(\d+) requests admitted; the limit is (\d+)")
async def one(stub, index, ends, over, details):
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[5 + index % 50, 6, 7, 8]),
        sampling=pb.SamplingOptions(temperature=0.0),
        stopping=pb.StoppingOptions(max_new_tokens=int(sys.argv[4]), ignore_eos=True),
    )
    try:
        async for _ in stub.GenerateStream(request, timeout=120):
            pass
        ends["OK"] += 1
    except grpc.aio.AioRpcError as error:
        ends[error.code().name] += 1
        match = REFUSAL.match(error.details() or "")
        if match and int(match[1]) > int(match[2]):
            over.append(error.details())
        elif error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            details[f"{error.code().name}: {error.details()}"[:120]] += 1
async def main(target, num_streams, num_channels):
    options = [("grpc.use_local_subchannel_pool", 1)]  # a connection each
    channels = [grpc.aio.insecure_channel(target, options=options) for _ in range(num_channels)]
    stubs = [generation_pb2_grpc.GenerationStub(channel) for channel in channels]
    ends, over, details = collections.Counter(), [], collections.Counter()
    print("sending", flush=True)
    await asyncio.gather(*(one(stubs[i % num_channels], i, ends, over, details)
                           for i in range(num_streams)))
    for channel in channels:
        await channel.close()
    print(json.dumps({"ends": ends, "over_limit": over, "other": details}), flush=True)
asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""


async def burst_phase(target: str, ns: argparse.Namespace) -> dict[str, Any]:
    """`--burst-streams` streams opened at once by a child while the canary streams here: how
    each ended (OK / RESOURCE_EXHAUSTED expected; CANCELLED never), refusals over the limit,
    and the canary's errors and worst gap."""
    canary = Canary()
    task = asyncio.create_task(canary.run(target, ns.canary_tokens))
    await asyncio.sleep(ns.canary_warmup)
    normal = (time.perf_counter() - ns.canary_warmup / 2, time.perf_counter())
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", BURST, target, str(ns.burst_streams), str(ns.burst_channels),
        str(ns.burst_tokens), stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    await asyncio.wait_for(proc.stdout.readline(), 60)  # imported: the burst starts now
    started = time.perf_counter()
    out, _ = await asyncio.wait_for(proc.communicate(), ns.burst_timeout)
    during = (started, time.perf_counter())
    await asyncio.sleep(0.3)  # the canary streams on past the burst
    canary.stop.set()
    await task
    result = json.loads(out)
    ends = Counter(result["ends"])
    return {"streams": ns.burst_streams, "wall_s": round(during[1] - during[0], 1),
            "ok": ends.pop("OK", 0), "resource_exhausted": ends.pop("RESOURCE_EXHAUSTED", 0),
            "cancelled": ends.pop("CANCELLED", 0), "other": dict(ends),
            "other_details": result["other"], "over_limit": result["over_limit"][:3],
            "num_over_limit": len(result["over_limit"]), "canary_errors": dict(canary.errors),
            **gap_figures(canary, normal, during)}  # fmt: skip
