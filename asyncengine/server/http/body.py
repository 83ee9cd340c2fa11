"""Request bodies read with their size bounded as they arrive, and decoded off the serving loop
with each field's size bounded before it is decoded (gRPC streams share this loop).

A body is split into its top-level fields without building them (msgspec's `Raw`: a scan, not
objects), each field the route reads is measured against a bound derived from the engine's
limits, and only then decoded and validated. A batch of prompts is decoded one prompt at a
time, so a worker thread gives the loop the GIL between prompts: no single decode of an
accepted body holds it for long. Fields a route does not read are never decoded: their names
are logged, once each (`fields.IGNORED_FIELDS`).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import pydantic
from fastapi.exceptions import RequestValidationError
from starlette.requests import Request

from asyncengine import sampling_params as sp
from asyncengine.server.http import protocol
from asyncengine.server.http.errors import BodyTooLargeError, InvalidParamError
from asyncengine.server.http.fields import IGNORED_FIELDS
from asyncengine.server.state import ServerState

M = TypeVar("M", bound=protocol.Lenient)

# a body this small is decoded on the loop: well under a millisecond
INLINE_BYTES = 64 * 1024
# JSON bytes one token id may take with its separator and an indented layout's whitespace
ID_BYTES = 16
# JSON bytes one character of text may take (`\u00e9`: six for one)
ESCAPED_BYTES_PER_CHAR = 6
# messages of one chat: each is built and rendered for the template, the first on the loop
MAX_MESSAGES = 4096
# what any other field may take: a number, a flag, a short name
OTHER_FIELD_BYTES = 64 * 1024
# names of fields a body carries that its route does not read, kept to be logged
MAX_UNDECLARED = 64
_STRUCTURE_BYTES = 64 * 1024  # a message's or a schema's keys and punctuation
NESTED_TOO_DEEPLY = "JSON nested too deeply (arrays and objects within each other)"
_ROOT = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ANY = msgspec.json.Decoder()
_ARRAY = msgspec.json.Decoder(list[msgspec.Raw])
_PROMPT = pydantic.TypeAdapter(str | list[int])
_ELEMENTS = {"messages": pydantic.TypeAdapter(protocol.ChatMessage)}


@dataclass(frozen=True)
class BodyBounds:
    """What one server accepts: the body's bytes, each field's JSON bytes, prompts per call."""

    max_body_bytes: int
    field_bytes: dict[str, int]
    max_prompts: int
    max_prompt_bytes: int  # JSON bytes of one prompt of a batch, text or token ids

    @classmethod
    def of(cls, state: ServerState) -> BodyBounds:
        engine = state.engine
        text = ESCAPED_BYTES_PER_CHAR * engine.config.scheduler_config.max_prompt_bytes + 2
        ids = ID_BYTES * engine.max_model_len + 2
        max_prompts = state.max_in_flight
        constraint = 8 * sp.MAX_CONSTRAINT_LEN + _STRUCTURE_BYTES  # an indented schema
        field_bytes = {
            "prompt": max_prompts * max(text, ids),  # a batch is then measured per prompt
            "messages": text + _STRUCTURE_BYTES,
            "tokens": 4 * ID_BYTES * engine.max_model_len,  # /detokenize's bound, 4x the context
            "stop": sp.MAX_STOP_STRINGS * (ESCAPED_BYTES_PER_CHAR * sp.MAX_STOP_STRING_LEN + 4),
            "stop_token_ids": sp.MAX_STOP_TOKEN_IDS * ID_BYTES,
            "logit_bias": sp.MAX_LOGIT_BIAS * 64,  # "12345": -100.0, with room to spare
            "response_format": constraint,
            "structured_outputs": constraint + sp.MAX_CHOICES * sp.MAX_CHOICE_LEN * 6,
            **dict.fromkeys(("guided_json", "guided_regex", "guided_grammar"), constraint),
            "guided_choice": sp.MAX_CHOICES * (sp.MAX_CHOICE_LEN * 6 + 4),
            "tools": constraint,
        }
        return cls(state.max_message_size, field_bytes, max_prompts, max(text, ids))


async def read_body(request: Request, max_bytes: int) -> bytearray:
    """The whole body; BodyTooLargeError as soon as it passes `max_bytes` (chunked or not),
    the rest left unread (the 413 closes the connection)."""
    # grown a chunk at a time: one join of 60 MB at the end held the loop 0.2 s (page faults)
    body = bytearray()
    async for chunk in request.stream():
        if len(body) + len(chunk) > max_bytes:
            raise too_large(max_bytes)
        body += chunk
    return body


def too_large(max_bytes: int) -> BodyTooLargeError:
    return BodyTooLargeError(f"the request body is over {max_bytes} bytes (--max-message-size)")


async def parse_body(request: Request, model: type[M], bounds: BodyBounds) -> M:
    """The body as `model`, bounded and decoded off the loop when it is not small."""
    body = await read_body(request, bounds.max_body_bytes)
    if len(body) <= INLINE_BYTES:
        parsed = decode(body, model, bounds)
    else:
        parsed = await asyncio.to_thread(decode, body, model, bounds)
    IGNORED_FIELDS.report(parsed)  # on the loop: the names seen are its own
    return parsed


def decode(body: bytes | bytearray, model: type[M], bounds: BodyBounds) -> M:
    """`body` as `model`: each field the model has measured, decoded, then validated.

    Invalid UTF-8 and lone surrogates (`"\\ud800"`) are refused by the decoder, naming the
    field: no text that is not Unicode gets past here to a tokenizer or a stop matcher.
    """
    try:
        fields = _ROOT.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        named = surrogate_error(body)
        raise named or _invalid_json(f"the body is not a valid JSON object: {exc}") from None
    except RecursionError:  # the decoder's depth is Python's recursion limit
        raise _invalid_json(f"the body is {NESTED_TOO_DEEPLY}") from None
    values: dict[str, Any] = {}
    undeclared: list[str] = []
    for name, raw in fields.items():
        if name not in model.model_fields:
            if len(undeclared) < MAX_UNDECLARED:
                undeclared.append(name)  # left out, and logged
            continue
        limit = bounds.field_bytes.get(name, OTHER_FIELD_BYTES)
        if len(raw) > limit:
            raise InvalidParamError(name, f"is over {limit} bytes of JSON")
        values[name] = _decode_field(name, raw, bounds)
    # a list of prompts or messages is validated an element at a time, the rest at once
    split = {name: value for name, value in values.items() if isinstance(value, _Batch)}
    values.update({name: "" if name == "prompt" else [] for name in split})
    try:
        parsed = model.model_validate(values)
    except pydantic.ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None
    for name, batch in split.items():
        if name == "prompt":
            parsed.prompt = _validated_prompts(batch)  # type: ignore[attr-defined]
        else:
            setattr(parsed, name, _validated_elements(name, batch))
    parsed._undeclared = undeclared
    return parsed


class _Batch(list[msgspec.Raw]):
    """A list of prompts or messages, each still JSON: decoded one at a time."""


def _decode_field(name: str, raw: msgspec.Raw, bounds: BodyBounds) -> Any:
    view = memoryview(raw)  # a view: the field is not copied to be measured
    if name == "messages" and bytes(view[:64]).lstrip().startswith(b"["):
        messages = _Batch(_decode_text(name, raw, list[msgspec.Raw]))
        if len(messages) > MAX_MESSAGES:  # each is rendered on the loop (chat.py)
            raise InvalidParamError(name, f"at most {MAX_MESSAGES} messages, got {len(messages)}")
        return messages
    if name == "prompt" and _is_batch(view[:64]):
        _check_num_prompts(view, bounds.max_prompts)
        prompts = _Batch(_decode_text(name, raw, list[msgspec.Raw]))
        _check_num_prompts(prompts, bounds.max_prompts)
        for index, prompt in enumerate(prompts):
            if len(prompt) > bounds.max_prompt_bytes:
                raise InvalidParamError(
                    name, f"[{index}] is over {bounds.max_prompt_bytes} bytes of JSON"
                )
        return prompts
    if name == "prompt" and len(raw) > bounds.max_prompt_bytes:
        raise InvalidParamError(name, f"is over {bounds.max_prompt_bytes} bytes of JSON")
    return _decode_text(name, raw)


def _check_num_prompts(batch: memoryview | list[msgspec.Raw], max_prompts: int) -> None:
    """At most `max_prompts` prompts. Before the batch is split (a split of millions of tiny
    prompts holds the GIL for long) by counts that bound the number from below: brackets in a
    batch of token-id lists, and in one with texts its quotes (two per text; an escaped one
    inside a text comes after a backslash, and those are taken off)."""
    if isinstance(batch, memoryview):
        quotes, lists = _count(batch, b'"'), _count(batch, b"[") - 1
        num_prompts = (quotes - _count(batch, b'\\"')) // 2 if quotes else lists
    else:
        num_prompts = len(batch)
    if num_prompts > max_prompts:
        raise InvalidParamError(
            "prompt", f"holds {num_prompts} prompts or more; at most {max_prompts} are admitted"
        )


def _count(view: memoryview, byte: bytes) -> int:
    """How often `byte` is in `view`, a slice at a time: no copy of the whole, and the GIL
    is free between slices."""
    return sum(
        bytes(view[start : start + _SCAN_BYTES]).count(byte)
        for start in range(0, len(view), _SCAN_BYTES)
    )


def _is_batch(head_view: memoryview) -> bool:
    """Whether a prompt is a list of prompts (texts or token-id lists), not one of ids."""
    head = bytes(head_view).lstrip()
    if not head.startswith(b"["):
        return False
    first = head[1:].lstrip()[:1]
    return first in (b"[", b'"')


def _decode_text(name: str, raw: msgspec.Raw, type_: Any = Any) -> Any:
    try:
        if type_ is Any:
            return _ANY.decode(raw)
        return msgspec.json.decode(raw, type=type_)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InvalidParamError(
            name, f"is not valid JSON text (invalid UTF-8 or a lone surrogate?): {exc}"
        ) from None
    except RecursionError:
        raise InvalidParamError(name, f"is {NESTED_TOO_DEEPLY}") from None


def _validated_elements(name: str, batch: Iterable[msgspec.Raw]) -> list[Any]:
    elements = []
    for index, raw in enumerate(batch):
        try:
            elements.append(_ELEMENTS[name].validate_python(_decode_text(name, raw)))
        except pydantic.ValidationError as exc:
            errors = exc.errors(include_url=False)
            located = [{**e, "loc": (name, index, *e["loc"])} for e in errors]
            raise RequestValidationError(located) from None
    return elements


def _validated_prompts(batch: Iterable[msgspec.Raw]) -> list[str | list[int]]:
    prompts: list[str | list[int]] = []
    for index, raw in enumerate(batch):
        value = _decode_text("prompt", raw)
        try:
            prompts.append(_PROMPT.validate_python(value))
        except pydantic.ValidationError:
            raise InvalidParamError(
                "prompt", f"[{index}] must be a text or a list of token ids"
            ) from None
    return prompts


# a surrogate's escape: a high half with no low half after it, or a low half (whether a high
# half is before it, and whether the backslash is itself escaped, is checked on each match)
_SURROGATE = re.compile(
    rb"\\u[dD](?:[89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD])[c-fC-F][0-9a-fA-F]{2})"
)
_HIGH = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}")
_SCAN_BYTES = 1 << 20  # a slice of the scan: the GIL is given up between slices
_MARKERS = (b"\\ufdd0", b"\\ufdd1", b"\\ufdd2", b"\\ufdd3")  # noncharacters


def surrogate_error(body: bytes | bytearray) -> InvalidParamError | None:
    """The error naming the field (`messages.0.content`) that holds a lone surrogate, which
    the decoder refuses without saying where; None when there is none."""
    marker = next((m for m in _MARKERS if m not in body), None)
    if marker is None:
        return None
    patched, found = bytearray(body), False
    for start in range(0, len(body), _SCAN_BYTES):  # lookaheads see past each slice
        end = min(len(body), start + _SCAN_BYTES + 12)
        for match in _SURROGATE.finditer(body, start, end):
            at = match.start()
            if at < start + _SCAN_BYTES and _is_lone(body, at):
                patched[at : at + 6] = marker  # as long: offsets hold
                found = True
    if not found:
        return None
    path = _path_to(_ROOT, bytes(patched), marker, [])
    if path is None:
        return None
    where = ".".join(path)
    return InvalidParamError(where, "holds a lone surrogate (not Unicode text)")


def _is_lone(body: bytes | bytearray, at: int) -> bool:
    """Whether the surrogate escape at `at` is one (its backslash not escaped) and alone:
    a high half is (the pattern saw no low one after it); a low half is, unless after a high."""
    if not _is_escape(body, at):
        return False
    if body[at + 3 : at + 4] not in b"cdefCDEF":
        return True
    before = max(0, at - 6)
    return not (_HIGH.fullmatch(body, before, at) and _is_escape(body, before))


def _is_escape(body: bytes | bytearray, at: int) -> bool:
    """Whether the backslash at `at` starts an escape: an even number of backslashes before it."""
    run = body[max(0, at - 64) : at]
    return (len(run) - len(run.rstrip(b"\\"))) % 2 == 0


def _path_to(decoder: Any, raw: bytes, marker: bytes, path: list[str]) -> list[str] | None:
    """The path of the scalar whose JSON holds `marker`, in containers decoded one level at
    a time."""
    try:
        node = decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return path if path else None
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, value in items:
        if marker not in bytes(value):
            continue
        head = bytes(value).lstrip()[:1]
        if head == b"{":
            return _path_to(_ROOT, bytes(value), marker, [*path, str(key)])
        if head == b"[":
            return _path_to(_ARRAY, bytes(value), marker, [*path, str(key)])
        return [*path, str(key)]
    return None


def _invalid_json(message: str) -> RequestValidationError:
    return RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": message}])
