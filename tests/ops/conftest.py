"""In-process servers built from `asyncengine serve` flags, and a /metrics reader.

In-process, as in tests/server/test_security.py: the engine of a tiny model loads in
milliseconds once the imports are warm, where a new process takes ~10 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from asyncengine import testing
from asyncengine.engine.async_llm_engine import AsyncLLMEngine
from asyncengine.server import app
from asyncengine.server.cli import build_parser, engine_args_from
from asyncengine.server.options import check_options, serve_options_from
from asyncengine.server.state import ServerState


@dataclass
class Served:
    target: str
    state: ServerState

    @property
    def metrics_port(self) -> int:
        assert self.state.metrics is not None and self.state.metrics.port is not None
        return self.state.metrics.port


@pytest.fixture
def serving(model_dir: Callable[..., Path]) -> Callable[..., Any]:
    """`async with serving(*serve_flags) as served`: a started server, stopped (exit 0) on exit.

    `fake_runner=True` scripts tokens instead of running the model: engines in one process
    must not run forwards at the same time (the forward context is one per process).
    """

    @contextlib.asynccontextmanager
    async def serve(*flags: str, fake_runner: bool = False) -> AsyncIterator[Served]:
        argv = ["serve", "--model", str(model_dir("llama")), "--host", "127.0.0.1"]
        argv += ["--port", "0", "--device", "cpu", "--num-cpu-blocks-override", "16"]
        argv += ["--drain-grace-period", "5", *flags]
        ns = build_parser().parse_args(argv)
        options = serve_options_from(ns)
        check_options(options)
        args = engine_args_from(ns)
        make_engine = testing.fake_engine if fake_runner else AsyncLLMEngine.from_engine_args
        engine = make_engine(args)
        server, state, port = await app.start(engine, options)
        try:
            yield Served(f"127.0.0.1:{port}", state)
        finally:
            assert await app.stop(server, state) == 0

    return serve


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_metrics(text: str) -> Samples:
    """{(sample name, sorted labels): value} of a Prometheus text exposition."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


async def scrape(port: int) -> Samples:
    """GET /metrics off the event loop (the servers under test run on it)."""

    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            return str(reply.read().decode())

    return parse_metrics(await asyncio.to_thread(get))


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]
