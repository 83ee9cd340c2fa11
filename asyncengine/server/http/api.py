"""The FastAPI application: OpenAI's routes plus health, version, tokenize, detokenize and
metrics, every failure answered in OpenAI's error shape (errors.py)."""

from __future__ import annotations

import asyncio
import contextlib
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import asyncengine
from asyncengine.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    LoRAInUseError,
    LoRANotFoundError,
    RequestFailedError,
)
from asyncengine.lora.request import LoRARequest
from asyncengine.server.errors import (
    PermissionDeniedError,
    ServerDrainingError,
    UnauthenticatedError,
)
from asyncengine.server.http import protocol
from asyncengine.server.http.body import BodyBounds, parse_body, too_large
from asyncengine.server.http.call import HttpContext
from asyncengine.server.http.chat import create_chat_completion, render_chat
from asyncengine.server.http.completions import create_completion
from asyncengine.server.http.errors import (
    BodyTooLargeError,
    InvalidParamError,
    ModelNotFoundError,
    error_body,
    error_response,
)
from asyncengine.server.state import ServerState
from asyncengine.server.vllm_worker import info

_HANDLED = (
    InvalidRequestError,
    EngineOverloadedError,
    ServerDrainingError,
    EngineDeadError,
    RequestFailedError,
    UnauthenticatedError,
    PermissionDeniedError,
    ModelNotFoundError,
    LoRANotFoundError,
    LoRAInUseError,
    BodyTooLargeError,
    RequestValidationError,
    HTTPException,
)


def build_app(state: ServerState) -> FastAPI:
    """The HTTP API of one server, over its engine and state (shared with gRPC)."""
    ctx = HttpContext.create(state)
    app = FastAPI(title="asyncengine", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_bytes=state.max_message_size)

    async def on_error(request: Request, exc: Exception) -> Response:
        return error_response(exc)

    for kind in _HANDLED:
        app.add_exception_handler(kind, on_error)
    app.add_exception_handler(Exception, on_error)  # logged there, answered in OpenAI's shape
    _add_openai_routes(app, ctx)
    _add_server_routes(app, ctx)
    return app


