"""What every HTTP handler shares: the server's context (engine, state, model names, tenants),
and the HTTP side of a call (`asyncengine.server.call.Call`, the server core's: admission,
release and the log line are there): its whole response, its SSE stream, its usage."""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from starlette.requests import Request

from asyncengine.engine.async_llm_engine import AsyncLLMEngine
from asyncengine.errors import InvalidRequestError, LoRANotFoundError
from asyncengine.lora.request import LoRARequest
from asyncengine.outputs import RequestOutput
from asyncengine.sampling_params import SamplingParams
from asyncengine.server.auth import CONTROL_DISABLED_MESSAGE, Tenants, carries_token
from asyncengine.server.call import Call
from asyncengine.server.errors import (
    ClientStalledError,
    PermissionDeniedError,
    UnauthenticatedError,
)
from asyncengine.server.http import protocol, sse
from asyncengine.server.http.errors import InvalidParamError, ModelNotFoundError
from asyncengine.server.http.params import TokenTexts, param_error
from asyncengine.server.options import parse_auth_token
from asyncengine.server.state import ServerState

T = TypeVar("T")


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
        template = None
        if options.chat_template:
            template = Path(options.chat_template).read_text(encoding="utf-8")
        return cls(
            state=state,
            engine=engine,
            model_name=state.model_name,
            accepted_models=state.model_names,
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

    def authorize_operator(self, request: Request) -> None:
        """UnauthenticatedError unless the request carries a --control-auth-token."""
        header = request.headers.get("authorization")
        metadata = [("authorization", header)] if header else []
        if not carries_token(metadata, self.state.options.control_auth_tokens):
            raise UnauthenticatedError("a valid Control bearer token is required for /metrics")

    def authorize_control(self, request: Request) -> None:
        """Control's rule, as on gRPC: a --control-auth-token when the server has one; with
        tenant tokens and no Control token, off for every token (PermissionDeniedError)."""
        control_tokens = self.state.options.control_auth_tokens
        if not control_tokens:
            if self.tokens:
                raise PermissionDeniedError(CONTROL_DISABLED_MESSAGE)
            return
        header = request.headers.get("authorization")
        metadata = [("authorization", header)] if header else []
        if not carries_token(metadata, control_tokens):
            raise UnauthenticatedError(
                f"a valid Control bearer token is required for {request.url.path}"
            )

    def check_model(self, model: str | None) -> None:
        """ModelNotFoundError unless `model` is unset, the base model or an adapter."""
        self.resolve_model(model)

    def resolve_model(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the base model (or no name)."""
        if model is None or model in self.accepted_models:
            return None
        adapter = self.state.adapters.get(model)
        if adapter is None:
            raise ModelNotFoundError(
                f"the model {model!r} does not exist: this server serves {self.model_name!r}"
                + ("" if not self.state.adapters.all() else " and its LoRA adapters (/v1/models)")
            )
        return adapter

    def response_model(self, adapter: LoRARequest | None) -> str:
        """What a response's `model` says: the adapter's name, or the served model's."""
        return self.model_name if adapter is None else adapter.lora_name


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


async def open_call(
    ctx: HttpContext,
    request_id: str,
    tenant: str | None,
    table: dict[str, str],
    prompts: list[str | list[int]],
    params: SamplingParams,
    priority: int,
    cache_salt: str | None,
    lora_request: LoRARequest | None = None,
) -> Call:
    """One HTTP call's engine requests, one per prompt, admitted and handed to the engine by
    the server core (as gRPC's are); bad input raises InvalidParamError naming OpenAI's field."""
    many = len(prompts) > 1
    ids = [f"{request_id}-{i}" for i in range(len(prompts))] if many else [request_id]

    def invalid(exc: InvalidRequestError, index: int | None) -> Exception:
        prefix = f"{table['prompt']}[{index}]:" if many and index is not None else ""
        return param_error(exc, table, prefix)

    call = Call(ctx.state, "http", ids, tenant)
    try:
        await call.open(
            prompts, params, priority, cache_salt, invalid=invalid, lora_request=lora_request
        )
    except LoRANotFoundError as exc:  # unloaded since the name was resolved: `model`'s 404
        raise ModelNotFoundError(str(exc)) from None
    return call


async def call_finals(call: Call, request: Request) -> list[RequestOutput] | None:
    """Every request's final output; None when the client left first. Closes the call."""
    try:
        return await until_disconnected(request, call.collect())
    except ClientDisconnectedError:
        return None
    finally:
        await call.close()


def event_stream(
    ctx: HttpContext, call: Call, events: AsyncGenerator[str, None], headers: dict[str, str]
) -> sse.EventStream:
    """The SSE response over `events`, which closes `call` however it ends."""
    metrics = ctx.state.metrics

    def on_stall(exc: ClientStalledError) -> None:
        call.fail(exc)
        if metrics is not None:
            metrics.on_stalled_stream()

    return sse.EventStream(
        events,
        on_close=call.close,
        stall_timeout_s=ctx.state.options.stall_timeout,
        on_stall=on_stall,
        headers=headers,
    )


def call_usage(call: Call, num_completion_tokens: int | None = None) -> protocol.Usage:
    """Token counts of the call (`num_completion_tokens` overrides what was generated)."""
    num_prompt = call.num_prompt_tokens
    if num_completion_tokens is None:
        num_completion_tokens = call.num_completion_tokens()
    return protocol.Usage(
        prompt_tokens=num_prompt,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt + num_completion_tokens,
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
