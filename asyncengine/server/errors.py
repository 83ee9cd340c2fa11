"""Every failure a caller can act on, mapped to one gRPC status with google.rpc details, here only.

Handlers raise (or let through) exceptions; `abort_rpc` turns one into a status with BadRequest,
RetryInfo or ErrorInfo details, so clients branch on codes and details, never on message text.
"""

from __future__ import annotations

from typing import NoReturn

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from asyncengine.errors import (
    DuplicateRequestError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
)
from asyncengine.logging import get_logger

logger = get_logger(__name__)

ERROR_DOMAIN = "asyncengine"


class InvalidFieldError(InvalidRequestError):
    """A request field (named as in the .proto, e.g. `sampling.temperature`) has a bad value."""

    def __init__(self, field: str, description: str) -> None:
        super().__init__(f"{field}: {description}")
        self.field = field
        self.description = description


class ServerDrainingError(RuntimeError):
    """The server is draining or shutting down and admits no new requests."""


class UnauthenticatedError(RuntimeError):
    """The call carries no valid bearer token for the service it asks for."""


class PermissionDeniedError(RuntimeError):
    """Control is off (tenant tokens but no Control token): no token may call it."""


def _any(message: object) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def _error_info(reason: str, **metadata: str) -> any_pb2.Any:
    return _any(error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN, metadata=metadata))


def status_for(exc: BaseException, *, has_partial_output: bool = False) -> status_pb2.Status:
    """The google.rpc Status for `exc`; `has_partial_output`: deltas were already sent."""
    if isinstance(exc, DuplicateRequestError):
        return _status(code_pb2.ALREADY_EXISTS, exc, _error_info("DUPLICATE_REQUEST_ID"))
    if isinstance(exc, InvalidRequestError):
        field = exc.field if isinstance(exc, InvalidFieldError) else "prompt"
        description = exc.description if isinstance(exc, InvalidFieldError) else str(exc)
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=field, description=description
        )
        bad_request = error_details_pb2.BadRequest(field_violations=[violation])
        return _status(
            code_pb2.INVALID_ARGUMENT,
            exc,
            _any(bad_request),
            _error_info("INVALID_ARGUMENT", field=field),
        )
    if isinstance(exc, EngineOverloadedError):
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(max(1, round(exc.retry_after_s * 1000)))
        return _status(
            code_pb2.RESOURCE_EXHAUSTED,
            exc,
            _any(error_details_pb2.RetryInfo(retry_delay=delay)),
            _error_info("OVERLOADED"),
        )
    if isinstance(exc, ServerDrainingError):
        return _status(code_pb2.UNAVAILABLE, exc, _error_info("DRAINING"))
    if isinstance(exc, UnauthenticatedError):
        return _status(code_pb2.UNAUTHENTICATED, exc, _error_info("UNAUTHENTICATED"))
    if isinstance(exc, PermissionDeniedError):
        return _status(code_pb2.PERMISSION_DENIED, exc, _error_info("CONTROL_DISABLED"))
    if isinstance(exc, EngineDeadError):
        # nothing generated yet: a retry elsewhere is safe; after partial output it is not
        code = code_pb2.INTERNAL if has_partial_output else code_pb2.UNAVAILABLE
        return _status(code, exc, _error_info("ENGINE_DEAD"))
    logger.error("internal_error", error=repr(exc), exc_info=exc)
    return _status(code_pb2.INTERNAL, f"internal error: {exc!r}", _error_info("INTERNAL"))


def _status(code: int, message: object, *details: any_pb2.Any) -> status_pb2.Status:
    return status_pb2.Status(code=code, message=str(message), details=list(details))


async def abort_rpc(
    context: grpc.aio.ServicerContext, exc: BaseException, *, has_partial_output: bool = False
) -> NoReturn:
    """End the RPC with the status for `exc` (raises, as `context.abort` does)."""
    status = rpc_status.to_status(status_for(exc, has_partial_output=has_partial_output))
    await context.abort_with_status(status)
    raise AssertionError("abort_with_status returned")  # it always raises
