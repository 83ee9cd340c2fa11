"""Every failure an HTTP caller can act on, as OpenAI's error JSON with one status each, here only.

`{"error": {"message", "type", "param", "code"}}`: `param` is the OpenAI field name (handlers
translate the engine's through `params.py` before raising), `code` a stable word to branch on.
"""

from __future__ import annotations

import math
from http import HTTPStatus

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from asyncengine.errors import (
    ContextLengthError,
    DuplicateRequestError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    LoRAInUseError,
    LoRANotFoundError,
    RequestFailedError,
)
from asyncengine.logging import get_logger
from asyncengine.server.errors import (
    DuplicateLoRAError,
    PermissionDeniedError,
    ServerDrainingError,
    UnauthenticatedError,
)

logger = get_logger(__name__)


class InvalidParamError(InvalidRequestError):
    """A request field, named as in OpenAI's API (`max_completion_tokens`, `messages`)."""


class ModelNotFoundError(LookupError):
    """The request names a model this server does not serve."""


class ContextLengthExceededError(InvalidParamError):
    """The engine's ContextLengthError, named by the OpenAI field it came from."""


class UnsupportedParamError(InvalidParamError):
    """A field OpenAI defines that this server does not implement (with a value that matters)."""


class BodyTooLargeError(ValueError):
    """The request body is over --max-message-size bytes."""


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, dict[str, str | None]]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(exc: BaseException) -> JSONResponse:
    """The response for `exc`: its status, OpenAI's error JSON, and Retry-After for a 429."""
    status, body, headers = error_content(exc)
    return JSONResponse(body, status, headers)


def error_content(
    exc: BaseException,
) -> tuple[int, dict[str, dict[str, str | None]], dict[str, str] | None]:
    """(status, OpenAI's error JSON, headers) for `exc`; an SSE stream sends the JSON alone."""
    status, type_, param, code, headers = _classify(exc)
    message = str(exc)
    if status == HTTPStatus.INTERNAL_SERVER_ERROR and not isinstance(exc, RequestFailedError):
        logger.error("internal_error", error=repr(exc), exc_info=exc)
        message = "internal error (see the server log)"  # the cause may hold others' values
    elif isinstance(exc, RequestValidationError):
        message = validation_message(exc)
    elif isinstance(exc, HTTPException):
        message = str(exc.detail)
    return status, error_body(message, type_, param, code), headers


def _classify(
    exc: BaseException,
) -> tuple[int, str, str | None, str | None, dict[str, str] | None]:
    """(status, type, param, code, headers) of `exc`."""
    if isinstance(exc, DuplicateRequestError):
        return 409, "invalid_request_error", "x-request-id", "duplicate_request_id", None
    if isinstance(exc, DuplicateLoRAError):  # vLLM's 400 for a name loaded already
        return 400, "invalid_request_error", exc.field, "lora_already_loaded", None
    if isinstance(exc, UnsupportedParamError):
        return 400, "invalid_request_error", exc.field, "unsupported_parameter", None
    if isinstance(exc, ContextLengthError | ContextLengthExceededError):
        return 400, "invalid_request_error", exc.field, "context_length_exceeded", None
    if isinstance(exc, InvalidRequestError):
        return 400, "invalid_request_error", exc.field, "invalid_value", None
    if isinstance(exc, RequestValidationError):
        return 400, "invalid_request_error", _validation_param(exc), "invalid_type", None
    if isinstance(exc, BodyTooLargeError):
        # closed after: the rest of the body is never read
        return 413, "invalid_request_error", None, "request_too_large", {"Connection": "close"}
    if isinstance(exc, UnauthenticatedError):
        return 401, "authentication_error", None, "invalid_api_key", None
    if isinstance(exc, PermissionDeniedError):
        return 403, "permission_error", None, "control_disabled", None
    if isinstance(exc, LoRANotFoundError):
        return 404, "invalid_request_error", "lora_name", "lora_not_found", None
    if isinstance(exc, LoRAInUseError):
        return 409, "invalid_request_error", "lora_name", "lora_in_use", None
    if isinstance(exc, ModelNotFoundError):
        # 404 with OpenAI's type: wrappers branch on type and code, not on the status
        return 404, "invalid_request_error", "model", "model_not_found", None
    if isinstance(exc, EngineOverloadedError):
        retry_after = str(max(1, math.ceil(exc.retry_after_s)))  # whole seconds, by the RFC
        return 429, "rate_limit_error", None, "overloaded", {"Retry-After": retry_after}
    if isinstance(exc, ServerDrainingError):
        return 503, "server_error", None, "draining", None
    if isinstance(exc, EngineDeadError):
        return 503, "server_error", None, "engine_dead", None
    if isinstance(exc, RequestFailedError):
        return 500, "server_error", None, "request_failed", None
    if isinstance(exc, HTTPException):
        return exc.status_code, "invalid_request_error", None, _phrase(exc.status_code), None
    return 500, "server_error", None, "internal_error", None


def _validation_param(exc: RequestValidationError) -> str | None:
    """The field the first validation error is about, as dotted JSON path (`messages.0.role`)."""
    for error in exc.errors():
        loc = [str(part) for part in error.get("loc", ()) if part != "body"]
        # a union's branch names its type ("list[int]"), not a field: keep the field alone
        fields = [part for part in loc if "[" not in part and part not in ("str", "int")]
        if fields:
            return ".".join(fields)
    return None


def validation_message(exc: RequestValidationError) -> str:
    errors = exc.errors()
    if not errors:
        return "the request body is not valid"
    first = errors[0]
    param = _validation_param(exc)
    message = str(first.get("msg", "is not valid"))
    return f"{param}: {message}" if param else message


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_")
    except ValueError:
        return "error"
