"""A burst of streams opened at once ends each one by admission, never by gRPC (issue 24).

2,000 GenerateStream calls at once, over 8 connections, against an admission limit of 288:
each ends OK or RESOURCE_EXHAUSTED with a retry delay, none CANCELLED (gRPC-core's default
backlog limit cancelled ~10% of such a burst before the server saw them), and no refusal counts
more admitted requests than the limit. A canary in a process of its own, on its own
connection, makes calls throughout: each ends OK, or is refused by admission and retried.
The same holds while a third process floods the server with streams it opens and cancels.
"""

from __future__ import annotations

import asyncio
import collections
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2

from .utils import ServerProcess, detail, greedy_request, stubs

MAX_NUM_SEQS, MAX_QUEUED = 32, 256
BURST_FLAGS = (
    "--max-num-seqs", str(MAX_NUM_SEQS), "--max-queued-requests", str(MAX_QUEUED),
    "--num-gpu-blocks-override", "512", "--num-cpu-blocks-override", "64",
)  # fmt: skip
NUM_STREAMS, NUM_CHANNELS = 2000, 8
# its own connection: channels of one process share connections unless told not to
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
REFUSAL = re.compile(r"(\d+) requests admitted; the limit is (\d+)")

# the canary: `sys.argv[2]` loops of short calls, one after another, until its stdin closes
# and each loop's last call ended OK (a refusal while admission is full is a documented limit:
# it retries); prints its status counts
CANARY = f"""
import asyncio, collections, json, sys, grpc
from asyncengine.v1 import generation_pb2 as pb, generation_pb2_grpc
async def calls(stub, codes, stop):
    is_ok = False
    while not (stop.done() and is_ok):
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[5, 6]),
            stopping=pb.StoppingOptions(max_new_tokens=4, ignore_eos=True),
        )
        try:
            async for _ in stub.GenerateStream(request, timeout=60):
                pass
            codes["OK"] += 1
            is_ok = True
        except grpc.aio.AioRpcError as error:
            codes[error.code().name] += 1
            is_ok = False
            await asyncio.sleep(0.05)
async def main():
    codes = collections.Counter()
    stop = asyncio.ensure_future(asyncio.to_thread(sys.stdin.read))
    async with grpc.aio.insecure_channel(sys.argv[1], options={OWN_CONNECTION!r}) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        first = asyncio.get_running_loop().create_future()
        first.set_result(None)
        await calls(stub, codes, first)  # until one ended OK
        print("ready", flush=True)
        await asyncio.gather(*(calls(stub, codes, stop) for _ in range(int(sys.argv[2]))))
    print(json.dumps(codes), flush=True)
asyncio.run(main())
"""
# the flood: batches of streams opened and cancelled at once, for `sys.argv[2]` seconds, over
# 4 connections; prints how many
FLOOD = f"""
import asyncio, sys, time, grpc
from asyncengine.v1 import generation_pb2 as pb, generation_pb2_grpc
async def main():
    options = {OWN_CONNECTION!r}
    channels = [grpc.aio.insecure_channel(sys.argv[1], options=options) for _ in range(4)]
    stubs = [generation_pb2_grpc.GenerationStub(channel) for channel in channels]
    request = pb.GenerateRequest(
        text="a flood", stopping=pb.StoppingOptions(max_new_tokens=50, ignore_eos=True)
    )
    num_calls, end = 0, time.monotonic() + float(sys.argv[2])
    while time.monotonic() < end:
        calls = [stubs[i % 4].GenerateStream(request) for i in range(1500)]
        await asyncio.sleep(0)  # their headers go out
        for call in calls:
            call.cancel()
        num_calls += len(calls)
        await asyncio.sleep(0.01)
    print(num_calls, flush=True)
asyncio.run(main())
"""


