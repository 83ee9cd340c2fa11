"""The Node.js client's tests (clients/node, `npm test`) against a live `asyncengine serve`."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

NODE_CLIENT_DIR = Path(__file__).resolve().parents[2] / "clients" / "node"
ModelDirFactory = Callable[..., Path]  # the `model_dir` fixture of tests/conftest.py
MISSING_TOOLS = [tool for tool in ("node", "npm") if shutil.which(tool) is None]

pytestmark = pytest.mark.skipif(
    bool(MISSING_TOOLS),
    reason=f"{' and '.join(MISSING_TOOLS)} not installed: the Node.js client tests need Node >= 18",
)


def wait_port(server: subprocess.Popen[bytes], log: Path, timeout_s: float) -> int:
    """The port from the server's JSON log line `serving` (it was started with `--port 0`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and record.get("event") == "serving":
                    return int(record["port"])
        if server.poll() is not None:
            pytest.fail(f"asyncengine serve exited with {server.returncode}:\n{log.read_text()}")
        time.sleep(0.1)
    pytest.fail(
        f"asyncengine serve logged no 'serving' line in {timeout_s:.0f} s:\n{log.read_text()}"
    )


def wait_serving(target: str, timeout_s: float) -> None:
    """Poll grpc.health.v1 Check until the whole server ('') is SERVING."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            with contextlib.suppress(grpc.RpcError):
                response = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            time.sleep(0.1)
    pytest.fail(f"{target} not SERVING after {timeout_s:.0f} s")


@pytest.fixture(scope="module")
def server_target(
    model_dir: ModelDirFactory, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """`host:port` of an `asyncengine serve` on the tiny llama model, terminated afterwards."""
    log = tmp_path_factory.mktemp("node-client") / "serve.log"
    cmd = [
        sys.executable, "-m", "asyncengine.server.cli", "serve",  # `asyncengine serve`, this venv
        "--model", str(model_dir("llama")), "--host", "127.0.0.1", "--port", "0",
        "--device", "cpu", "--torch-threads", "1",
    ]  # fmt: skip
    with log.open("wb") as log_file:
        server = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        # generous: at the suite's start it comes up beside the shared servers, on 2 cores
        target = f"127.0.0.1:{wait_port(server, log, timeout_s=300)}"
        wait_serving(target, timeout_s=60)
        yield target
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def test_node_client(server_target: str) -> None:
    if not (NODE_CLIENT_DIR / "node_modules").is_dir():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=NODE_CLIENT_DIR, check=True)
    env = {**os.environ, "ASYNCENGINE_TARGET": server_target}
    result = subprocess.run(
        ["npm", "test"],
        cwd=NODE_CLIENT_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"npm test failed:\n{result.stdout}\n{result.stderr}"
