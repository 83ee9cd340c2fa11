"""`asyncengine serve --tensor-parallel-size 2`: a worker killed mid-stream ends every stream
with ENGINE_DEAD, health NOT_SERVING and a non-zero exit; SIGTERM and Ctrl-C leave no worker.

The three servers start together (each is mostly import time, twice: server and worker).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .utils import (
    NOT_SERVING,
    SERVING,
    ServerProcess,
    check_stream_shape,
    detail,
    events,
    greedy_request,
    read_rest,
    read_until,
    stubs,
)

TP_FLAGS = (
    "--tensor-parallel-size", "2", "--max-num-seqs", "2", "--num-gpu-blocks-override", "256",
    "--num-cpu-blocks-override", "16", "--drain-grace-period", "1.0",
)  # fmt: skip
ENDINGS = ("killed-worker", "idle-killed-worker", "sigterm", "ctrl-c")


@pytest.fixture(scope="module")
def tp_servers(
    model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ServerProcess]]:
    path = model_dir("llama")
    servers = {}
    for ending in ENDINGS:
        log_path = tmp_path_factory.mktemp(f"tp-server-{ending}") / "server.log"
        # in its own process group, as a terminal's foreground job (Ctrl-C signals the group)
        servers[ending] = ServerProcess(path, log_path, *TP_FLAGS)
    yield servers
    for server in servers.values():
        server.kill()


def worker_pids(server: ServerProcess) -> list[int]:
    server.wait_serving()
    (started,) = [r for r in server.log_records() if r["event"] == "tensor_parallel_started"]
    return list(started["worker_pids"])


def is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(map(is_running, pids)):
        time.sleep(0.05)
    return [pid for pid in pids if is_running(pid)]


def test_a_killed_worker_fails_every_stream_and_the_server_exits_non_zero(
    tp_servers: dict[str, ServerProcess],
) -> None:
    server = tp_servers["killed-worker"]
    (pid,) = worker_pids(server)

    async def main() -> tuple[Any, ...]:
        async with server.aio_channel() as channel:
            generation, _ = stubs(channel)
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == SERVING
            calls = [
                generation.GenerateStream(greedy_request([5, 6 + i], None), timeout=60)
                for i in range(2)
            ]
            heads = [await read_until(call, "delta") for call in calls]
            os.kill(pid, signal.SIGKILL)
            errors = []
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await read_rest(call)
                errors.append(failed.value)
            status = (await watch.read()).status
            return heads, errors, status

    heads, errors, status = asyncio.run(asyncio.wait_for(main(), 60))
    assert all(events(head)[-1] == "delta" for head in heads)
    for error in errors:
        assert error.code() == grpc.StatusCode.UNAVAILABLE  # partial output, then it died
        assert detail(error, error_details_pb2.ErrorInfo).reason == "ENGINE_DEAD"
    assert status == NOT_SERVING
    assert server.proc.wait(timeout=30) != 0
    records = server.log_records()
    (dead,) = [r for r in records if r["event"] == "engine_dead"]
    assert "tensor parallelism failed" in dead["cause"]
    assert wait_gone([pid]) == []


def test_a_worker_killed_while_nothing_runs_turns_health_not_serving(
    tp_servers: dict[str, ServerProcess],
) -> None:
    """The engine process checks its workers while idle too: health says the engine is dead
    without a request having to find out."""
    server = tp_servers["idle-killed-worker"]
    (pid,) = worker_pids(server)

    async def main() -> Any:
        async with server.aio_channel() as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == SERVING
            os.kill(pid, signal.SIGKILL)
            return (await watch.read()).status

    status = asyncio.run(asyncio.wait_for(main(), 30))
    assert status == NOT_SERVING
    assert server.proc.wait(timeout=30) != 0
    assert wait_gone([pid]) == []


@pytest.mark.parametrize("ending", ["sigterm", "ctrl-c"])
def test_sigterm_and_ctrl_c_drain_exit_zero_and_leave_no_worker(
    ending: str, tp_servers: dict[str, ServerProcess]
) -> None:
    server = tp_servers[ending]
    pids = worker_pids(server)
    with server.channel() as channel:
        generation, _ = stubs(channel)
        responses = list(generation.GenerateStream(greedy_request([5, 6], 4), timeout=60))
        check_stream_shape(responses)
        assert responses[-1].usage.completion_tokens == 4
    if ending == "sigterm":
        server.proc.send_signal(signal.SIGTERM)  # a supervisor signals the server alone
    else:
        os.killpg(server.proc.pid, signal.SIGINT)  # a terminal signals the whole group
    assert server.proc.wait(timeout=60) == 0, server.log()[-4000:]
    assert wait_gone(pids) == [], f"orphaned workers {pids} after {ending}"
