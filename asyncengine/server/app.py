"""Build and run a server: the core's state, its front ends (gRPC with TLS, auth, health and
reflection; the HTTP API beside it), metrics, signals and the engine watch."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import structlog
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1.health import SERVICE_NAME as HEALTH_SERVICE_NAME
from smg_grpc_proto import vllm_engine_pb2_grpc

from asyncengine.config import EngineArgs
from asyncengine.engine.async_llm_engine import AsyncLLMEngine
from asyncengine.engine.llm_engine import LLMEngine, freeze_heap
from asyncengine.logging import get_logger
from asyncengine.server.auth import BearerTokenInterceptor
from asyncengine.server.decode import MalformedRequestInterceptor
from asyncengine.server.health import SERVICE_NAMES, GrpcHealth
from asyncengine.server.lora import check_lora_modules, check_lora_options, parse_lora_module
from asyncengine.server.message_bounds import MessageBounds
from asyncengine.server.metrics import ServerMetrics
from asyncengine.server.options import ServeOptions, check_options
from asyncengine.server.reflection import enable_reflection
from asyncengine.server.servicer_control import ControlServicer
from asyncengine.server.servicer_generation import (
    MAX_DETOKENIZE_SEQUENCES,
    MAX_TOKENIZE_TEXTS,
    GenerationServicer,
)
from asyncengine.server.state import ServerState
from asyncengine.server.vllm_worker.servicer import VllmWorkerServicer
from asyncengine.v1 import control_pb2_grpc, generation_pb2_grpc

if TYPE_CHECKING:
    from asyncengine.server.http import HttpServer

logger = get_logger(__name__)

# how often the engine's liveness is checked, and how long streams get to receive their error
_WATCH_INTERVAL_S = 0.1
_STOP_GRACE_S = 2.0


def grpc_options(options: ServeOptions, max_message_size: int) -> list[tuple[str, Any]]:
    """Channel arguments (`max_message_size`: ServerState's); the reason for each is in
    `asyncengine serve --help`."""
    ms = lambda seconds: int(seconds * 1000)  # noqa: E731
    age = []
    if options.max_connection_age is not None:
        # no grace limit: a GOAWAY never cuts a generation short
        age = [("grpc.max_connection_age_ms", ms(options.max_connection_age))]
    return [
        *age,
        ("grpc.max_receive_message_length", max_message_size),
        ("grpc.max_send_message_length", max_message_size),
        ("grpc.keepalive_time_ms", ms(options.keepalive_time)),
        ("grpc.keepalive_timeout_ms", ms(options.keepalive_timeout)),
        ("grpc.keepalive_permit_without_calls", 1),
        # the real key of GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS
        ("grpc.http2.min_ping_interval_without_data_ms", ms(options.min_client_ping_interval)),
        # 0: pings arriving early are never counted against the client
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.max_connection_idle_ms", ms(options.max_connection_idle)),
        ("grpc.server_handshake_timeout_ms", ms(options.handshake_timeout)),
        # calls gRPC holds until the loop takes them: past its soft limit (default 1000) it
        # cancels new ones at random, CANCELLED with no details, before any handler sees them
        # (a burst of 2000 streams, or a flood of cancelled ones, lost others' calls this way).
        # Equal limits make it one deterministic bound, far above admission's
        ("grpc.server.max_pending_requests", options.max_pending_rpcs),
        ("grpc.server.max_pending_requests_hard_limit", options.max_pending_rpcs),
        ("grpc.max_concurrent_streams", options.max_concurrent_streams),
        # fail to start instead of silently sharing the port with another server
        ("grpc.so_reuseport", 0),
    ]


def server_credentials(options: ServeOptions) -> grpc.ServerCredentials | None:
    """TLS credentials, mutual when a client CA is given; None for plaintext."""
    if not options.tls_cert or not options.tls_key:
        return None
    key, cert = Path(options.tls_key).read_bytes(), Path(options.tls_cert).read_bytes()
    client_ca = Path(options.tls_client_ca).read_bytes() if options.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def build_server(state: ServerState, health: GrpcHealth) -> tuple[grpc.aio.Server, int]:
    """The grpc.aio server with every service added and its port bound (not started)."""
    options = state.options
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if options.auth_tokens or options.control_auth_tokens:
        interceptors.append(
            BearerTokenInterceptor(options.auth_tokens, options.control_auth_tokens)
        )
    # inside auth (the first is outermost): auth's rejection keeps this never-raising
    # deserializer, so a caller without a token gets UNAUTHENTICATED and learns nothing of parsing
    engine = state.engine
    bounds = MessageBounds.create(
        engine.max_model_len,
        engine.config.scheduler_config.max_prompt_bytes,
        state.max_in_flight,
        max_texts=MAX_TOKENIZE_TEXTS,
        max_sequences=MAX_DETOKENIZE_SEQUENCES,
    )
    interceptors.append(MalformedRequestInterceptor(bounds))
    server = grpc.aio.server(
        interceptors=interceptors,
        options=grpc_options(options, state.max_message_size),
        maximum_concurrent_rpcs=options.max_concurrent_rpcs,
    )
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(state), server)
    control_pb2_grpc.add_ControlServicer_to_server(ControlServicer(state), server)
    # SMG's vLLM worker protocol, on the same port (the gateway tells it by its service name)
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(VllmWorkerServicer(state), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    if options.reflection:
        enable_reflection((*SERVICE_NAMES, HEALTH_SERVICE_NAME), server)
    host = f"[{options.host}]" if ":" in options.host else options.host
    address = f"{host}:{options.port}"
    credentials = server_credentials(options)
    if credentials is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, credentials)
    if not port:
        raise OSError(f"could not listen on {address}")
    return server, port


class FrontEnds:
    """The protocols one server answers on, peers over one server core: gRPC (with health)
    and, with --http-port, the OpenAI-compatible HTTP API. Started and stopped together."""

    def __init__(self, state: ServerState) -> None:
        self._options = state.options
        self.health = GrpcHealth()
        state.on_readiness(self.health.set_ready)  # a drain turns it NOT_SERVING, Resume back
        self.grpc, self.port = build_server(state, self.health)
        self.http: HttpServer | None = None
        if state.options.http_port is not None:
            from asyncengine.server.http import HttpServer  # FastAPI loads only when it serves

            self.http = HttpServer(state)

    @property
    def http_port(self) -> int | None:
        return None if self.http is None else self.http.port

    async def start(self) -> None:
        """Open every port; readiness is SERVING once they all are."""
        await self.health.set_ready(False)
        await self.grpc.start()
        if self.http is not None:
            assert self._options.http_port is not None
            http_port = await self.http.start(self._options.http_port)
            logger.info("http_serving", host=self.http.host, port=http_port, api="openai")
        await self.health.set_live()
        await self.health.set_ready(True)

    async def stop(self) -> None:
        """Tell health watchers, then close every port (HTTP first: it answers no watcher)."""
        await self.health.shut_down()
        if self.http is not None:
            await self.http.stop()
        await self.grpc.stop(_STOP_GRACE_S)


async def start(
    engine: AsyncLLMEngine, options: ServeOptions
) -> tuple[FrontEnds, ServerState, int]:
    """Start serving `engine` on every front end (health SERVING once the ports are open);
    returns the front ends, the server core's state and the bound gRPC port.

    With `options.metrics_port` set, /metrics is served too (`state.metrics.port`).
    """
    state = ServerState(engine, options)
    await _load_lora_modules(state)
    front_ends = FrontEnds(state)
    if options.metrics_port is not None or options.http_port is not None:
        # one registry, on --metrics-port and on the HTTP API's /metrics alike
        state.metrics = ServerMetrics(engine, state.abort_reason_of, state.model_name)
        engine.observer = state.metrics
    if options.metrics_port is not None:
        assert state.metrics is not None
        host = options.metrics_host or options.host
        metrics_port = state.metrics.start_http(host, options.metrics_port)
        logger.info("metrics_serving", host=host, port=metrics_port, path="/metrics")
    # the front ends' imports and objects (grpc, FastAPI, pydantic, protobuf) join what the
    # engine's start froze: a full collection under a burst walked them for ~250 ms
    freeze_heap()
    await front_ends.start()
    logger.info(
        "serving", host=options.host, port=front_ends.port, model=state.model_name,
        tls=bool(options.tls_cert), mtls=bool(options.tls_client_ca),
        auth=bool(options.auth_tokens), max_message_size=state.max_message_size,
    )  # fmt: skip
    return front_ends, state, front_ends.port


async def _load_lora_modules(state: ServerState) -> None:
    """Load --lora-modules before any port opens (no caller sees the server without them);
    on a failure the engine is shut down and the ValueError names the entry."""
    try:
        modules = [parse_lora_module(value) for value in state.options.lora_modules]
        check_lora_modules(modules, state.model_names)
        await state.adapters.load_modules(modules)
    except ValueError:
        await state.engine.shutdown()
        raise


async def stop(front_ends: FrontEnds, state: ServerState) -> int:
    """Drain (unless the engine is dead), stop the front ends and the engine; the exit code."""
    engine = state.engine
    state.is_stopping = True  # this drain is final: Resume no longer undoes it
    if not engine.errored:
        await state.drain(state.options.drain_grace_period)
    else:
        logger.error("engine_dead_shutting_down", in_flight=len(state.flights))
    await front_ends.stop()
    exit_code = 1 if engine.errored else 0
    await engine.shutdown()
    if state.metrics is not None:
        await asyncio.to_thread(state.metrics.close)
    logger.info("server_stopped", exit_code=exit_code)
    return exit_code


async def serve(engine: AsyncLLMEngine, options: ServeOptions) -> int:
    """Serve until SIGTERM/SIGINT (drain, then 0) or until the engine dies (1)."""
    front_ends, state, _ = await start(engine, options)
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, _on_signal, state, stop_requested, signum)
    waiters = [
        asyncio.create_task(stop_requested.wait()),
        asyncio.create_task(_engine_death(engine)),
    ]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for waiter in waiters:
        waiter.cancel()
    return await stop(front_ends, state)


def _on_signal(state: ServerState, stop: asyncio.Event, signum: int) -> None:
    if stop.is_set():  # a second signal: stop waiting for the grace period
        logger.warning("second_signal_aborting_all", signal=signal.Signals(signum).name)
        state.background(state.abort_all())
        return
    logger.info("shutdown_requested", signal=signal.Signals(signum).name)
    stop.set()


async def _engine_death(engine: AsyncLLMEngine) -> None:
    while not engine.errored:
        await asyncio.sleep(_WATCH_INTERVAL_S)


def json_stdlib_logs() -> None:
    """Render records of stdlib `logging` users (grpc, asyncio) as JSON lines too."""
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
        ],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
    )
    for handler in logging.getLogger().handlers:
        handler.setFormatter(formatter)


# builds the served LLMEngine from the flags (asyncengine.testing injects its hooks this way);
# with --engine-process it runs in the engine's process, so it must pickle (a module-level
# function, or a partial of one)
EngineFactory = Callable[[EngineArgs], LLMEngine]


def check_port_free(options: ServeOptions) -> None:
    """Fail in a line, before the model loads, when the gRPC (or HTTP) port is taken."""
    ports = [(options.host, options.port)]
    if options.http_port is not None:
        ports.append((options.http_host or options.host, options.http_port))
    for host, port in ports:
        if port == 0:
            continue
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            # as the servers bind: connections a previous server closed (TIME-WAIT) do not
            # count, a socket listening there does
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as exc:
                raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def make_served_engine(
    engine_args: EngineArgs, options: ServeOptions, make_engine: EngineFactory
) -> AsyncLLMEngine:
    """The engine `serve` runs: stepping in its own process (--engine-process), or here."""
    if options.engine_process:
        return AsyncLLMEngine.from_engine_args(
            engine_args,
            engine_process=True,
            factory=make_engine,
            torch_threads=options.torch_threads,
            heartbeat_timeout_s=options.engine_heartbeat_timeout,
        )
    return AsyncLLMEngine(make_engine(engine_args))


def run(
    engine_args: EngineArgs, options: ServeOptions, make_engine: EngineFactory | None = None
) -> int:
    """Load the engine, serve on uvloop, and return the process exit code.

    `make_engine` replaces how the engine is built (asyncengine.testing injects its fake
    runner and fault hook this way).
    """
    check_options(options)
    check_lora_options(options, engine_args.enable_lora)
    check_port_free(options)
    if not sys.stderr.isatty():  # the same test configure_logging uses for JSON
        json_stdlib_logs()
    if options.torch_threads:
        import torch

        torch.set_num_threads(options.torch_threads)
    engine = make_served_engine(engine_args, options, make_engine or LLMEngine.from_engine_args)
    try:
        import uvloop
    except ImportError:  # Windows
        exit_code = asyncio.run(serve(engine, options))
    else:
        exit_code = uvloop.run(serve(engine, options))
    if exit_code != 0:
        # a hung step would keep the worker thread, and so the process, alive: exit for sure
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
    return exit_code
