"""Bearer-token auth: `authorization: Bearer <token>` metadata, checked before any handler runs."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health

from asyncengine.server.errors import UnauthenticatedError, abort_rpc
from asyncengine.server.state import SERVICE_NAMES

_CONTROL_PREFIX = f"/{SERVICE_NAMES[1]}/"
# probes (kubelet, load balancers) cannot send tokens, and health reveals nothing
_OPEN_PREFIXES = (f"/{health.SERVICE_NAME}/",)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Admits calls that carry one of the accepted tokens; Control may have tokens of its own."""

    def __init__(self, tokens: Sequence[str], control_tokens: Sequence[str] = ()) -> None:
        self._tokens = tuple(tokens)
        self._control_tokens = tuple(control_tokens) or self._tokens

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        accepted = self._control_tokens if method.startswith(_CONTROL_PREFIX) else self._tokens
        handler = await continuation(handler_call_details)
        if not accepted or method.startswith(_OPEN_PREFIXES) or handler is None:
            return handler
        token = _bearer_token(handler_call_details.invocation_metadata or ())
        # compare against every token in constant time so timing reveals nothing
        if token is not None and sum(_equal(token, t) for t in accepted) > 0:
            return handler
        return _rejecting(handler, "a valid bearer token is required for " + method)


def _bearer_token(metadata: Any) -> str | None:
    for key, value in metadata:
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token:
                return token.strip()
    return None


def _equal(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def _rejecting(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call with UNAUTHENTICATED."""

    async def unary_response(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await abort_rpc(context, UnauthenticatedError(message))

    async def stream_response(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await abort_rpc(context, UnauthenticatedError(message))
        yield  # an async generator, as streaming handlers are

    codecs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream_response, **codecs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary_response, **codecs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream_response, **codecs)
    return grpc.unary_unary_rpc_method_handler(unary_response, **codecs)
