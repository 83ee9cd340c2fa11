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
    LoRAInUseError,
    LoRANotFoundError,
    RequestFailedError,
)
from asyncengine.logging import get_logger

logger = get_logger(__name__)

ERROR_DOMAIN = "asyncengine"


class InvalidFieldError(InvalidRequestError):
    """A request field, named as in the .proto (`sampling.temperature`), has a bad value."""


class ClientStalledError(RuntimeError):
    """The client did not read its stream for the server's stall time: its call is ended and
    its buffered output dropped, so an unread stream holds nothing."""


class ServerDrainingError(RuntimeError):
    """The server is draining or shutting down and admits no new requests."""


class UnauthenticatedError(RuntimeError):
    """The call carries no valid bearer token for the service it asks for."""


class PermissionDeniedError(RuntimeError):
    """Control is off (tenant tokens but no Control token): no token may call it."""


class DuplicateLoRAError(InvalidRequestError):
    """A LoRA adapter of this name is loaded already: unload it first, or pick another name."""

    def __init__(self, lora_name: str) -> None:
        super().__init__("lora_name", f"the LoRA adapter {lora_name!r} is loaded already")


class RuntimeLoRAUpdatingDisabledError(RuntimeError):
    """A run-time load or unload on a server started without --allow-runtime-lora-updating."""


def _any(message: object) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def _error_info(reason: str, **metadata: str) -> any_pb2.Any:
    return _any(error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN, metadata=metadata))


def status_for(exc: BaseException, *, has_partial_output: bool = False) -> status_pb2.Status:
    """The google.rpc Status for `exc`; `has_partial_output`: deltas were already sent."""
    if isinstance(exc, InvalidRequestError):
        field, description = exc.field, exc.description
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=field, description=description
        )
        bad_request = _any(error_details_pb2.BadRequest(field_violations=[violation]))
        if isinstance(exc, DuplicateRequestError):
            info = _error_info("DUPLICATE_REQUEST_ID", field=field)
            return _status(code_pb2.ALREADY_EXISTS, exc, bad_request, info)
        if isinstance(exc, DuplicateLoRAError):
            info = _error_info("DUPLICATE_LORA", field=field)
            return _status(code_pb2.ALREADY_EXISTS, exc, bad_request, info)
        info = _error_info("INVALID_ARGUMENT", field=field)
        return _status(code_pb2.INVALID_ARGUMENT, exc, bad_request, info)
    if isinstance(exc, LoRANotFoundError):  # the adapter a request or a call names
        violation = error_details_pb2.BadRequest.FieldViolation(
            field="lora_name", description=str(exc)
        )
        bad_request = _any(error_details_pb2.BadRequest(field_violations=[violation]))
        info = _error_info("LORA_NOT_FOUND", field="lora_name")
        return _status(code_pb2.NOT_FOUND, exc, bad_request, info)
    if isinstance(exc, LoRAInUseError):
        return _status(code_pb2.FAILED_PRECONDITION, exc, _error_info("LORA_IN_USE"))
    if isinstance(exc, RuntimeLoRAUpdatingDisabledError):
        info = _error_info("RUNTIME_LORA_UPDATING_DISABLED")
        return _status(code_pb2.FAILED_PRECONDITION, exc, info)
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
    if isinstance(exc, ClientStalledError):
        return _status(code_pb2.RESOURCE_EXHAUSTED, exc, _error_info("CLIENT_STALLED"))
    if isinstance(exc, RequestFailedError):
        # this request's own failure, already logged with its cause; a retry would fail again
        return _status(code_pb2.INTERNAL, exc, _error_info("REQUEST_FAILED"))
    if isinstance(exc, EngineDeadError):
        # transient for the caller: this replica is gone, another serves. Whether a retry
        # repeats output already sent is the detail's, not a second status code
        partial = "true" if has_partial_output else "false"
        info = _error_info("ENGINE_DEAD", has_partial_output=partial)
        return _status(code_pb2.UNAVAILABLE, f"the engine is dead: {exc}", info)
    logger.error("internal_error", error=repr(exc), exc_info=exc)
    # the cause stays in the log: it may hold values of other requests
    message = "internal error (see the server log)"
    return _status(code_pb2.INTERNAL, message, _error_info("INTERNAL"))


def _status(code: int, message: object, *details: any_pb2.Any) -> status_pb2.Status:
    return status_pb2.Status(code=code, message=str(message), details=list(details))


def set_final_status(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Set the status for `exc` for the handler to return with, without sending anything now.

    For a client that stopped reading: `abort_rpc` would wait behind the unread messages,
    while a handler that returns frees everything it holds at once. The client sees the
    status after the messages still in flight, if it ever reads again.
    """
    status = rpc_status.to_status(status_for(exc))
    context.set_code(status.code)
    context.set_details(status.details)
    context.set_trailing_metadata(status.trailing_metadata)


async def abort_rpc(
    context: grpc.aio.ServicerContext, exc: BaseException, *, has_partial_output: bool = False
) -> NoReturn:
    """End the RPC with the status for `exc` (raises, as `context.abort` does)."""
    status = rpc_status.to_status(status_for(exc, has_partial_output=has_partial_output))
    await context.abort_with_status(status)
    raise AssertionError("abort_with_status returned")  # it always raises
