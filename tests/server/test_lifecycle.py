"""An engine fault turns health NOT_SERVING, fails the open streams and exits non-zero.

(SIGTERM, which drains and exits 0, is the last test of test_generation.py.)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time
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
    _serve_command,
    detail,
    events,
    greedy_request,
    read_rest,
    read_until,
    stubs,
)


def test_engine_fault_turns_health_not_serving_and_exits_non_zero(server_pool: Any) -> None:
    server = server_pool["fault"]  # ASYNCENGINE_FAULT_AFTER_STEPS=150, max-num-seqs 1

    async def main() -> tuple[Any, ...]:
        async with server.aio_channel() as channel:
            generation, _ = stubs(channel)
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == SERVING
            # the second request waits behind the first: it has no output when the fault hits
            running = generation.GenerateStream(greedy_request([5, 6], None), timeout=60)
            head = await read_until(running, "delta")
            queued = generation.GenerateStream(greedy_request([5, 7], None), timeout=60)
            queued_head = await read_until(queued, "accepted")
            errors = []
            for call in (running, queued):
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await read_rest(call)
                errors.append(failed.value)
            status = (await watch.read()).status
            return head, queued_head, errors, status

    head, queued_head, (running_error, queued_error), status = asyncio.run(main())
    assert events(head)[-1] == "delta" and events(queued_head) == ["accepted"]
    # UNAVAILABLE either way (what retry-aware clients treat as transient); the detail says
    # whether output was already sent
    for error, partial in ((running_error, "true"), (queued_error, "false")):
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        info = detail(error, error_details_pb2.ErrorInfo)
        assert info.reason == "ENGINE_DEAD" and info.metadata["has_partial_output"] == partial
        assert (error.details() or "").startswith("the engine is dead: the engine stopped")
        # the same words for every stream: the cause (which may hold a request's values) is
        # in the server's log only
        assert "injected fault" not in (error.details() or "")
    assert status == NOT_SERVING  # said by the live server, before it exits
    assert server.proc.wait(timeout=30) != 0
    (dead,) = [r for r in server.log_records() if r["event"] == "engine_dead"]
    assert "injected fault" in dead["cause"]
    assert "request_id" not in dead  # the step loop does not log in a request's context


def test_serve_on_a_port_in_use_says_so_in_one_line_before_loading(model_dir: Any) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [
            *_serve_command(), "--model", str(model_dir("llama")), "--host", "127.0.0.1",
            "--port", str(port), "--device", "cpu",
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if "cannot listen" in line]
    assert len(lines) == 1 and str(port) in lines[0], done.stderr
    assert "engine_started" not in done.stderr  # refused before the model loaded


def test_a_port_a_stopped_server_left_in_time_wait_is_free_a_listening_one_is_not() -> None:
    """A restart right after a shutdown binds its ports again (found as a restart refused
    with "Address already in use" while the old server's closed connections waited)."""
    from asyncengine.server.app import check_port_free
    from asyncengine.server.options import ServeOptions

    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        options = ServeOptions(host="127.0.0.1", port=port)
        client = socket.create_connection(("127.0.0.1", port))
        served, _ = listener.accept()
        with pytest.raises(OSError, match="cannot listen"):
            check_port_free(options)
        served.close()  # the server closes first: its end of the connection waits in TIME-WAIT
        time.sleep(0.05)
        client.close()
    time.sleep(0.05)
    check_port_free(options)


def test_a_kv_cache_that_cannot_fit_is_one_line_not_a_traceback(model_dir: Any) -> None:
    command = [
        *_serve_command(), "--model", str(model_dir("llama")), "--host", "127.0.0.1",
        "--port", "0", "--device", "cpu", "--gpu-memory-utilization", "0.00001",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("asyncengine: error")]
    assert "the KV cache cannot hold one max_model_len" in line and "gpu_memory_utilization" in line


def _spawned_children(pid: int) -> list[int]:
    """The children multiprocessing spawned (the engine process; not its resource tracker)."""
    children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def test_a_frozen_engine_process_turns_health_not_serving_and_exits_non_zero(
    model_dir: Any, tmp_path: Path
) -> None:
    """A stopped engine process (SIGSTOP: alive, but silent) is an engine death once its
    heartbeat is missing past --engine-heartbeat-timeout, as a crash is."""
    flags = ["--fake-runner", "--step-delay", "0.01", "--engine-heartbeat-timeout", "2"]
    server = ServerProcess(model_dir("llama"), tmp_path / "server.log", *flags)
    try:
        server.wait_serving()
        (engine_pid,) = _spawned_children(server.proc.pid)

        async def main() -> tuple[list[grpc.aio.AioRpcError], Any, float]:
            async with server.aio_channel() as channel:
                generation, _ = stubs(channel)
                watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
                assert (await watch.read()).status == SERVING
                calls = [
                    generation.GenerateStream(greedy_request([5, 6 + i], 2000), timeout=60)
                    for i in range(3)
                ]
                for call in calls:
                    await read_until(call, "delta")
                os.kill(engine_pid, signal.SIGSTOP)
                stopped = time.monotonic()
                errors = []
                for call in calls:
                    with pytest.raises(grpc.aio.AioRpcError) as failed:
                        await read_rest(call)
                    errors.append(failed.value)
                detected_s = time.monotonic() - stopped
                return errors, (await watch.read()).status, detected_s

        errors, status, detected_s = asyncio.run(main())
        assert 2.0 <= detected_s < 10.0
        for error in errors:
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert detail(error, error_details_pb2.ErrorInfo).reason == "ENGINE_DEAD"
            assert "sent no heartbeat" in (error.details() or "")  # the reason, said
        assert status == NOT_SERVING
        assert server.proc.wait(timeout=30) != 0
        # JSON lines only: under load grpc's Cython prints a cancelled RPC's traceback to stderr
        # itself as the server stops (seen once with four busy processes beside the suite)
        records = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
        (lost,) = [r for r in records if r["event"] == "engine_heartbeat_lost"]
        assert lost["heartbeat_timeout_s"] == 2.0
        assert not Path(f"/proc/{engine_pid}").exists()  # killed, not left stopped
    finally:
        server.kill()
