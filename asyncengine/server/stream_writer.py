"""Writing one streaming call's messages, shared by the gRPC services: a write the client does
not take within the server's stall time ends the call."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from asyncengine.engine.timers import LazyTimer
from asyncengine.server.errors import ClientStalledError
from asyncengine.server.state import ServerState


class StreamWriter:
    """Writes one call's messages; a write the client does not take within the stall time
    ends the call (its buffered output is dropped with it)."""

    def __init__(self, context: grpc.aio.ServicerContext, state: ServerState) -> None:
        self._context = context
        self._state = state
        self.sequence_number = 0
        self.num_deltas = 0  # Delta messages written: output the client may have seen
        # the call's handler: cancelled when a write waits past the stall time
        self._task = asyncio.current_task()
        self._stalled = False
        self._stall_timer = LazyTimer(self._on_stall)  # one timer per call, not per write

    async def write(self, msg: Any) -> None:
        stall_s = self._state.options.stall_timeout
        self._stall_timer.start(stall_s)
        try:
            await self._context.write(msg)
        except asyncio.CancelledError:
            if not self._stalled or self._task is None:
                raise
            self._task.uncancel()
            if self._state.metrics is not None:
                self._state.metrics.on_stalled_stream()
            raise ClientStalledError(
                f"the client read nothing for {stall_s:g} s (stall_timeout): the call is ended "
                "and its unread output dropped"
            ) from None
        finally:
            self._stall_timer.stop()

    def _on_stall(self) -> None:
        self._stalled = True
        if self._task is not None:
            self._task.cancel()

    def close(self) -> None:
        self._stall_timer.close()

    def next_sequence_number(self) -> int:
        self.sequence_number += 1
        return self.sequence_number
