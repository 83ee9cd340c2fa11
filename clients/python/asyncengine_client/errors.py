"""Typed errors, built from a failed call's status code and its google.rpc rich details."""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status


class AsyncEngineError(Exception):
    """A call failed with a gRPC status; subclasses name the failures a caller can act on."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        field: str | None = None,
        reason: str | None = None,
        retry_delay_s: float | None = None,
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.field = field  # the first BadRequest field violation
        self.reason = reason  # ErrorInfo.reason: a stable machine-readable string
        self.retry_delay_s = retry_delay_s  # RetryInfo.retry_delay: the server's advice


class InvalidRequestError(AsyncEngineError):
    """The request is wrong (INVALID_ARGUMENT, OUT_OF_RANGE, ALREADY_EXISTS, ...): don't retry."""


class OverloadedError(AsyncEngineError):
    """RESOURCE_EXHAUSTED: the server is full; retry after `retry_delay_s` if it gave one."""


class UnavailableError(AsyncEngineError):
    """UNAVAILABLE: no server reachable, not ready, or draining; or (reason STREAM_LOST) the
    server was lost under a stream, which a balancer reports in its own words: send the
    request again, elsewhere."""


class AuthError(AsyncEngineError):
    """UNAUTHENTICATED or PERMISSION_DENIED: check the token / client certificate."""


class DeadlineExceededError(AsyncEngineError):
    """The call's timeout passed."""


_ERROR_TYPES: dict[grpc.StatusCode, type[AsyncEngineError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequestError,
    grpc.StatusCode.ALREADY_EXISTS: InvalidRequestError,
    grpc.StatusCode.FAILED_PRECONDITION: InvalidRequestError,
    grpc.StatusCode.NOT_FOUND: InvalidRequestError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.UNAUTHENTICATED: AuthError,
    grpc.StatusCode.PERMISSION_DENIED: AuthError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
}


def error_from_rpc(exc: grpc.RpcError) -> AsyncEngineError:
    """The typed error for a failed call (sync `grpc.RpcError` or `grpc.aio.AioRpcError`)."""
    call: grpc.Call = exc  # both carry code/details/trailers
    code, message = call.code(), call.details() or ""
    field = reason = retry_delay_s = None
    try:
        status = rpc_status.from_call(call)
    except ValueError:  # trailers disagree with the status line: ignore the details
        status = None
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            retry_delay_s = info.retry_delay.ToTimedelta().total_seconds()
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            field = bad.field_violations[0].field if bad.field_violations else None
        elif detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            error_info = error_details_pb2.ErrorInfo()
            detail.Unpack(error_info)
            reason = error_info.reason
    if status is None and _is_stream_lost(code, message):
        return UnavailableError(code, message, reason=STREAM_LOST)
    error_type = _ERROR_TYPES.get(code, AsyncEngineError)
    return error_type(code, message, field=field, reason=reason, retry_delay_s=retry_delay_s)


# The server's own statuses always carry google.rpc details; these come from the transport when
# the replica behind a balancer dies mid-stream (measured in docs/operations.md): HAProxy 2.6 ends
# the stream with no trailers, nginx and HAProxy 3 reset it.
STREAM_LOST = "STREAM_LOST"
_LOST_STREAM_DETAILS = ("Stream removed", "Received RST_STREAM")


def _is_stream_lost(code: grpc.StatusCode, message: str) -> bool:
    lost_codes = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED)
    return code in lost_codes and any(words in message for words in _LOST_STREAM_DETAILS)
