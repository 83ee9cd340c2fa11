"""The server core's per-call half: one call of either protocol (a gRPC stream or batch, an HTTP
completion), its engine requests from admission to release, its time limit, and one
`request_finished` log line per request, the same shape for both protocols."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from asyncengine.engine.request_stream import RequestStream
from asyncengine.errors import (
    DuplicateRequestError,
    EngineOverloadedError,
    InvalidRequestError,
)
from asyncengine.logging import get_logger
from asyncengine.lora.request import LoRARequest
from asyncengine.outputs import CompletionOutput, FinishReason, RequestOutput
from asyncengine.sampling_params import SamplingParams
from asyncengine.server.abort_reason import AbortReason
from asyncengine.server.errors import ClientStalledError
from asyncengine.server.state import Flight, ServerState

logger = get_logger(__name__)
LOGGED_ID_LEN = 64  # an over-long id is refused; its log lines carry only its start
# how a request that did not finish ended, when nothing else is known: its caller left
CLIENT_CANCELLED = "CLIENT_CANCELLED"

# a front end's translation of the engine's InvalidRequestError into its own field names;
# the index is the prompt's, None for the call as a whole (its size, its id)
InvalidTranslation = Callable[[InvalidRequestError, "int | None"], Exception]


def failure_label(exc: BaseException) -> str:
    """How a call that failed ended, for its log lines."""
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return CLIENT_CANCELLED  # the client cancelled or left, or its deadline passed
    if isinstance(exc, ClientStalledError):
        return "CLIENT_STALLED"
    return type(exc).__name__


def finish_label(completion: CompletionOutput, abort_reason: AbortReason | None) -> str:
    """A finished sample's reason in the log's words: the engine's, or why it was aborted."""
    finish = completion.finish
    assert finish is not None, "the sample has not finished"
    if finish is FinishReason.ABORTED and abort_reason is not None:
        return abort_reason.name
    return finish.name


def refusal_when_full(state: ServerState) -> EngineOverloadedError | None:
    """The refusal a new one-request call gets at once when admission is full (None: it may be
    admitted), before its request is parsed or checked: in a burst most calls end here, so
    this path builds nothing per call. The same error `ServerState.admit` raises."""
    num_admitted, limit = state.num_admitted, state.max_in_flight
    if num_admitted < limit or state.is_draining:  # draining: admit's own answer
        return None
    return EngineOverloadedError(
        f"{num_admitted} requests admitted; the limit is {limit}",
        retry_after_s=state.options.retry_after,
    )


def _no_translation(exc: InvalidRequestError, index: int | None) -> Exception:
    return exc


@dataclass
class _Tally:
    """What one request's log line reports, kept as its outputs are read."""

    num_completion_tokens: int = 0
    finishes: dict[int, str] = field(default_factory=dict)  # sample index -> finish label
    last: RequestOutput | None = None  # its latest output (timings, preemptions)
    is_finished: bool = False  # its final output was read


