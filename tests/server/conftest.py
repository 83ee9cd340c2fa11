"""Fixtures: real `asyncengine serve` subprocesses on loopback, and in-process servers.

Starting a server process is almost all import time, so every subprocess server the tests need
is launched at once on first use and shared by the session.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .utils import ServerProcess

MAX_MODEL_LEN = 1024
FAULT_AFTER_STEPS = 150
# name -> (flags, environment)
MAIN_FLAGS = (
    "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "16", "--max-queued-requests", "128",
    "--heartbeat-interval", "0.05", "--drain-grace-period", "1.0",
    "--num-gpu-blocks-override", "2048", "--num-cpu-blocks-override", "64",
)  # fmt: skip
FAULT_FLAGS = (
    "--max-num-seqs", "1", "--num-gpu-blocks-override", "256", "--num-cpu-blocks-override", "8",
)  # fmt: skip
# the front-door tests: an admission limit of 4, a short stall time, a cache of 1536 tokens
FRONT_FLAGS = (
    "--max-num-seqs", "2", "--max-queued-requests", "2", "--stall-timeout", "4",
    "--num-gpu-blocks-override", "96", "--num-cpu-blocks-override", "96",
    "--heartbeat-interval", "0.5",
)  # fmt: skip
# name -> (flags, environment)
SERVER_SPECS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "main": (MAIN_FLAGS, {}),
    # the main server's flags, for the test that ends its server with SIGTERM; 5 ms more per
    # step, so its long requests cannot finish within the grace period on any machine
    "sigterm": ((*MAIN_FLAGS, "--step-delay", "0.005"), {}),
    # the test-only fault hook (python -m asyncengine.testing serve): the 150th step raises
    "fault": ((*FAULT_FLAGS, "--fault-after-steps", str(FAULT_AFTER_STEPS)), {}),
    "front": (FRONT_FLAGS, {}),
}


class ServerPool:
    """`pool[name]` is the SERVING server of SERVER_SPECS[name]; all start on the first use."""

    def __init__(self, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._model_dir = model_dir
        self._tmp = tmp_path_factory
        self.servers: dict[str, ServerProcess] = {}

    def __getitem__(self, name: str) -> ServerProcess:
        if not self.servers:
            for spec_name, (flags, env) in SERVER_SPECS.items():
                log_path = self._tmp.mktemp(f"server-{spec_name}") / "server.log"
                self.servers[spec_name] = ServerProcess(self._model_dir, log_path, *flags, env=env)
        server = self.servers[name]
        server.wait_serving()
        return server


@pytest.fixture(scope="session")
def server_pool(
    model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerPool]:
    """The shared subprocess servers; one still up at the end must exit 0 on SIGTERM."""
    pool = ServerPool(model_dir("llama"), tmp_path_factory)
    yield pool
    failures = []
    was_running = {name: server.proc.poll() is None for name, server in pool.servers.items()}
    for server in pool.servers.values():  # all drain at once
        server.terminate()
    for name, server in pool.servers.items():
        code = server.stop()
        if was_running[name] and code != 0:
            failures.append(f"{name}: exit code {code}:\n{server.log()[-4000:]}")
    assert not failures, failures