@pytest.fixture(scope="module")
def burst_server(
    model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    log_path = tmp_path_factory.mktemp("server-burst") / "server.log"
    server = ServerProcess(model_dir("llama"), log_path, *BURST_FLAGS)
    try:
        server.wait_serving(timeout=300)
        yield server
    finally:
        server.stop()


async def _one(
    generation: Any, index: int, ends: collections.Counter[str], over: list[str]
) -> None:
    try:
        async for _ in generation.GenerateStream(
            greedy_request(f"a burst of streams, {index}", 64)
        ):
            pass
        ends["OK"] += 1
    except grpc.aio.AioRpcError as error:
        ends[error.code().name] += 1
        if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            assert detail(error, error_details_pb2.RetryInfo).retry_delay.ToMilliseconds() > 0
            match = REFUSAL.match(error.details() or "")
            if match and int(match[1]) > int(match[2]):
                over.append(error.details() or "")


async def _burst(target: str) -> tuple[collections.Counter[str], list[str]]:
    ends: collections.Counter[str] = collections.Counter()
    over: list[str] = []
    channels = [grpc.aio.insecure_channel(target, options=OWN_CONNECTION) for _ in range(8)]
    try:
        generations = [stubs(channel)[0] for channel in channels]
        await asyncio.gather(
            *(_one(generations[i % NUM_CHANNELS], i, ends, over) for i in range(NUM_STREAMS))
        )
    finally:
        for channel in channels:
            await channel.close()
    return ends, over


def test_a_burst_of_2000_streams_ends_each_by_admission_and_spares_a_canary(
    burst_server: ServerProcess,
) -> None:
    async def main() -> tuple[collections.Counter[str], list[str], dict[str, int]]:
        canary = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CANARY, burst_server.target, "1",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            await _ready(canary)
            ends, over = await asyncio.wait_for(_burst(burst_server.target), 120)
            return ends, over, await _codes(canary)
        finally:
            await _reap(canary)

    ends, over, canary_codes = asyncio.run(main())
    assert set(ends) <= {"OK", "RESOURCE_EXHAUSTED"}, ends  # never CANCELLED nor anything else
    assert ends["OK"] >= MAX_NUM_SEQS + MAX_QUEUED and ends["RESOURCE_EXHAUSTED"] > 0, ends
    assert not over, over[:3]  # the admitted count never passes its limit
    # it ended OK (its last call) and nothing but admission ever refused it
    assert set(canary_codes) <= {"OK", "RESOURCE_EXHAUSTED"}, canary_codes


def test_a_flood_of_cancelled_streams_cancels_no_other_client_s_calls(
    burst_server: ServerProcess,
) -> None:
    """A third process opens and cancels streams, 1,500 at a time, for 8 s, while a canary's
    20 loops make calls (before the fix 74 of 523 canary calls ended CANCELLED: gRPC's
    backlog was full of the flood's)."""

    async def main() -> dict[str, int]:
        canary = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CANARY, burst_server.target, "20",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        flood = None
        try:
            await _ready(canary)
            flood = await asyncio.create_subprocess_exec(
                sys.executable, "-c", FLOOD, burst_server.target, "8",
                stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
            assert flood.stdout is not None
            assert int(await asyncio.wait_for(flood.stdout.readline(), 60)) > 1000
            return await _codes(canary)
        finally:
            await _reap(canary)
            if flood is not None:
                await _reap(flood)

    canary_codes = asyncio.run(main())
    assert canary_codes.get("OK", 0) >= 10, canary_codes
    assert set(canary_codes) <= {"OK", "RESOURCE_EXHAUSTED"}, canary_codes


async def _ready(canary: asyncio.subprocess.Process) -> None:
    assert canary.stdout is not None
    assert await asyncio.wait_for(canary.stdout.readline(), 60) == b"ready\n"


async def _codes(canary: asyncio.subprocess.Process) -> dict[str, int]:
    """Stop the canary; the status counts of its calls."""
    assert canary.stdin is not None and canary.stdout is not None
    canary.stdin.close()
    counts: dict[str, int] = json.loads(await asyncio.wait_for(canary.stdout.readline(), 60))
    return counts


async def _reap(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.kill()
    await process.wait()
