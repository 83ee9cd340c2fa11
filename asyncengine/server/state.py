"""What the servicers share: the engine, the requests in flight, admission, health and drain."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from grpc_health.v1 import health, health_pb2

from asyncengine.engine.async_llm_engine import AsyncLLMEngine
from asyncengine.errors import DuplicateRequestError, EngineOverloadedError
from asyncengine.logging import get_logger
from asyncengine.server.auth import Tenants
from asyncengine.server.convert import FinishReason
from asyncengine.server.errors import InvalidFieldError, ServerDrainingError
from asyncengine.server.options import ServeOptions
from asyncengine.v1 import control_pb2, generation_pb2

if TYPE_CHECKING:
    from asyncengine.server.http import HttpServer
    from asyncengine.server.metrics import ServerMetrics

logger = get_logger(__name__)

SERVICE_NAMES = (
    generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
    control_pb2.DESCRIPTOR.services_by_name["Control"].full_name,
)
# the health "service" a liveness probe asks for: SERVING from start until shutdown, drain
# included (readiness uses "", which drain turns NOT_SERVING)
LIVENESS_SERVICE = "liveness"
# how long handlers get to send their final messages once their requests are aborted
_FLUSH_S = 5.0


@dataclass
class Flight:
    """One open call's request, from admission until its handler has sent its last message."""

    request_id: str
    time_limit_s: float | None = None
    seed: int = 0  # what Accepted reports, so the client can replay a random request
    queue_position: int = 0  # requests waiting when it was admitted
    # set by whoever aborts it (Control.Abort, time limit, drain) before the engine sees the abort
    abort_reason: int | None = None
    admitted_at: float = field(default_factory=time.monotonic)


class ServerState:
    """The engine plus the server's own bookkeeping; lives on the event loop's thread."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        options: ServeOptions,
        health_servicer: health.aio.HealthServicer,
    ) -> None:
        self.engine = engine
        self.options = options
        self.health = health_servicer
        self.started_at = time.monotonic()
        self.flights: dict[str, Flight] = {}
        self.is_draining = False
        self.is_stopping = False  # set by shutdown: its drain is final, no Resume undoes it
        self._resumed = asyncio.Event()  # a new one per drain; Resume sets it
        self.tenants = Tenants.from_options(options)
        self.metrics: ServerMetrics | None = None
        self.http: HttpServer | None = None  # the OpenAI-compatible API, with --http-port
        self._num_entering = 0  # admitted, not yet the engine's
        self._tasks: set[asyncio.Task[Any]] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def max_in_flight(self) -> int:
        """Requests admitted at once: a full running batch plus the bounded waiting queue."""
        return self.engine.max_num_seqs + self.options.max_queued_requests

    @property
    def num_admitted(self) -> int:
        """Admission slots in use: the engine's work plus requests on their way into it.

        A call whose request is done (its last messages still being written, or never read)
        holds none: a reader that stops reading cannot keep others out.
        """
        return self.engine.num_requests + self._num_entering

    def admit(self, flights: list[Flight]) -> None:
        """Register `flights` (all or none); raise if the server cannot take them now.

        Each flight holds a slot until `entered` says the engine has it (or refused it).
        """
        if self.is_draining:
            raise ServerDrainingError("the server is draining and admits no new requests")
        self.engine.check_health()
        self.check_batch_size(len(flights))
        seen: set[str] = set()
        for flight in flights:
            if flight.request_id in self.flights or flight.request_id in seen:
                raise DuplicateRequestError(flight.request_id)
            seen.add(flight.request_id)
        if self.num_admitted + len(flights) > self.max_in_flight:
            raise EngineOverloadedError(
                f"{self.num_admitted} requests admitted; the limit is {self.max_in_flight}",
                retry_after_s=self.options.retry_after,
            )
        for flight in flights:
            self.flights[flight.request_id] = flight
        self._num_entering += len(flights)
        self._idle.clear()

    def check_batch_size(self, num_requests: int) -> None:
        """A batch larger than can ever be admitted is the caller's mistake, not a retry."""
        if num_requests > self.max_in_flight:
            raise InvalidFieldError(
                "prompts",
                f"{num_requests} prompts can never be admitted at once: the server admits "
                f"{self.max_in_flight} requests (max_num_seqs + max_queued_requests)",
            )

    def background(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run `coro` on the loop from a callback (a signal handler), keeping it referenced."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def entered(self) -> None:
        """One admitted flight is now the engine's (or was refused): its slot is counted there."""
        self._num_entering -= 1

    async def release(self, flight: Flight) -> None:
        """Forget a call whose handler is done with it (and make sure the engine is too)."""
        try:
            # a no-op unless the handler left early. An engine in its own process answers
            # an abort after its step: a handler cancelled meanwhile still gives its slot back
            # (the abort itself is sent already)
            await self.engine.abort(flight.request_id)
        finally:
            if self.flights.get(flight.request_id) is flight:
                del self.flights[flight.request_id]
            if not self.flights:
                self._idle.set()

    def abort_reason_of(self, request_id: str) -> int | None:
        """Why the server aborted a request in flight (a FinishReason), or None."""
        flight = self.flights.get(request_id)
        return None if flight is None else flight.abort_reason

    async def abort(self, request_ids: Iterable[str], reason: int) -> list[str]:
        """Abort the given requests still in the engine; returns the ids actually aborted."""
        ids = []
        for request_id in request_ids:
            flight = self.flights.get(request_id)
            if flight is None or not self.engine.is_in_flight(request_id):
                continue
            if flight.abort_reason is None:
                flight.abort_reason = reason
            ids.append(request_id)
        return await self.engine.abort(ids)

    async def set_serving(self, is_serving: bool) -> None:
        """Readiness ("") and each service's health; the liveness entry is not touched."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if is_serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *SERVICE_NAMES):
            await self.health.set(name, status)

    async def drain(self, grace_s: float) -> int:
        """Stop admission, let requests in flight finish for `grace_s`, then abort the rest.

        Returns how many had to be aborted; they end with Finished(ABORTED_BY_SERVER). A Resume
        within the grace period ends the wait and aborts nothing (0).
        """
        if not self.is_draining:
            logger.info("drain_started", in_flight=len(self.flights), grace_s=grace_s)
            self.is_draining = True
            self._resumed = asyncio.Event()
        resumed = self._resumed
        await self.set_serving(False)
        waits = [asyncio.ensure_future(event.wait()) for event in (self._idle, resumed)]
        try:
            await asyncio.wait(waits, timeout=grace_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        if resumed.is_set():
            return 0
        aborted = await self.abort(list(self.flights), FinishReason.ABORTED_BY_SERVER)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), _FLUSH_S)
        logger.info("drain_done", aborted=len(aborted), left=len(self.flights))
        return len(aborted)

    async def resume(self) -> bool:
        """Undo a Drain: admission reopens and health is SERVING again; whether it was draining.

        A drain that shutdown started is final: raises ServerDrainingError.
        """
        if self.is_stopping:
            raise ServerDrainingError("the server is shutting down; Resume cannot undo that")
        if not self.is_draining:
            return False
        self.engine.check_health()
        logger.info("drain_resumed", in_flight=len(self.flights))
        self.is_draining = False
        self._resumed.set()
        await self.set_serving(True)
        if self.is_draining:  # a drain began while health was being set: it wins
            await self.set_serving(False)
        return True
