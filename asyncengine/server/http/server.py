"""uvicorn's `Server.serve()` as a task on the running event loop, beside grpc.aio."""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import ssl
from collections.abc import Iterator
from typing import Any

import uvicorn

from asyncengine.server.http.api import build_app
from asyncengine.server.http.connection import limited_protocol
from asyncengine.server.options import ServeOptions
from asyncengine.server.state import ServerState

_START_TIMEOUT_S = 30.0


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # the process's SIGTERM/SIGINT are app.serve's: drain first, then stop this server
        yield


class HttpServer:
    """The OpenAI-compatible API of one server, on its own port, in the server's event loop."""

    def __init__(self, state: ServerState) -> None:
        options = state.options
        self.host = options.http_host or options.host
        config = uvicorn.Config(
            build_app(state),
            lifespan="off",
            log_config=None,  # the process's logging (JSON lines) already handles uvicorn's
            access_log=False,  # one request_finished line per request is logged instead
            ws="none",
            server_header=False,
            http=limited_protocol(options),  # header and body read deadlines, a connection cap
            timeout_keep_alive=math.ceil(options.http_keep_alive_timeout),
            # in-flight streams get the drain's grace; this only bounds what is left after it
            timeout_graceful_shutdown=5,
            **_tls(options),
        )
        self._server = _Server(config)
        self._task: asyncio.Task[None] | None = None
        self.port: int | None = None

    async def start(self, port: int) -> int:
        """Listen on `port` (0: a free one) and serve; returns the bound port."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, port))
        except OSError as exc:
            sock.close()
            raise OSError(f"cannot listen on {self.host}:{port}: {exc.strerror or exc}") from None
        sock.setblocking(False)
        self.port = int(sock.getsockname()[1])
        self._task = asyncio.get_running_loop().create_task(
            self._server.serve(sockets=[sock]), name="http-server"
        )
        async with asyncio.timeout(_START_TIMEOUT_S):
            while not self._server.started:
                if self._task.done():
                    self._task.result()  # its failure, raised here
                    raise RuntimeError("the HTTP server stopped while starting")
                await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        """Stop accepting, close idle connections, and wait for the server task to end."""
        if self._task is None:
            return
        self._server.should_exit = True
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None


def _tls(options: ServeOptions) -> dict[str, Any]:
    """The gRPC port's certificate and key (and client CA: mutual TLS) for HTTPS too."""
    if not options.tls_cert:
        return {}
    tls: dict[str, Any] = {"ssl_certfile": options.tls_cert, "ssl_keyfile": options.tls_key}
    if options.tls_client_ca:
        tls.update(ssl_ca_certs=options.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return tls