class Call:
    """The engine requests of one call, one per prompt: admitted together (all or none),
    handed to the engine one by one, read as they come, released together however the call
    ends (`close`: a request still running is aborted then, and each one's line is logged).

    `time_limit_s` bounds every request of the call: past it, those still running are aborted
    with AbortReason.TIME_LIMIT and end with their final output.
    """

    def __init__(
        self,
        state: ServerState,
        protocol: str,
        request_ids: Sequence[str],
        tenant: str | None = None,
        time_limit_s: float | None = None,
    ) -> None:
        self._state = state
        self.protocol = protocol  # "grpc" or "http": a field of the log line
        self.tenant = tenant
        self._time_limit_s = time_limit_s
        self._requested = [Flight(request_id, tenant) for request_id in request_ids]
        self.flights: list[Flight] = []  # once admitted
        self.streams: list[RequestStream] = []  # of the requests the engine took, in order
        self._failure: str | None = None  # how the call failed, when it did
        self._tallies: list[_Tally] = []
        self._waits: dict[asyncio.Task[RequestOutput | None], int] = {}
        self._is_timed_out = False
        self._is_closed = False

    # -- admission ---------------------------------------------------------------------------

    async def open(
        self,
        prompts: Sequence[str | list[int]],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        invalid: InvalidTranslation = _no_translation,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Admit every prompt and hand it to the engine (with `lora_request`: to that adapter);
        `invalid` names a bad field the front end's way. On failure the call is closed:
        whatever was taken is given back."""
        assert len(prompts) == len(self._requested), "one request id per prompt"
        try:
            await self._open(prompts, params, priority, cache_salt, invalid, lora_request)
        except BaseException:
            await self.close()
            raise

    async def _open(
        self,
        prompts: Sequence[str | list[int]],
        params: SamplingParams,
        priority: int,
        cache_salt: str | None,
        invalid: InvalidTranslation,
        lora_request: LoRARequest | None,
    ) -> None:
        state = self._state
        try:
            state.admit(self._requested)
        except InvalidRequestError as exc:
            raise invalid(exc, None) from None
        self.flights = self._requested
        num_entering = len(self.flights)
        try:
            for index, (flight, prompt) in enumerate(zip(self.flights, prompts)):
                # its adapter held until the engine has the request: unloaded since the caller
                # named it, the request is refused (the engine would load it again)
                async with state.adapters.handing(lora_request):
                    # the slot passes to the engine's count here: add_request takes the
                    # request into it before its first await, so no other call sees the slot
                    # counted twice (refused with "289 admitted; the limit is 288") or not at all
                    num_entering -= 1
                    state.entered()
                    try:
                        stream = await state.engine.add_request(
                            flight.engine_id,
                            prompt,
                            params,
                            priority,
                            cache_salt=cache_salt,
                            tenant=self.tenant,
                            strict_max_tokens=True,
                            lora_request=lora_request,
                        )
                    except DuplicateRequestError:
                        # the engine's id is in use (by a caller of the engine itself): named by
                        # the caller's id, never the engine's, which carries the tenant's tag
                        raise DuplicateRequestError(flight.request_id) from None
                    except InvalidRequestError as exc:
                        raise invalid(exc, index) from None
                self.streams.append(stream)
                self._tallies.append(_Tally())
        finally:
            for _ in range(num_entering):  # admitted, never handed over: their slots back
                state.entered()

    # -- outputs -----------------------------------------------------------------------------

    @property
    def is_done(self) -> bool:
        """Every request has its final output."""
        return all(tally.is_finished for tally in self._tallies)

    async def next_outputs(self, timeout: float | None) -> list[tuple[int, RequestOutput]]:
        """The outputs ready within `timeout` seconds (none: silence), from any open request,
        as (prompt index, output). Past the time limit the call's requests are aborted (their
        final outputs come next)."""
        deadline = self._deadline()
        if deadline is not None:
            left = max(0.0, deadline - time.monotonic())
            timeout = left if timeout is None else min(timeout, left)
        ready = await self._wait(timeout)
        if not ready and deadline is not None and time.monotonic() >= deadline:
            self._is_timed_out = True
            unfinished = [
                flight
                for flight, tally in zip(self.flights, self._tallies)
                if not tally.is_finished
            ]
            await self._state.abort(unfinished, AbortReason.TIME_LIMIT)
            ready = await self._wait(0)
        return ready

    def _deadline(self) -> float | None:
        if self._time_limit_s is None or self._is_timed_out or not self.flights:
            return None
        return self.flights[0].admitted_at + self._time_limit_s

    async def _wait(self, timeout: float | None) -> list[tuple[int, RequestOutput]]:
        if len(self.streams) == 1:  # the common case: no task per wait
            out = await self.streams[0].get(timeout)
            return [] if out is None else [self._took(0, out)]
        for index, stream in enumerate(self.streams):
            if not self._tallies[index].is_finished and index not in self._waits.values():
                self._waits[asyncio.ensure_future(stream.get())] = index
        done, _ = await asyncio.wait(
            list(self._waits), timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        ready = []
        for task in done:
            index = self._waits.pop(task)
            out = task.result()  # the request's error, if it failed
            assert out is not None
            ready.append(self._took(index, out))
        return sorted(ready, key=lambda item: item[0])

    def _took(self, index: int, out: RequestOutput) -> tuple[int, RequestOutput]:
        tally = self._tallies[index]
        tally.last = out
        tally.num_completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        abort_reason = self.flights[index].abort_reason
        for completion in out.outputs:
            if completion.finish is not None:
                tally.finishes[completion.index] = finish_label(completion, abort_reason)
        tally.is_finished = out.finished
        return index, out

    async def collect(self) -> list[RequestOutput]:
        """Every request's final output (FINAL_ONLY requests: their one output), in order."""
        finals: list[RequestOutput | None] = [None] * len(self.streams)
        while not self.is_done:
            for index, out in await self.next_outputs(None):
                finals[index] = out
        assert all(out is not None for out in finals)
        return [out for out in finals if out is not None]

    @property
    def request_ids(self) -> list[str]:
        """The callers' ids (the engine knows them by `Flight.engine_id`)."""
        return [flight.request_id for flight in self._requested]

    def abort_reason(self, index: int) -> AbortReason | None:
        """Why the server aborted the call's `index`-th request, if it did."""
        return self.flights[index].abort_reason

    def num_completion_tokens(self, index: int | None = None) -> int:
        """Tokens generated for one request of the call (None: for all of them)."""
        tallies = self._tallies if index is None else [self._tallies[index]]
        return sum(tally.num_completion_tokens for tally in tallies)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(stream.prompt_token_ids) for stream in self.streams)

    # -- release -----------------------------------------------------------------------------

    def fail(self, exc: BaseException) -> None:
        """Say how the call failed (its lines report that, not how its requests ended)."""
        if self._failure is None:
            self._failure = failure_label(exc)

    async def close(self) -> None:
        """Release every flight (aborting what still runs) and log one line per request."""
        if self._is_closed:
            return
        self._is_closed = True
        for task in self._waits:
            task.cancel()
        for index, flight in enumerate(self.flights):
            await self._state.release(flight)
            if index < len(self.streams):
                self._log(flight, self.streams[index], self._tallies[index])

    def _log(self, flight: Flight, stream: RequestStream, tally: _Tally) -> None:
        if self._failure is not None:
            reason = self._failure
        elif tally.is_finished:
            reason = ",".join(sorted(set(tally.finishes.values())))
        else:  # the call ended, with no failure, before the request did: its caller left
            reason = CLIENT_CANCELLED
        metrics = tally.last.metrics if tally.last is not None else None
        ttft = 0.0
        if metrics is not None and metrics.first_token_time is not None:
            ttft = metrics.first_token_time - metrics.arrival_time
        logger.info(
            "request_finished",
            protocol=self.protocol,
            request_id=flight.request_id[:LOGGED_ID_LEN],
            tenant=self.tenant,
            finish_reason=reason,
            prompt_tokens=len(stream.prompt_token_ids),
            completion_tokens=tally.num_completion_tokens,
            time_to_first_token_s=round(ttft, 4),
            total_s=round(time.monotonic() - flight.admitted_at, 4),
            preemptions=metrics.num_preemptions if metrics is not None else 0,
        )
