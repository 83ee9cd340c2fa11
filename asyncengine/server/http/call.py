"""What every HTTP handler shares: the server's context (engine, state, model names, tenants)
and `Call`, the engine requests of one HTTP call from admission to release."""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import structlog
from starlette.requests import Request

from asyncengine.engine.async_llm_engine import AsyncLLMEngine, RequestStream
from asyncengine.errors import InvalidRequestError
from asyncengine.logging import get_logger
from asyncengine.outputs import RequestOutput
from asyncengine.sampling_params import SamplingParams
from asyncengine.server.auth import Tenants
from asyncengine.server.http import protocol, sse
from asyncengine.server.http.errors import InvalidParamError, ModelNotFoundError
from asyncengine.server.http.params import FINISH_REASONS, TokenTexts, param_error
from asyncengine.server.options import parse_auth_token
from asyncengine.server.state import Flight, ServerState

T = TypeVar("T")
logger = get_logger(__name__)
_LOGGED_ID_LEN = 64


class ClientDisconnectedError(ConnectionError):
    """The client closed the connection before its response was ready."""


@dataclass
class HttpContext:
    """The server as the HTTP handlers see it; one per HTTP server."""

    state: ServerState
    engine: AsyncLLMEngine
    model_name: str  # what /v1/models reports and responses name
    accepted_models: frozenset[str]
    chat_template: str | None  # --chat-template's text, in place of the tokenizer's
    texts: TokenTexts
    tenants: Tenants
    tokens: tuple[str, ...]  # accepted bearer tokens (the tenants' ones, as for Generation)
    started_at: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def create(cls, state: ServerState) -> HttpContext:
        options, engine = state.options, state.engine
        model = engine.config.model_config.model
        name = options.served_model_name or model
        template = None
        if options.chat_template:
            template = Path(options.chat_template).read_text(encoding="utf-8")
        return cls(
            state=state,
            engine=engine,
            model_name=name,
            accepted_models=frozenset({name, model}),
            chat_template=template,
            texts=TokenTexts(engine),
            tenants=state.tenants,
            tokens=tuple(parse_auth_token(value)[1] for value in options.auth_tokens),
        )

    def authorize(self, request: Request) -> str | None:
        """The caller's tenant (None without --auth-token); UnauthenticatedError without a
        valid `Authorization: Bearer` token. Compared in constant time, as gRPC's are."""
        header = request.headers.get("authorization")
        metadata = [("authorization", header)] if header else []
        if self.tokens:
            _, _, token = (header or "").partition(" ")
            token = token.strip()
            # every token compared, so timing reveals nothing; identity() then names the tenant
            if sum(hmac.compare_digest(token.encode(), t.encode()) for t in self.tokens) == 0:
                metadata = []
        return self.tenants.identity(metadata)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.accepted_models:
            raise ModelNotFoundError(
                f"the model {model!r} does not exist: this server serves {self.model_name!r}"
            )


