"""What the servicers share: the engine, the requests in flight, admission, health and drain."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from grpc_health.v1 import health, health_pb2

from asyncengine.engine.async_llm_engine import AsyncLLMEngine
from asyncengine.errors import DuplicateRequestError, EngineOverloadedError
from asyncengine.logging import get_logger
from asyncengine.sampling_params import SamplingParams
from asyncengine.server.auth import Tenants
from asyncengine.server.convert import FinishReason
from asyncengine.server.errors import ServerDrainingError
from asyncengine.server.options import ServeOptions
from asyncengine.v1 import control_pb2, generation_pb2

if TYPE_CHECKING:
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
    """One admitted request, from admission until its handler has sent its last message."""

    request_id: str
    prompt: str | list[int]
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    time_limit_s: float | None = None
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
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def max_in_flight(self) -> int:
        """Requests admitted at once: a full running batch plus the bounded waiting queue."""
        max_num_seqs = self.engine.engine.config.scheduler_config.max_num_seqs
        return max_num_seqs + self.options.max_queued_requests

    def admit(self, flights: list[Flight]) -> None:
        """Register `flights` (all or none); raise if the server cannot take them now."""
        if self.is_draining:
            raise ServerDrainingError("the server is draining and admits no new requests")
        self.engine.check_health()
        ids = [f.request_id for f in flights]
        for request_id in ids:
            if request_id in self.flights or ids.count(request_id) > 1:
                raise DuplicateRequestError(f"request_id {request_id!r} is already in flight")
        if len(self.flights) + len(flights) > self.max_in_flight:
            raise EngineOverloadedError(
                f"{len(self.flights)} requests in flight; the limit is {self.max_in_flight}",
                retry_after_s=self.options.retry_after,
            )
        for flight in flights:
            self.flights[flight.request_id] = flight
        self._idle.clear()

    def release(self, flight: Flight) -> None:
        """Forget a request whose handler is done with it (and make sure the engine is too)."""
        self.engine.abort(flight.request_id)  # a no-op unless the handler left early
        if self.flights.get(flight.request_id) is flight:
            del self.flights[flight.request_id]
        if not self.flights:
            self._idle.set()

    def abort_reason_of(self, request_id: str) -> int | None:
        """Why the server aborted a request in flight (a FinishReason), or None."""
        flight = self.flights.get(request_id)
        return None if flight is None else flight.abort_reason

    def abort(self, request_ids: Iterable[str], reason: int) -> list[str]:
        """Abort the given requests still in the engine; returns the ids actually aborted."""
        aborted = []
        for request_id in request_ids:
            flight = self.flights.get(request_id)
            if flight is None or not self.engine.engine.is_in_flight(request_id):
                continue
            if flight.abort_reason is None:
                flight.abort_reason = reason
            self.engine.abort(request_id)
            aborted.append(request_id)
        return aborted

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
        aborted = self.abort(list(self.flights), FinishReason.ABORTED_BY_SERVER)
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
