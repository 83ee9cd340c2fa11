"""Server-sent events as OpenAI frames them, with the gRPC servicer's rules for a stream: a
client that reads nothing for the stall time is cut off, and the call's requests are released
however the stream ends (finished, disconnected, stalled, or the server stopping)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Awaitable, Callable

import anyio
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Message, Send

from asyncengine.logging import get_logger
from asyncengine.server.errors import ClientStalledError
from asyncengine.server.http.errors import error_content

logger = get_logger(__name__)

DONE = "data: [DONE]\n\n"
# A silent stream's keep-alive: a blank line pair, which dispatches no event (no data) and
# leaves the stream at an event boundary. Not a `: comment`: clients that strip each network
# chunk before splitting on blank lines (vLLM's `bench serve`) glue a stripped comment to the
# next event and drop both as a comment; whitespace alone is stripped to nothing.
KEEPALIVE = "\n\n"


def event(chunk: BaseModel, include_usage: bool) -> str:
    """One `data:` frame; `usage` is there (null until the last) only when it was asked for."""
    exclude = None if include_usage else {"usage"}
    return f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"


def error_event(exc: BaseException) -> str:
    """A failure after the stream began (the status is sent already): OpenAI's error JSON."""
    _, body, _ = error_content(exc)
    return f"data: {json.dumps(body)}\n\n"


class EventStream(StreamingResponse):
    """An SSE response over `events`; `on_close` runs once the body is done with, whatever
    ended it, so a disconnected or stalled client never leaves a request running."""

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncGenerator[str, None],
        on_close: Callable[[], Awaitable[None]],
        stall_timeout_s: float,
        on_stall: Callable[[ClientStalledError], None],
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(
            events,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )
        self._events = events
        self._on_close = on_close
        self._stall_timeout_s = stall_timeout_s
        self._on_stall = on_stall

    async def stream_response(self, send: Send) -> None:
        async def send_in_time(message: Message) -> None:
            try:
                async with asyncio.timeout(self._stall_timeout_s):
                    await send(message)
            except TimeoutError:
                raise ClientStalledError(
                    f"the client read nothing for {self._stall_timeout_s:g} s (stall_timeout)"
                ) from None

        try:
            await super().stream_response(send_in_time)
        except ClientStalledError as exc:
            # the connection is closed when this returns with the response unfinished
            self._on_stall(exc)
            logger.warning("client_stalled", protocol="http", error=str(exc))
        finally:
            # shielded: a disconnect cancels this task, and the release must still run
            with anyio.CancelScope(shield=True):
                await self._events.aclose()
                await self._on_close()