def request_id_of(request: Request, prefix: str) -> tuple[str, str]:
    """(the engine's request id, the response's id): the x-request-id header names both."""
    given = request.headers.get("x-request-id")
    request_id = given or uuid.uuid4().hex
    return request_id, f"{prefix}-{request_id}"


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientDisconnectedError as soon as the client goes away (the work
    is cancelled then): a plain response is not cancelled by the server on its own."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientDisconnectedError("the client disconnected")
    finally:
        watcher.cancel()
        task.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    # the body is read: the next message the server gives is the disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Call:
    """The engine requests of one HTTP call, one per prompt: admitted together (all or none,
    through the same ServerState as gRPC), read as they come, released together however the
    call ends (`close`: a request still running is aborted then)."""

    def __init__(
        self, ctx: HttpContext, request_id: str, tenant: str | None, table: dict[str, str]
    ) -> None:
        self._ctx = ctx
        self._state = ctx.state
        self.request_id = request_id
        self._tenant = tenant
        self._table = table
        self.flights: list[Flight] = []
        self.streams: list[RequestStream] = []
        self.num_completion_tokens: list[int] = []
        self.finish_labels: list[str] = []
        self.ended_by = "CLIENT_CANCELLED"  # how unfinished requests are logged at close
        self._waits: dict[asyncio.Task[RequestOutput | None], int] = {}
        self._is_closed = False

    async def open(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams,
        priority: int,
        cache_salt: str | None,
    ) -> None:
        """Admit every prompt and hand it to the engine; bad input raises InvalidParamError.

        On failure the call is closed: whatever was taken is given back.
        """
        try:
            await self._open(prompts, params, priority, cache_salt)
        except BaseException:
            await self.close()
            raise

    async def _open(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams,
        priority: int,
        cache_salt: str | None,
    ) -> None:
        many = len(prompts) > 1
        ids = [f"{self.request_id}-{i}" for i in range(len(prompts))] if many else [self.request_id]
        flights = [Flight(request_id) for request_id in ids]
        try:
            self._state.admit(flights)
        except InvalidRequestError as exc:
            raise param_error(exc, self._table) from None
        self.flights = flights
        num_entering = len(flights)
        try:
            for index, (flight, prompt) in enumerate(zip(flights, prompts)):
                try:
                    stream = await self._ctx.engine.add_request(
                        flight.request_id,
                        prompt,
                        params,
                        priority,
                        cache_salt=cache_salt,
                        tenant=self._tenant,
                        strict_max_tokens=True,
                    )
                except InvalidRequestError as exc:
                    prefix = f"{self._table['prompt']}[{index}]:" if many else ""
                    raise param_error(exc, self._table, prefix) from None
                finally:
                    num_entering -= 1
                    self._state.entered()
                self.streams.append(stream)
                self.num_completion_tokens.append(0)
                self.finish_labels.append("")
        finally:
            for _ in range(num_entering):  # admitted, never handed over: their slots back
                self._state.entered()

    @property
    def is_done(self) -> bool:
        return all(label for label in self.finish_labels)

    async def next_outputs(self, timeout: float | None) -> list[tuple[int, RequestOutput]]:
        """The outputs ready within `timeout` seconds (none: silence), from any open request."""
        if len(self.streams) == 1:  # the common case: no task per wait
            out = await self.streams[0].get(timeout)
            return [] if out is None else [self._took(0, out)]
        for index, stream in enumerate(self.streams):
            if not self.finish_labels[index] and index not in self._waits.values():
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
        self.num_completion_tokens[index] += sum(len(c.token_ids) for c in out.outputs)
        if out.finished:
            finishes = {FINISH_REASONS[c.finish] for c in out.outputs if c.finish is not None}
            self.finish_labels[index] = ",".join(sorted(finishes)) or "stop"
        return index, out

    async def collect(self) -> list[RequestOutput]:
        """Every request's final output (FINAL_ONLY requests: their one output), in order."""
        finals: list[RequestOutput | None] = [None] * len(self.streams)
        while not self.is_done:
            for index, out in await self.next_outputs(None):
                finals[index] = out
        assert all(out is not None for out in finals)
        return [out for out in finals if out is not None]

    async def finals(self, request: Request) -> list[RequestOutput] | None:
        """Every request's final output; None when the client left first. Closes the call."""
        try:
            return await until_disconnected(request, self.collect())
        except ClientDisconnectedError:
            return None
        finally:
            await self.close()

    def event_stream(
        self, events: AsyncGenerator[str, None], headers: dict[str, str]
    ) -> sse.EventStream:
        """The SSE response over `events`, which closes this call however it ends."""
        metrics = self._state.metrics

        def on_stall() -> None:
            self.ended_by = "CLIENT_STALLED"
            if metrics is not None:
                metrics.on_stalled_stream()

        return sse.EventStream(
            events,
            on_close=self.close,
            stall_timeout_s=self._state.options.stall_timeout,
            on_stall=on_stall,
            headers=headers,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(stream.prompt_token_ids) for stream in self.streams)

    def usage(self, num_completion_tokens: int | None = None) -> protocol.Usage:
        """Token counts of the call (`num_completion_tokens` overrides what was generated)."""
        num_prompt = self.num_prompt_tokens
        num_completion = (
            sum(self.num_completion_tokens)
            if num_completion_tokens is None
            else num_completion_tokens
        )
        return protocol.Usage(
            prompt_tokens=num_prompt,
            completion_tokens=num_completion,
            total_tokens=num_prompt + num_completion,
        )

    async def close(self) -> None:
        """Release every flight (aborting what still runs) and log one line per request."""
        if self._is_closed:
            return
        self._is_closed = True
        for task in self._waits:
            task.cancel()
        for index, flight in enumerate(self.flights):
            await self._state.release(flight)
            if index >= len(self.streams):
                continue
            with structlog.contextvars.bound_contextvars(
                request_id=flight.request_id[:_LOGGED_ID_LEN]
            ):
                logger.info(
                    "request_finished",
                    front_end="http",
                    finish_reason=self.finish_labels[index] or self.ended_by,
                    prompt_tokens=len(self.streams[index].prompt_token_ids),
                    completion_tokens=self.num_completion_tokens[index],
                    total_s=round(time.monotonic() - flight.admitted_at, 4),
                )


def check_prompt_list(prompt: object, param: str) -> list[str | list[int]]:
    """A completion's `prompt` as a list of prompts (text or token ids), at least one."""
    if isinstance(prompt, str):
        return [prompt]
    assert isinstance(prompt, list)
    if not prompt:
        raise InvalidParamError(param, "at least one prompt is required")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)
