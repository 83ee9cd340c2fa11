"""Time and count limits on the HTTP port's connections, which uvicorn lacks: a request must send
its headers and then its body in bounded time, and past a number of open connections new ones
are closed at once (uvicorn's `limit_concurrency` still accepts and holds them)."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from asyncengine.logging import get_logger
from asyncengine.server.options import ServeOptions

logger = get_logger(__name__)


class _LimitedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline for each request's headers (from the
    connection, or the request's first byte on a kept-alive one) and one for its body."""

    header_timeout_s: float
    body_timeout_s: float
    max_connections: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            logger.warning("http_connection_refused", max_connections=self.max_connections)
            transport.close()
            return
        # a socket that connects and sends nothing holds a descriptor until this fires
        self._arm(self.header_timeout_s, "headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._deadline is None:  # a kept-alive connection's next request
            self._arm(self.header_timeout_s, "headers")

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._arm(self.body_timeout_s, "body")

    def on_message_complete(self) -> None:
        super().on_message_complete()
        # the response may take as long as it takes: generation has its own limits
        self._disarm()

    def _arm(self, timeout_s: float, part: str) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(timeout_s, self._expire, part, timeout_s)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self, part: str, timeout_s: float) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            logger.info("http_read_timeout", part=part, timeout_s=timeout_s)
            self.transport.close()  # a request being read gets http.disconnect


def limited_protocol(options: ServeOptions) -> type[asyncio.Protocol]:
    """The HTTP protocol class for uvicorn's Config, with `options`' connection limits."""
    return type(
        "LimitedHttpProtocol",
        (_LimitedProtocol,),
        {
            "header_timeout_s": options.http_header_timeout,
            "body_timeout_s": options.http_body_timeout,
            "max_connections": options.http_max_connections,
        },
    )
