"""Servers with the HTTP API on, run on an event loop of their own in a thread, so the official
`openai` clients (sync and async) call them from the test as from anywhere else. The engine is
built as `serve` builds it: stepping in a process of its own (`--engine-process`) or here
(`--no-engine-process`); the `core` fixture (conftest.py) picks one.

(This folder has no __init__.py: a package named `http` would hide the standard library's.)"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import openai

from asyncengine import testing
from asyncengine.server import app
from asyncengine.server.cli import build_parser, engine_args_from
from asyncengine.server.options import check_options, serve_options_from
from asyncengine.server.state import ServerState

T = TypeVar("T")
# the two core clients a server's engine runs over: `serve`'s default, the engine stepping in
# a process of its own, and the engine stepping on the server's event loop
CORES = {"engine-process": ("--engine-process",), "in-process": ("--no-engine-process",)}


class ServerThread:
    """`asyncengine serve` (gRPC and HTTP) built from flags, on a loop in a daemon thread."""

    def __init__(self, flags: list[str], fake_runner: bool, step_delay_s: float = 0.0) -> None:
        ns = build_parser().parse_args(["serve", *flags])
        self.options = serve_options_from(ns)
        check_options(self.options)
        self.engine_args = engine_args_from(ns)
        # module-level and picklable: an engine process builds it too
        self._factory = functools.partial(
            testing.hooked_llm_engine, fake_runner=fake_runner, step_delay_s=step_delay_s
        )
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.front_ends: app.FrontEnds
        self.state: ServerState
        self.grpc_port = 0

    def start(self) -> None:
        self._thread.start()

        async def start() -> tuple[app.FrontEnds, ServerState, int]:
            # built on the loop that serves it, as `serve` builds it
            engine = app.make_served_engine(self.engine_args, self.options, self._factory)
            return await app.start(engine, self.options)

        # generous: at the suite's start it comes up beside the other servers, on 2 cores
        self.front_ends, self.state, self.grpc_port = self.call(start(), timeout=300)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        """Run `coro` on the server's loop; its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def run(self, fn: Callable[[], T]) -> T:
        """Call `fn` on the server's loop (to read its state where it lives)."""

        async def wrapper() -> T:
            return fn()

        return self.call(wrapper())

    def stop(self) -> int:
        code = self.call(app.stop(self.front_ends, self.state))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
        return code

    @property
    def model(self) -> str:
        """The served model's name, as requests give it."""
        return self.options.served_model_name or str(self.engine_args.model)

    @property
    def http_port(self) -> int:
        port = self.front_ends.http_port
        assert port is not None
        return port

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.base_url + "/v1", **{"api_key": "none", "max_retries": 0, **kwargs}
        )

    def async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.base_url + "/v1", **{"api_key": "none", "max_retries": 0, **kwargs}
        )

    def engine_stats(self) -> Any:
        return self.run(self.state.engine.get_stats)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until no request is in the engine or admitted (a disconnect's abort is async)."""

        async def idle() -> None:
            async with asyncio.timeout(timeout):
                while self.state.num_admitted or self.state.flights:
                    await asyncio.sleep(0.01)

        self.call(idle())

    def assert_nothing_left(self, timeout: float = 10.0) -> None:
        """Every request gone and every KV block free (cached ones count as free).

        An engine in its own process reports its stats after its steps: they are read until
        they say so, or `timeout` passes."""
        self.wait_idle(timeout)
        deadline = time.monotonic() + timeout
        while True:
            stats = self.engine_stats()
            counts = (stats.num_running, stats.num_waiting, stats.num_swapped)
            free = (stats.num_free_gpu_blocks, stats.num_free_cpu_blocks)
            if counts == (0, 0, 0) and free == (stats.num_gpu_blocks, stats.num_cpu_blocks):
                return
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)


ServeFactory = Callable[..., contextlib.AbstractContextManager[ServerThread]]


@contextlib.contextmanager
def http_server(
    model: Path, *flags: str, fake_runner: bool = False, step_delay_s: float = 0.0
) -> Iterator[ServerThread]:
    """A started server with --http-port 0 on `model`; stopped (exit 0) on exit.

    `fake_runner` scripts tokens (no forward); `step_delay_s` makes every step that much
    slower, so requests are still running when a test acts on them."""
    argv = ["--model", str(model), "--host", "127.0.0.1", "--port", "0", "--http-port", "0"]
    argv += ["--device", "cpu", "--dtype", "float32", "--num-cpu-blocks-override", "16"]
    argv += ["--drain-grace-period", "5", "--torch-threads", "1", *flags]
    server = ServerThread(argv, fake_runner, step_delay_s)
    server.start()
    try:
        yield server
    finally:
        assert server.stop() == 0
