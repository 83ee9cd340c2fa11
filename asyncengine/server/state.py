"""The server core's shared half: the engine, the requests in flight, admission, abort and drain.

Both front ends (gRPC and HTTP) use it through `Call` (call.py) and know nothing of each other;
nothing here imports a front end. Why a request was aborted is an `AbortReason`
(abort_reason.py), the server's own enum, never a proto value.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncengine.engine.async_llm_engine import AsyncLLMEngine
from asyncengine.engine.validator import MAX_REQUEST_ID_LEN, check_request_id
from asyncengine.errors import DuplicateRequestError, EngineOverloadedError, InvalidRequestError
from asyncengine.logging import get_logger
from asyncengine.server.abort_reason import AbortReason
from asyncengine.server.auth import Tenants
from asyncengine.server.errors import ServerDrainingError
from asyncengine.server.lora import LoRAAdapters
from asyncengine.server.options import (
    ServeOptions,
    default_served_model_name,
    message_size_limit,
)

if TYPE_CHECKING:
    from asyncengine.server.metrics import ServerMetrics

logger = get_logger(__name__)

# the health name a liveness probe asks for: SERVING from start until shutdown, drain included
# (readiness, which drain turns off, is "" and the services' names: health.py)
LIVENESS_SERVICE = "liveness"
# how long handlers get to send their final messages once their requests are aborted
_FLUSH_S = 5.0


@dataclass
class Flight:
    """One request of an open call, from admission until its handler has sent its last message.

    `request_id` is the caller's, unique within its `tenant` only; `engine_id` is the one the
    engine knows it by, unique across tenants (`engine_request_id`).
    """

    request_id: str
    tenant: str | None = None
    abort_reason: AbortReason | None = None
    admitted_at: float = field(default_factory=time.monotonic)
    engine_id: str = field(init=False)

    def __post_init__(self) -> None:
        self.engine_id = engine_request_id(self.tenant, self.request_id)


_TENANT_TAG_LEN = 16  # hex digits of sha256: 64 bits tell tenants apart, as their digests do


def engine_request_id(tenant: str | None, request_id: str) -> str:
    """The engine's id of a tenant's request: one per (tenant, id), so tenants may use the same
    ids and never meet in the engine's one namespace. It ends in a digest of the tenant (fixed
    length, no name); an id too long to carry it whole is carried as its own digest. Without
    tenants (no --auth-token) it is the caller's id."""
    if tenant is None:
        return request_id
    tag = hashlib.sha256(tenant.encode("utf-8", "surrogatepass")).hexdigest()[:_TENANT_TAG_LEN]
    if len(request_id) + 1 + len(tag) > MAX_REQUEST_ID_LEN:
        # the caller's id is checked before (ServerState.admit); the engine's must fit its bound
        request_id = "#" + hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{request_id}@{tag}"


# told whether the server is ready (admitting) whenever that changes: gRPC's health
ReadinessListener = Callable[[bool], Awaitable[None]]


