"""Request bytes that do not parse: INVALID_ARGUMENT naming the field, not UNKNOWN and a traceback.

grpc deserializes a request after the interceptors have picked its handler, so the interceptor
swaps in a deserializer that never raises: on a DecodeError it returns a `MalformedRequest`,
and the handler around the servicer's turns that into the status instead of calling it. A big
request is not parsed by the deserializer (on the loop) at all: it returns the bytes as a
`LargeRequest`, which the handler measures and parses in a worker thread (message_bounds.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

from asyncengine.logging import get_logger
from asyncengine.server.errors import InvalidFieldError, abort_rpc
from asyncengine.server.message_bounds import INLINE_BYTES, MessageBounds, parse_bounded

logger = get_logger(__name__)

# the field named when the fault is in the request's own framing, outside any field
MESSAGE_FIELD = "(message)"
_MAX_DEPTH = 100  # protobuf's own default recursion limit
# the walk runs on the event loop (~1 us a field): past this many fields it gives up
_MAX_FIELDS = 4096
_MAX_FIELD_NUMBER = (1 << 29) - 1
_CHECKED_TYPES = (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_MESSAGE)


@dataclass(frozen=True)
class WireFault:
    """Where a message's wire bytes go wrong: `field` as the .proto names it, and why."""

    field: str
    description: str


class _Fault(Exception):
    def __init__(self, field: str, description: str) -> None:
        self.fault = WireFault(field or MESSAGE_FIELD, description)


@dataclass(frozen=True)
class MalformedRequest:
    """What the guarded deserializer returns, in place of a request, for bytes that do not parse."""

    fault: WireFault


