"""Request messages measured before they are parsed, and parsed off the serving loop when big.

grpc.aio deserializes a request on the event loop that serves every stream (and HTTP); protobuf
takes ~0.4 s to build a 15 MB message of token ids, and holds the GIL while it does. So the
guarded deserializer (decode.py) parses small messages at once and hands a bigger one to its
handler as bytes: here its top-level fields are measured against the server's bounds (a field
past its bound is INVALID_ARGUMENT naming it, unparsed), then it is parsed in a worker thread,
a repeated message field (a batch's prompts) one element at a time, so the thread gives the
loop the GIL between elements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from asyncengine import sampling_params as sp
from asyncengine.engine.validator import MAX_CACHE_SALT_LEN, MAX_REQUEST_ID_LEN
from asyncengine.server.errors import InvalidFieldError

# a message this small is parsed on the loop: a few ms at most, packed ids included
INLINE_BYTES = 256 * 1024
# bytes one token id takes at most: a 5-byte varint, and its tag when not packed
ID_BYTES = 6
_UTF8_BYTES_PER_CHAR = 4
OTHER_FIELD_BYTES = 64 * 1024  # a number, a flag, a small option message
MAX_OTHER_FIELDS = 256  # occurrences of fields without a bound of their own (unknown ones too)


@dataclass(frozen=True)
class FieldBound:
    """A top-level field's bytes (each element's, for a repeated one) and element count."""

    max_bytes: int
    why: str
    max_count: int = 1
    inner: dict[str, FieldBound] | None = None  # a message field's own: names the culprit


Bounds = dict[str, FieldBound]  # a request type's fields by name
_STOP_BYTES = _UTF8_BYTES_PER_CHAR * sp.MAX_STOP_STRING_LEN
_STOPPING = FieldBound(
    sp.MAX_STOP_STRINGS * (_STOP_BYTES + 8) + sp.MAX_STOP_TOKEN_IDS * ID_BYTES + 256,
    f"bytes (at most {sp.MAX_STOP_STRINGS} stop strings, {sp.MAX_STOP_TOKEN_IDS} stop token ids)",
    inner={
        "stop": FieldBound(_STOP_BYTES, "bytes", sp.MAX_STOP_STRINGS),
        "stop_token_ids": FieldBound(
            sp.MAX_STOP_TOKEN_IDS * ID_BYTES, "bytes", sp.MAX_STOP_TOKEN_IDS
        ),
    },
)


@dataclass(frozen=True)
class MessageBounds:
    """The bounds of each request type (by full name) that can be big."""

    by_type: dict[str, Bounds]

    @classmethod
    def create(
        cls, max_model_len: int, max_prompt_bytes: int, max_in_flight: int, max_texts: int,
        max_sequences: int,
    ) -> MessageBounds:  # fmt: skip
        text = FieldBound(max_prompt_bytes, f"bytes of text (max_prompt_bytes {max_prompt_bytes})")
        ids_why = f"bytes: more token ids than the context holds (max_model_len {max_model_len})"
        ids = FieldBound(ID_BYTES * max_model_len + 16, ids_why)
        text_bytes = _UTF8_BYTES_PER_CHAR
        shared = {
            "request_id": FieldBound(text_bytes * MAX_REQUEST_ID_LEN, "bytes"),
            "cache_salt": FieldBound(text_bytes * MAX_CACHE_SALT_LEN, "bytes"),
            "stopping": _STOPPING,
            **{
                name: FieldBound(text_bytes * sp.MAX_CONSTRAINT_LEN + 16, "bytes")
                for name in ("json_schema", "regex", "grammar")
            },
            "choice": FieldBound(
                sp.MAX_CHOICES * (text_bytes * sp.MAX_CHOICE_LEN + 8),
                "bytes",
                inner={
                    "choices": FieldBound(text_bytes * sp.MAX_CHOICE_LEN, "bytes", sp.MAX_CHOICES)
                },
            ),
        }
        prompt = FieldBound(max(text.max_bytes, ids.max_bytes) + 16, "bytes", max_in_flight)
        sequence = FieldBound(4 * ids.max_bytes, "bytes (4 x max_model_len ids)", max_sequences)
        return cls(
            {
                "asyncengine.v1.GenerateRequest": {"text": text, "token_ids": ids, **shared},
                "asyncengine.v1.GenerateBatchRequest": {"prompts": prompt, **shared},
                "asyncengine.v1.TokenizeRequest": {
                    "texts": FieldBound(text_bytes * max_prompt_bytes, "bytes", max_texts)
                },
                "asyncengine.v1.DetokenizeRequest": {"sequences": sequence},
            }
        )


def parse_bounded(data: bytes, message_type: Any, bounds: Bounds) -> Message:
    """`data` as `message_type` once every field is within its bound (InvalidFieldError
    otherwise); DecodeError where the bytes do not parse. Meant for a worker thread."""
    descriptor: Descriptor = message_type.DESCRIPTOR
    spans = _measure(data, descriptor, bounds)
    if spans is None:  # groups or torn framing: find_wire_fault says where
        raise DecodeError("the wire format breaks")
    # a repeated message field is parsed element by element, the rest at once
    split = {
        name
        for name in spans
        if name
        and descriptor.fields_by_name[name].type == FieldDescriptor.TYPE_MESSAGE
        and descriptor.fields_by_name[name].is_repeated
    }
    kept = [data[s:e] for name, ranges in spans.items() if name not in split for s, e in ranges]
    message = message_type.FromString(b"".join(kept))
    for name in split:
        container = getattr(message, name)
        for start, end in spans[name]:
            container.add().MergeFromString(_value(data, start, end))
    return message


def _measure(
    data: bytes, descriptor: Descriptor, bounds: Bounds, prefix: str = ""
) -> dict[str, list[Any]] | None:
    """Each known field's byte ranges (tag included), the bounds checked on the way (a field
    named `prefix` + its name); None when the framing breaks (left to the parser)."""
    spans: dict[str, list[tuple[int, int]]] = {}
    num_other = 0
    pos = 0
    while pos < len(data):
        start = pos
        tag = _varint(data, pos)
        framed = None if tag is None else _field_end(data, tag[1], tag[0] & 7)
        if tag is None or framed is None:
            return None
        number, (size, pos) = tag[0] >> 3, framed
        field = descriptor.fields_by_number.get(number)
        is_message = field is not None and field.type == FieldDescriptor.TYPE_MESSAGE
        if is_message and tag[0] & 7 != 2:
            raise DecodeError(f"{prefix}{number}: a message field under wire type {tag[0] & 7}")
        name = field.name if field is not None else ""
        ranges = spans.setdefault(name, [])
        ranges.append((start, pos))
        bound = bounds.get(name)
        if bound is None:
            num_other += 1
            if num_other > MAX_OTHER_FIELDS or size > OTHER_FIELD_BYTES:
                raise InvalidFieldError(prefix + name or "(message)", "too many or too big fields")
            continue
        if len(ranges) > bound.max_count:
            raise InvalidFieldError(prefix + name, f"has more than {bound.max_count} elements")
        if size > bound.max_bytes:
            if bound.inner is not None and field is not None:  # which of its fields is it?
                _measure(data[pos - size : pos], field.message_type, bound.inner, f"{name}.")
            raise InvalidFieldError(prefix + name, f"is over {bound.max_bytes} {bound.why}")
    return spans


def _field_end(data: bytes, pos: int, wire_type: int) -> tuple[int, int] | None:
    """(the value's size, where the field ends) for a value at `pos`; None: a group, torn."""
    if wire_type == 0:
        varint = _varint(data, pos)
        return None if varint is None else (0, varint[1])
    if wire_type in (1, 5):
        size, end = (8 if wire_type == 1 else 4), pos + (8 if wire_type == 1 else 4)
    elif wire_type == 2:
        length = _varint(data, pos)
        if length is None:
            return None
        size, end = length[0], length[1] + length[0]
    else:
        return None
    return None if end > len(data) else (size, end)


def _value(data: bytes, start: int, end: int) -> bytes:
    """The value bytes of the length-delimited field at data[start:end] (tag and length
    skipped; the walk has framed it already)."""
    tag = _varint(data, start)
    length = None if tag is None else _varint(data, tag[1])
    if length is None:
        raise DecodeError("a torn length-delimited field")
    return data[length[1] : end]


def _varint(data: bytes, pos: int) -> tuple[int, int] | None:
    """(the varint at `pos`, where it ends); None when torn or overlong."""
    value, shift = 0, 0
    while pos < len(data) and shift < 64:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    return None