class ServerState:
    """The engine plus the server's own bookkeeping, shared by every call of every protocol;
    lives on the event loop's thread."""

    def __init__(self, engine: AsyncLLMEngine, options: ServeOptions) -> None:
        self.engine = engine
        self.options = options
        self.started_at = time.monotonic()
        # by engine id: one per (tenant, caller's id); a tenant can neither see nor take another's
        self.flights: dict[str, Flight] = {}
        self.is_draining = False
        self.is_stopping = False  # set by shutdown: its drain is final, no Resume undoes it
        self._resumed = asyncio.Event()  # a new one per drain; Resume sets it
        self.tenants = Tenants.from_options(options)
        self.metrics: ServerMetrics | None = None
        self._readiness_listeners: list[ReadinessListener] = []
        self._num_entering = 0  # admitted, not yet the engine's
        self._tasks: set[asyncio.Task[Any]] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @functools.cached_property
    def model_name(self) -> str:
        """The name /v1/models, GetModelInfo, responses and the metrics give the model."""
        path = self.engine.config.model_config.model
        return self.options.served_model_name or default_served_model_name(path)

    @functools.cached_property
    def adapters(self) -> LoRAAdapters:
        """The LoRA adapters served by name: both front ends resolve, load and unload them here."""
        allow_updates = self.options.allow_runtime_lora_updating
        return LoRAAdapters(self.engine, self.model_names, allow_updates)

    @functools.cached_property
    def max_message_size(self) -> int:
        """The bytes of one gRPC message (either way) or HTTP body: the one value both ports use."""
        engine = self.engine
        max_prompt_bytes = engine.config.scheduler_config.max_prompt_bytes
        return message_size_limit(self.options, engine.max_model_len, max_prompt_bytes)

    @property
    def model_names(self) -> frozenset[str]:
        """The names a request may give: the served one, and the model's path as before."""
        return frozenset({self.model_name, self.engine.config.model_config.model})

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
            check_request_id(flight.request_id)  # the caller's id, by the engine's rule
            if flight.engine_id in self.flights or flight.engine_id in seen:
                raise DuplicateRequestError(flight.request_id)
            seen.add(flight.engine_id)
        if self.num_admitted + len(flights) > self.max_in_flight:
            raise EngineOverloadedError(
                f"{self.num_admitted} requests admitted; the limit is {self.max_in_flight}",
                retry_after_s=self.options.retry_after,
            )
        for flight in flights:
            self.flights[flight.engine_id] = flight
        self._num_entering += len(flights)
        self._idle.clear()

    def check_batch_size(self, num_requests: int) -> None:
        """A batch larger than can ever be admitted is the caller's mistake, not a retry."""
        if num_requests > self.max_in_flight:
            raise InvalidRequestError(
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
            await self.engine.abort(flight.engine_id)
        finally:
            if self.flights.get(flight.engine_id) is flight:
                del self.flights[flight.engine_id]
            if not self.flights:
                self._idle.set()

    def abort_reason_of(self, engine_id: str) -> AbortReason | None:
        """Why the server aborted a request in flight (by its engine id), or None."""
        flight = self.flights.get(engine_id)
        return None if flight is None else flight.abort_reason

    async def abort(self, flights: Iterable[Flight], reason: AbortReason) -> list[Flight]:
        """Abort the given flights still in the engine; returns those actually aborted."""
        taken = {}
        for flight in flights:
            if self.flights.get(flight.engine_id) is not flight:
                continue
            if not self.engine.is_in_flight(flight.engine_id):
                continue
            if flight.abort_reason is None:
                flight.abort_reason = reason
            taken[flight.engine_id] = flight
        return [taken[engine_id] for engine_id in await self.engine.abort(list(taken))]

    async def abort_ids(
        self, request_ids: Iterable[str], tenant: str | None, *, is_operator: bool = False
    ) -> list[str]:
        """Abort requests by the callers' ids (Control.Abort); returns the ids aborted.

        A tenant reaches its own requests only: another's id is to it an unknown one. An
        operator (a Control token, or a server without tenant tokens) reaches every tenant's
        request by that id.
        """
        if is_operator:
            by_id: dict[str, list[Flight]] = {}
            for flight in self.flights.values():
                by_id.setdefault(flight.request_id, []).append(flight)
            chosen = [flight for rid in dict.fromkeys(request_ids) for flight in by_id.get(rid, ())]
        else:
            found = (self.flights.get(engine_request_id(tenant, rid)) for rid in request_ids)
            chosen = [flight for flight in found if flight is not None]
        aborted = await self.abort(chosen, AbortReason.CANCELLED)
        return list(dict.fromkeys(flight.request_id for flight in aborted))

    # -- readiness and drain -----------------------------------------------------------------

    def on_readiness(self, listener: ReadinessListener) -> None:
        """Call `listener(is_ready)` whenever a drain or a Resume changes readiness."""
        self._readiness_listeners.append(listener)

    async def _announce(self, is_ready: bool) -> None:
        for listener in self._readiness_listeners:
            await listener(is_ready)

    async def drain(self, grace_s: float) -> int:
        """Stop admission, let requests in flight finish for `grace_s`, then abort the rest.

        Returns how many had to be aborted; they end as ABORTED_BY_SERVER. A Resume within the
        grace period ends the wait and aborts nothing (0).
        """
        if not self.is_draining:
            logger.info("drain_started", in_flight=len(self.flights), grace_s=grace_s)
            self.is_draining = True
            self._resumed = asyncio.Event()
        resumed = self._resumed
        await self._announce(False)
        waits = [asyncio.ensure_future(event.wait()) for event in (self._idle, resumed)]
        try:
            await asyncio.wait(waits, timeout=grace_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        if resumed.is_set():
            return 0
        aborted = await self.abort_all()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), _FLUSH_S)
        logger.info("drain_done", aborted=len(aborted), left=len(self.flights))
        return len(aborted)

    async def abort_all(self) -> list[str]:
        """Abort every request in flight, as the server's decision (drain, a second signal)."""
        aborted = await self.abort(list(self.flights.values()), AbortReason.ABORTED_BY_SERVER)
        return [flight.request_id for flight in aborted]

    async def resume(self) -> bool:
        """Undo a Drain: admission reopens and the server is ready again; whether it was draining.

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
        await self._announce(True)
        if self.is_draining:  # a drain began while readiness was being announced: it wins
            await self._announce(False)
        return True
