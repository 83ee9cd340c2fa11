"""Bearer-token auth: `authorization: Bearer <token>` metadata, checked before any handler runs.

Tenant tokens (--auth-token) open Generation, Control tokens (--control-auth-token) open Control
and the calls of SMG's worker service that show every tenant's work (loads, server facts, KV
events); neither opens the other, but for Control.Abort, which a tenant may call on its own
requests.
`Tenants` names the tenant of a call, which salts the prefix cache and scopes request ids.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health
from smg_grpc_proto import vllm_engine_pb2

from asyncengine.logging import get_logger
from asyncengine.server.errors import PermissionDeniedError, UnauthenticatedError, abort_rpc
from asyncengine.server.options import ServeOptions, parse_auth_token
from asyncengine.v1 import control_pb2

logger = get_logger(__name__)

_CONTROL_PREFIX = f"/{control_pb2.DESCRIPTOR.services_by_name['Control'].full_name}/"
_WORKER_PREFIX = f"/{vllm_engine_pb2.DESCRIPTOR.services_by_name['VllmEngine'].full_name}/"
# SMG's worker service answers these for every tenant's work at once (KV events carry the
# prompts' token ids): with tenant tokens they take Control's, as Control's GetServerInfo does
_OPERATOR_METHODS = frozenset(
    _WORKER_PREFIX + name for name in ("GetLoads", "GetServerInfo", "SubscribeKvEvents")
)
# a tenant aborts its own requests by id (ServerState.abort_ids): no other tenant's are reached
_ABORT_METHOD = _CONTROL_PREFIX + "Abort"
# probes (kubelet, load balancers) cannot send tokens, and health reveals nothing
_OPEN_PREFIXES = (f"/{health.SERVICE_NAME}/",)
CONTROL_DISABLED_MESSAGE = (
    "Control is off: this server takes tenant tokens (--auth-token) but has no Control token; "
    "start the server with --control-auth-token to use Control"
)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Admits calls that carry one of the accepted tokens; Control takes only its own.

    `tokens` are --auth-token values (GROUP:TOKEN accepts TOKEN). With tenant tokens and no
    Control token, Control stays off, so that no tenant can Drain; Abort takes both kinds (a
    tenant's reaches only its own requests).
    """

    def __init__(self, tokens: Sequence[str], control_tokens: Sequence[str] = ()) -> None:
        self._tokens = tuple(parse_auth_token(value)[1] for value in tokens)
        self._control_tokens = tuple(control_tokens)
        self._is_control_disabled = bool(self._tokens) and not self._control_tokens
        if self._is_control_disabled:
            logger.warning(
                "control_disabled",
                reason="--auth-token is set and --control-auth-token is not: Control calls but "
                "Abort (a tenant's own requests) get PERMISSION_DENIED, so no tenant can Drain",
                fix="start the server with --control-auth-token",
            )

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if method.startswith(_OPEN_PREFIXES) or handler is None:
            return handler
        # without tenant tokens there is one namespace: SMG reads loads and KV events as is
        is_control = method.startswith(_CONTROL_PREFIX) or (
            method in _OPERATOR_METHODS and bool(self._tokens)
        )
        if method == _ABORT_METHOD:
            accepted = self._tokens + self._control_tokens
        elif is_control and self._is_control_disabled:
            return _rejecting(handler, PermissionDeniedError(CONTROL_DISABLED_MESSAGE))
        else:
            accepted = self._control_tokens if is_control else self._tokens
        if not accepted:
            return handler
        if carries_token(handler_call_details.invocation_metadata, accepted):
            return handler
        return _rejecting(
            handler, UnauthenticatedError("a valid bearer token is required for " + method)
        )


class Tenants:
    """The tenant of a call, from its bearer token: the prefix cache's default salt.

    A bare --auth-token TOKEN is a tenant of its own, named by a digest of the token (never the
    token itself); the tokens of --auth-token GROUP:TOKEN values are one tenant, "group:GROUP".
    """

    def __init__(self, identities: Mapping[str, str], operator_tokens: Sequence[str] = ()) -> None:
        self._identities = dict(identities)  # accepted token -> tenant identity
        self._operator_tokens = tuple(operator_tokens)  # Control tokens: every tenant's requests

    @classmethod
    def from_options(cls, options: ServeOptions) -> Tenants:
        identities = {}
        for value in options.auth_tokens:
            group, token = parse_auth_token(value)
            identities[token] = _digest(token) if group is None else f"group:{group}"
        return cls(identities, options.control_auth_tokens)

    def abort_scope(self, invocation_metadata: Any) -> tuple[str | None, bool]:
        """(tenant, is_operator) of an Abort call: a tenant's token reaches that tenant's
        requests only; a Control token, or any caller of a server without tenant tokens (one
        namespace), reaches every request."""
        if not self._identities:
            return None, True
        if carries_token(invocation_metadata, self._operator_tokens):
            return None, True
        return self.identity(invocation_metadata), False

    def identity(self, invocation_metadata: Any) -> str | None:
        """The tenant of a call with this metadata; None when Generation takes no tokens."""
        if not self._identities:
            return None
        token = _bearer_token(invocation_metadata or ())
        identity = None if token is None else self._identities.get(token)
        if identity is None:  # the interceptor admits no such call; never fall back to sharing
            raise UnauthenticatedError("a valid bearer token is required")
        return identity


def carries_token(invocation_metadata: Any, tokens: Sequence[str]) -> bool:
    """The call's bearer token is one of `tokens`."""
    token = _bearer_token(invocation_metadata or ())
    # compared with every token in constant time, so timing reveals nothing
    return token is not None and sum(_equal(token, t) for t in tokens) > 0


def _digest(token: str) -> str:
    # 64 bits tell tenants apart; the token itself must never reach a log or a cache key
    return hashlib.sha256(token.encode()).hexdigest()[:16]


def _bearer_token(metadata: Any) -> str | None:
    for key, value in metadata:
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token:
                return token.strip()
    return None


def _equal(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def _rejecting(handler: grpc.RpcMethodHandler, error: Exception) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call with `error`'s status."""

    async def unary_response(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await abort_rpc(context, error)

    async def stream_response(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await abort_rpc(context, error)
        yield  # an async generator, as streaming handlers are

    codecs = {
        # the refused call's bytes are never parsed: no caller without a token costs the loop
        "request_deserializer": _ignore_request,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream_response, **codecs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary_response, **codecs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream_response, **codecs)
    return grpc.unary_unary_rpc_method_handler(unary_response, **codecs)


def _ignore_request(data: bytes) -> None:
    return None
