"""The README's quick start, run as written: serve the default model, stream from the client CLI,
and get exactly the output the README shows; and every python block of README.md and docs/*.md,
run as pasted.

The one change: the server gets a free port (and the client a matching --target), since the
README's own server may well be running on 50051 while its reader runs these tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
ACTIVATE = ". .venv/bin/activate && "  # the venv is already active in the test process


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def python_blocks() -> list[tuple[str, str]]:
    """(where, code) of every python block of README.md and docs/*.md."""
    blocks = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        for match in re.finditer(r"```python\n(.*?)```", text, flags=re.S):
            line = text.count("\n", 0, match.start()) + 1
            blocks.append((f"{doc.relative_to(ROOT)}:{line}", match.group(1)))
    return blocks


PYTHON_BLOCKS = python_blocks()


def test_the_readme_has_exactly_two_setup_commands_and_ci_runs_the_test_one() -> None:
    setup, tests = code_blocks("bash")
    assert len(setup.strip().splitlines()) == 1 and len(tests.strip().splitlines()) == 1
    assert setup.strip().endswith("asyncengine serve")
    # serving needs neither the dev tools nor triton: torch's CPU build, the package, the client
    assert "[dev]" not in setup and "download.pytorch.org/whl/cpu" in setup
    ci_lines = (ROOT / ".ci" / "run").read_text().replace(" --quiet", "").splitlines()
    for command in tests.strip().removeprefix(ACTIVATE).split(" && "):
        assert command in ci_lines, f"{command!r} is not a line of .ci/run"


def test_the_python_blocks_are_found() -> None:
    assert len(PYTHON_BLOCKS) >= len(code_blocks("python")) >= 2


@pytest.mark.parametrize(
    "code", [code for _, code in PYTHON_BLOCKS], ids=[where for where, _ in PYTHON_BLOCKS]
)
def test_every_python_block_of_the_docs_runs_as_pasted(
    code: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if "localhost:8000" in code:  # a client of `serve --http-port 8000`: run against ours
        served: Served = request.getfixturevalue("served")
        code = code.replace("localhost:8000", f"localhost:{served.http}")
    script = tmp_path / "snippet.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]


# 100 ms between connects: gRPC's default backoff (1 s, 1.6 s, 2.6 s, ...) saw a server that
# came up after 30 s of imports ~15 s late
FAST_RECONNECT = [(f"grpc.{kind}_reconnect_backoff_ms", 100) for kind in ("initial", "min", "max")]


def wait_serving(target: str, process: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target, options=FAST_RECONNECT) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert process.poll() is None, "the server exited"
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                time.sleep(0.5)
    raise AssertionError("the server did not become SERVING")


@dataclass
class Served:
    grpc: int
    http: int


def logged_ports(log: Path, process: subprocess.Popen[bytes], timeout: float = 300) -> Served:
    """The ports of the log lines 'serving' and 'http_serving' (both flags were 0)."""
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        ports = {}
        for line in log.read_text().splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and record.get("event") in ("serving", "http_serving"):
                    ports[record["event"]] = int(record["port"])
        if len(ports) == 2:
            return Served(ports["serving"], ports["http_serving"])
        time.sleep(0.1)
    raise AssertionError(f"the server logged no ports:\n{log.read_text()}")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    serve = code_blocks("bash")[0].strip().rsplit("&&", 1)[1].strip()
    # port 0: the server binds free ports and logs them (none can be taken in between)
    log = tmp_path_factory.mktemp("readme") / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("wb") as log_file:
        process = subprocess.Popen(
            # float32, as the README's completion was made: dtype "auto" picks bfloat16 on CPUs
            # that multiply it natively, and bf16's greedy text differs after a few words
            [*shlex.split(serve), "--dtype", "float32", "--port", "0", "--http-port", "0"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log_file,
        )
    try:
        ports = logged_ports(log, process)
        wait_serving(f"localhost:{ports.grpc}", process)
        yield ports
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


def test_the_curl_example_completes_over_http(served: Served) -> None:
    (curl,) = code_blocks("sh")
    command = curl.replace("localhost:8000", f"localhost:{served.http}")
    result = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    (choice,) = json.loads(result.stdout)["choices"]
    assert choice["text"] and choice["finish_reason"] == "length"


def test_the_quick_start_streams_what_the_readme_shows(served: Served) -> None:
    (console,) = code_blocks("console")
    first, *shown = console.splitlines()
    command = first.removeprefix("$ ").removeprefix(ACTIVATE)
    command += f" --target localhost:{served.grpc}"
    result = subprocess.run(
        command, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    assert (result.stdout + result.stderr).splitlines() == shown
    assert re.search(r"[A-Za-z]{3,} [A-Za-z]{3,}", result.stdout)  # words, not byte soup