def _add_openai_routes(app: FastAPI, ctx: HttpContext) -> None:
    state = ctx.state
    bounds = BodyBounds.of(state)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        ctx.authorize(request)  # before any of the body is read
        body = await parse_body(request, protocol.CompletionRequest, bounds)
        return await create_completion(ctx, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        ctx.authorize(request)
        body = await parse_body(request, protocol.ChatRequest, bounds)
        return await create_chat_completion(ctx, body, request)

    def card(adapter: LoRARequest | None = None) -> protocol.ModelCard:
        """The base model's card, or an adapter's (vLLM's: its directory as root, its base
        model as parent)."""
        base = protocol.ModelCard(
            id=ctx.model_name,
            created=ctx.started_at,
            root=state.engine.config.model_config.model,
            max_model_len=state.engine.max_model_len,
        )
        if adapter is None:
            return base
        changes = {"id": adapter.lora_name, "root": adapter.lora_path, "parent": ctx.model_name}
        return base.model_copy(update=changes)

    @app.get("/v1/models")
    async def models(request: Request) -> protocol.ModelList:
        ctx.authorize(request)
        return protocol.ModelList(data=[card(), *map(card, state.adapters.all())])

    # `:path`: the served name may be a filesystem path, slashes and all
    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> protocol.ModelCard:
        ctx.authorize(request)
        return card(ctx.resolve_model(model_id))

    if state.adapters.allow_runtime_updates:  # vLLM's routes exist only when allowed, too
        _add_lora_routes(app, ctx)


def _add_lora_routes(app: FastAPI, ctx: HttpContext) -> None:
    """vLLM's run-time adapter routes, behind the Control token (Control's rule, as on gRPC)."""
    adapters = ctx.state.adapters
    bounds = BodyBounds.of(ctx.state)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        ctx.authorize_control(request)
        body = await parse_body(request, protocol.LoadLoRAAdapterRequest, bounds)
        await adapters.load(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter {body.lora_name!r} added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        ctx.authorize_control(request)
        body = await parse_body(request, protocol.UnloadLoRAAdapterRequest, bounds)
        await adapters.unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter {body.lora_name!r} removed successfully.")


def _add_router_routes(app: FastAPI, ctx: HttpContext) -> None:
    """What HTTP-mode routers (SMG, sglang-router) probe: the gRPC worker service's model,
    server and load facts as JSON, under each name they ask for. Behind the Control token,
    as Control's GetModelInfo / GetServerInfo / GetLoads are: every tenant's load is here."""
    state = ctx.state

    async def model_info(request: Request) -> dict[str, Any]:
        ctx.authorize_control(request)
        return info.as_json(info.model_info(state))

    async def server_info(request: Request) -> dict[str, Any]:
        ctx.authorize_control(request)
        return info.as_json(info.server_info(state))

    async def loads(request: Request) -> dict[str, Any]:
        ctx.authorize_control(request)
        return info.as_json(info.loads(state))

    for path in ("/get_model_info", "/model_info"):
        app.add_api_route(path, model_info, methods=["GET"])
    for path in ("/get_server_info", "/server_info"):
        app.add_api_route(path, server_info, methods=["GET"])
    for path in ("/get_load", "/get_loads", "/v1/loads", "/loads"):
        app.add_api_route(path, loads, methods=["GET"])


def _add_server_routes(app: FastAPI, ctx: HttpContext) -> None:
    """Health, version and metrics for probes and scrapers; vLLM's tokenizer routes."""
    state = ctx.state
    bounds = BodyBounds.of(state)

    @app.get("/health")
    async def health() -> Response:
        if state.engine.errored:
            body = error_body("the engine is dead", "server_error", code="engine_dead")
            return JSONResponse(body, 503)
        if state.is_draining:
            body = error_body("the server is draining", "server_error", code="draining")
            return JSONResponse(body, 503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": asyncengine.__version__}

    _add_router_routes(app, ctx)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if state.options.auth_metrics:
            ctx.authorize_operator(request)
        if state.metrics is None:
            raise HTTPException(404, "metrics are off")
        # cheap reads of counters and the engine's stats, made on the loop that owns them
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        ctx.authorize(request)
        body = await parse_body(request, protocol.TokenizeRequest, bounds)
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidParamError("prompt", "give either prompt or messages")
        if body.messages is not None:
            ids = await render_chat(ctx, body.messages, body.add_generation_prompt)
        else:
            assert body.prompt is not None
            max_bytes = state.engine.config.scheduler_config.max_prompt_bytes
            if len(body.prompt.encode("utf-8", "surrogatepass")) > max_bytes:
                raise InvalidParamError("prompt", f"is over {max_bytes} bytes (max_prompt_bytes)")
            encoded = await state.engine.tokenize(
                body.prompt, add_special_tokens=body.add_special_tokens
            )
            ids = list(encoded["input_ids"])
        result: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": state.engine.max_model_len,
            "tokens": ids,
        }
        if body.return_token_strs:
            result["token_strs"] = await state.engine.convert_ids_to_tokens(ids)
        return result

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, str]:
        ctx.authorize(request)
        body = await parse_body(request, protocol.DetokenizeRequest, bounds)
        ctx.check_model(body.model)
        max_ids, vocab_size = 4 * state.engine.max_model_len, state.engine.vocab_size
        if len(body.tokens) > max_ids:
            raise InvalidParamError("tokens", f"more than {max_ids} token ids")
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            rule = f"token ids must be in [0, {vocab_size}), got {bad[:5]}"
            raise InvalidParamError("tokens", rule)
        return {"prompt": await state.engine.detokenize(body.tokens)}


class BodyLimit:
    """Refuses a body whose Content-Length is over `max_bytes` before reading any of it (the
    routes count what they read: a chunked body is refused as it passes the limit).

    A client may still be sending when its 413 is written. Closing with its bytes unread
    resets the connection, and a reset drops the 413 from the client's buffer unread: so the
    connection lingers (as nginx's does) while up to `max_bytes` more are read and dropped,
    for at most LINGER_S, then closes."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = self._lingering(send, receive)
        for key, value in scope.get("headers", ()):
            if key == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await error_response(too_large(self.max_bytes))(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _lingering(self, send: Send, receive: Receive) -> Send:
        """`send`, with a 413's last message held back while the rest of the body drains."""
        is_refused = False

        async def send_lingering(message: Message) -> None:
            nonlocal is_refused
            if message["type"] == "http.response.start":
                is_refused = message["status"] == HTTPStatus.REQUEST_ENTITY_TOO_LARGE
            elif is_refused and not message.get("more_body", False):
                await send({**message, "more_body": True})  # the client has all it needs
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(_drain(receive, self.max_bytes), LINGER_S)
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        return send_lingering


LINGER_S = 2.0


async def _drain(receive: Receive, max_bytes: int) -> None:
    """Read and drop up to `max_bytes` of a request's body, or to its end."""
    num_bytes = 0
    while num_bytes <= max_bytes:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        num_bytes += len(message.get("body", b""))