@dataclass(frozen=True)
class LargeRequest:
    """What the guarded deserializer returns for a request over INLINE_BYTES: its bytes."""

    data: bytes


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Ends a call whose request does not parse with INVALID_ARGUMENT naming the field, and
    parses a big one off the loop, within `bounds` (none: parsed whole, in a thread).

    Only unary requests are guarded (these protos have no streaming ones), and only async
    handlers; one WARNING line per such call, no traceback.
    """

    def __init__(self, bounds: MessageBounds | None = None) -> None:
        self._bounds = bounds or MessageBounds({})
        # by method: the handler last guarded and its guarded one (built once, not per call)
        self._guarded: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method  # a served one: the cache is bounded
        cached = self._guarded.get(method)
        if cached is None or cached[0] is not handler:
            cached = self._guarded[method] = (handler, _guarded(handler, method, self._bounds))
        return cached[1]


def _guarded(
    handler: grpc.RpcMethodHandler, method: str, bounds: MessageBounds
) -> grpc.RpcMethodHandler:
    """`handler` with a deserializer that never raises and a behavior that rejects its marker."""
    parse = handler.request_deserializer
    descriptor = _request_type(method)
    message_type = _message_class(descriptor)

    def deserialize(data: bytes) -> Any:
        if len(data) > INLINE_BYTES and message_type is not None:
            return LargeRequest(data)
        try:
            return parse(data)
        except DecodeError as exc:
            return _malformed(data, descriptor, exc)

    def parse_large(data: bytes) -> Any:  # in a worker thread
        assert descriptor is not None and message_type is not None
        try:
            return parse_bounded(data, message_type, bounds.by_type.get(descriptor.full_name, {}))
        except DecodeError as exc:
            return _malformed(data, descriptor, exc)

    async def parsed(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, LargeRequest):
            try:
                request = await asyncio.to_thread(parse_large, request.data)
            except InvalidFieldError as exc:
                await abort_rpc(context, exc)
        if isinstance(request, MalformedRequest):
            await _reject(context, method, request.fault)
        return request

    behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary

    async def unary_response(request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await behavior(await parsed(request, context), context)

    async def stream_response(
        request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        request = await parsed(request, context)
        async with contextlib.aclosing(behavior(request, context)) as responses:
            async for response in responses:
                yield response

    # grpc runs a handler by its kind (coroutine, async generator, sync): keep the kind
    if inspect.isasyncgenfunction(behavior):
        wrapped: Callable[..., Any] = stream_response
    elif inspect.iscoroutinefunction(behavior):  # unary, or streaming through context.write
        wrapped = unary_response
    else:
        return handler
    make = (
        grpc.unary_stream_rpc_method_handler
        if handler.response_streaming
        else grpc.unary_unary_rpc_method_handler
    )
    return make(
        wrapped, request_deserializer=deserialize, response_serializer=handler.response_serializer
    )


def _malformed(data: bytes, descriptor: Descriptor | None, exc: DecodeError) -> MalformedRequest:
    fault = find_wire_fault(data, descriptor) if descriptor is not None else None
    return MalformedRequest(fault or WireFault(MESSAGE_FIELD, str(exc)))


def _message_class(descriptor: Descriptor | None) -> Any:
    """The generated class of a request type (None: not loaded, parsed as grpc would)."""
    if descriptor is None:
        return None
    try:
        return message_factory.GetMessageClass(descriptor)
    except (KeyError, TypeError):
        return None


def _request_type(method: str) -> Descriptor | None:
    """The request message of `/package.Service/Method`, if its .proto is loaded."""
    service, _, name = method.lstrip("/").partition("/")
    try:
        return (
            descriptor_pool.Default().FindServiceByName(service).FindMethodByName(name).input_type
        )
    except KeyError:
        return None


async def _reject(context: grpc.aio.ServicerContext, method: str, fault: WireFault) -> NoReturn:
    logger.warning(
        "malformed_request", method=method, field=fault.field, description=fault.description
    )
    await abort_rpc(context, InvalidFieldError(fault.field, fault.description))


def find_wire_fault(data: bytes, descriptor: Descriptor) -> WireFault | None:
    """The first string that is not UTF-8, or where the wire format breaks; None if neither.

    Paths read like the .proto: `stopping.stop[2]`, `prompts[1].text`; a break outside any
    field (a torn tag at the top level) is `(message)`. None as well past the first
    `_MAX_FIELDS` fields, and for what the walk does not check (the insides of packed scalars,
    overlong tags), which the parser rejects too: a caller names those `(message)`.
    """
    try:
        _Walk(data).fields(0, len(data), descriptor, "", depth=0, end_group=None)
    except _Fault as fault:
        return fault.fault
    except _OutOfBudget:
        return None
    return None


class _OutOfBudget(Exception):
    pass


class _Walk:
    """One walk over a message's wire bytes; raises _Fault at the first fault."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.num_fields_left = _MAX_FIELDS

    def fields(
        self, pos: int, end: int, descriptor: Descriptor | None, path: str, *, depth: int,
        end_group: int | None,
    ) -> int:  # fmt: skip
        """Walk data[pos:end] (up to the END_GROUP of field `end_group` if set); the end."""
        if depth > _MAX_DEPTH:
            raise _Fault(path, "nested too deeply")
        num_elements: dict[int, int] = {}  # per repeated string or message field
        while pos < end:
            self.num_fields_left -= 1
            if self.num_fields_left < 0:
                raise _OutOfBudget
            tag, pos = self.varint(pos, end, path)
            number, wire_type = tag >> 3, tag & 7
            if not 0 < number <= _MAX_FIELD_NUMBER:
                raise _Fault(path, f"invalid field number {number}")
            field = descriptor.fields_by_number.get(number) if descriptor is not None else None
            here = path if field is None else _join(path, field.name)
            # under another wire type the parser keeps it as an unknown field, unchecked
            if field is not None and (wire_type != 2 or field.type not in _CHECKED_TYPES):
                field = None
            if field is not None and field.is_repeated:
                num_elements[number] = num_elements.get(number, 0) + 1
                here += f"[{num_elements[number] - 1}]"
            if wire_type == 0:
                _, pos = self.varint(pos, end, here)
            elif wire_type in (1, 2, 5):
                size = {1: 8, 5: 4}.get(wire_type)
                if size is None:
                    size, pos = self.varint(pos, end, here)
                if pos + size > end:
                    raise _Fault(here, "truncated: runs past the end of its message")
                if field is not None and field.type == FieldDescriptor.TYPE_STRING:
                    _check_utf8(self.data[pos : pos + size], here)
                elif field is not None:
                    self.fields(
                        pos, pos + size, field.message_type, here, depth=depth + 1, end_group=None
                    )
                pos += size
            elif wire_type == 3:
                pos = self.fields(pos, end, None, here, depth=depth + 1, end_group=number)
            elif wire_type == 4 and number == end_group:
                return pos
            else:
                raise _Fault(here, f"unexpected wire type {wire_type}")
        if end_group is not None:
            raise _Fault(path, "truncated: a group has no end")
        return pos

    def varint(self, pos: int, end: int, path: str) -> tuple[int, int]:
        value = 0
        for shift in range(0, 70, 7):
            if pos >= end:
                break
            byte = self.data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value, pos
        raise _Fault(path, "truncated or overlong varint")


def _check_utf8(raw: bytes, path: str) -> None:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Fault(path, f"not valid UTF-8 at byte {exc.start}") from None


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
