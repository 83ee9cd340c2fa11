"""Hypothesis strategies for any .proto message, built from its descriptor.

Every field gets values by its type (boundaries of the type, NaN and infinities, empty, long and
Korean or emoji strings, repeated fields with none, a few or very many elements); `Limits` adds the
server's own boundaries (vocabulary size, context length, max_num_seqs). In a message of options
each scalar field is mostly left at its default, so that most requests have a few odd fields and
still reach the engine. A few fields, found by name, get a narrower mix: see FIELD_HINTS.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

F = FieldDescriptor
# each repeated field and each string stays under these, so a request stays under ~1 MiB
MAX_REPEATED_BYTES = 128 << 10
MAX_STRING_CHARS = 32 << 10
_FLOAT32_MAX = 3.4028234663852886e38
UNSET: Any = object()  # a field left unset
# an option (a scalar field or an optional oneof of a message with 3+ fields) is left unset
# this many times to one draw at most
MAX_SPARSITY = 6


@dataclass(frozen=True)
class Limits:
    """The serving model's boundaries (from Control.GetModelInfo)."""

    vocab_size: int
    max_context_len: int
    max_num_seqs: int


def is_token_id_field(field: FieldDescriptor) -> bool:
    """`TokenIds.ids`, `stop_token_ids`, ...: integers the server must check against the vocab."""
    is_int = field.type in (F.TYPE_UINT32, F.TYPE_INT32, F.TYPE_UINT64, F.TYPE_INT64)
    return is_int and (field.name == "ids" or field.name.endswith("token_ids"))


def token_id_values(msg: Message, path: str = "") -> Iterator[tuple[str, int]]:
    """(field path, value) of every token id set anywhere in `msg`."""
    for field, value in msg.ListFields():
        name = f"{path}{field.name}"
        if field.type == F.TYPE_MESSAGE:
            items = enumerate(value) if field.is_repeated else [(None, value)]
            for i, item in items:
                yield from token_id_values(item, name + ("" if i is None else f"[{i}]") + ".")
        elif is_token_id_field(field):
            yield from ((name, v) for v in (value if field.is_repeated else [value]))


def field_path_exists(descriptor: Descriptor, path: str) -> bool:
    """Whether `path` (`stopping.max_new_tokens`, `prompts[3].text`) names a field or oneof."""
    *parents, last = [part.split("[", 1)[0] for part in path.split(".")]
    for name in parents:
        field = descriptor.fields_by_name.get(name)
        if field is None or field.message_type is None:
            return False
        descriptor = field.message_type
    return last in descriptor.fields_by_name or last in descriptor.oneofs_by_name


def literal(msg: Message) -> str:
    """`msg` as a Python expression that rebuilds it, short even for huge repeated fields and
    long strings (`stop=['a'] * 5000`, `text='양' * 32768`): for failure reports."""
    fields = ", ".join(f"{f.name}={_literal(f, v)}" for f, v in msg.ListFields())
    return f"{msg.DESCRIPTOR.name}({fields})"


def weighted(*pairs: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """One of the strategies, each drawn about `weight` times as often.

    (`st.one_of` would not do: it draws a strategy listed twice no more often than once.)
    """
    return st.sampled_from([s for weight, s in pairs for _ in range(weight)]).flatmap(_itself)


def _itself(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return strategy


INTERESTING_STRINGS = [
    "Hello, my name is", "", " ", "a", "\n", "\x00", "x#1", "<s>", "</s>", "<pad>", "<unused_3>",
    "\ufffd",
    "양자역학 설명해줄래?", "봄", "🍕", "👩‍👩‍👧‍👦", "e\u0301", "\u202eabc", "\ufeff", "\U0010ffff",
    "def f(x):\n    return x",
]  # fmt: skip
_LONG_UNITS = ["a", "양", "🍕", "hello ", "<s>", "x#1"]
# request ids that collide with each other and with the `#i` suffix of an n > 1 request's samples
REQUEST_IDS = ["x", "x#1", "", "x#0", "x#2", "x#1#0", "#", "x-0"]


class Strategies:
    """`Strategies(limits).message(descriptor)`: a strategy of messages of that type."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._cache: dict[str, st.SearchStrategy[Message]] = {}

    def message(self, descriptor: Descriptor) -> st.SearchStrategy[Message]:
        name = descriptor.full_name
        if name not in self._cache:
            self._cache[name] = st.deferred(lambda: self._build(descriptor))
        return self._cache[name]

    def _build(self, descriptor: Descriptor) -> st.SearchStrategy[Message]:
        message_class = message_factory.GetMessageClass(descriptor)
        groups = []  # each draws a list of (field, value) to set
        options = []  # the same, for groups mostly left unset
        in_real_oneof: set[str] = set()
        is_option_bag = len(descriptor.fields) > 2
        for oneof in descriptor.oneofs:
            if _is_synthetic(oneof):
                continue
            in_real_oneof.update(f.name for f in oneof.fields)
            members = [st.tuples(st.just(f), self.value(f)).map(_one) for f in oneof.fields]
            if is_option_bag and all(f.number != 1 for f in oneof.fields):
                options.append(weighted(*((1, m) for m in members)))  # GenerateRequest.constraint
            else:  # the message's subject (GenerateRequest.prompt): mostly set
                groups.append(weighted(*((3, m) for m in members), (1, st.just([]))))
        for field in descriptor.fields:
            if field.name in in_real_oneof:
                continue
            value = self.value(field)
            if field.name in FIELD_HINTS or field.is_repeated:
                pass  # a hint decides presence itself; a repeated field can be empty anyway
            elif field.type == F.TYPE_MESSAGE:
                value = weighted((3, value), (1, st.just(UNSET)))
            elif is_option_bag:
                if field.type == F.TYPE_BOOL and not field.has_presence:
                    value = st.just(True)  # False is the default, the same as unset
                elif not field.has_presence:
                    value = value.filter(_differs_from(field.default_value))
                options.append(value.map(_assignments(field)))
                continue
            elif field.has_presence:
                value = st.one_of(st.just(UNSET), value)
            groups.append(value.map(_assignments(field)))
        # about one option set per message: most requests have few odd fields and get past
        # validation to the engine
        sparsity = min(MAX_SPARSITY, len(options))
        groups += [weighted((sparsity, st.just([])), (1, option)) for option in options]

        def make(assignments: tuple[list[tuple[FieldDescriptor, Any]], ...]) -> Message:
            msg = message_class()
            for field, value in (pair for group in assignments for pair in group):
                _assign(msg, field, value)
            return msg

        return st.tuples(*groups).map(make)

    def value(self, field: FieldDescriptor) -> st.SearchStrategy[Any]:
        """A value for `field`: a list for a repeated field, UNSET for an unset optional one."""
        hint = FIELD_HINTS.get(field.name)
        element = hint(self, field) if hint else self.scalar(field)
        return self.repeated(element) if field.is_repeated else element

    def scalar(self, field: FieldDescriptor) -> st.SearchStrategy[Any]:
        kind = field.type
        if kind == F.TYPE_MESSAGE:
            return self.message(field.message_type)
        if kind == F.TYPE_BOOL:
            return st.booleans()
        if kind == F.TYPE_STRING:
            return strings()
        if kind == F.TYPE_BYTES:
            return st.binary(max_size=64)
        if kind in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
            return floats(32) if kind == F.TYPE_FLOAT else floats(64)
        if kind == F.TYPE_ENUM:
            numbers = [v.number for v in field.enum_type.values]
            return st.one_of(st.sampled_from(numbers), st.sampled_from([-1, max(numbers) + 1]))
        if is_token_id_field(field):
            return self.token_ids(field)
        return self.integers(field)

    def integers(self, field: FieldDescriptor) -> st.SearchStrategy[int]:
        low, high = _INT_RANGES[field.type]
        limits = self.limits
        near = [
            0, 1, 2, limits.max_num_seqs, limits.max_num_seqs + 1,
            limits.max_context_len - 1, limits.max_context_len, limits.max_context_len + 1,
            high, high - 1, low, low + 1, 2**31 - 1, 2**31, 2**32 - 1, -1, -(2**31),
        ]  # fmt: skip
        boundaries = sorted({v for v in near if low <= v <= high})
        return weighted(
            (3, st.integers(max(low, -2), 8)),
            (1, st.sampled_from(boundaries)),
            (1, st.integers(low, high)),
        )

    def token_ids(self, field: FieldDescriptor) -> st.SearchStrategy[int]:
        vocab = self.limits.vocab_size
        high = _INT_RANGES[field.type][1]
        beyond = st.sampled_from([vocab, vocab + 1, 2 * vocab, high])
        return weighted(
            (4, st.integers(3, vocab - 1)),  # ordinary tokens (0, 1, 2 are <s>, </s>, <pad>)
            (1, st.sampled_from([0, 1, 2, vocab - 1])),
            (1, beyond),
        )

    def repeated(self, element: st.SearchStrategy[Any]) -> st.SearchStrategy[list[Any]]:
        """No elements, a few, or one element many times (up to MAX_REPEATED_BYTES)."""
        limits = self.limits
        counts = [17, limits.max_context_len - 1, limits.max_context_len, 5000, 100_000]
        many = st.tuples(element, st.sampled_from(counts)).map(
            lambda ec: [ec[0]] * max(1, min(ec[1], MAX_REPEATED_BYTES // _wire_size(ec[0])))
        )
        few = st.lists(element, min_size=1, max_size=6).map(_within_budget)
        return weighted((3, few), (2, st.just([])), (1, many))


def strings() -> st.SearchStrategy[str]:
    long = st.tuples(st.sampled_from(_LONG_UNITS), st.sampled_from([300, 2000, 40_000])).map(
        lambda uc: (uc[0] * uc[1])[:MAX_STRING_CHARS]
    )
    return weighted((3, st.sampled_from(INTERESTING_STRINGS)), (2, st.text(max_size=12)), (1, long))


def floats(width: Literal[32, 64]) -> st.SearchStrategy[float]:
    special = [math.nan, math.inf, -math.inf, -0.0, 0.0, 1.0, -1.0, 0.5, 2.0, 1e-45, 1e-6]
    special += [_FLOAT32_MAX, -_FLOAT32_MAX]
    return weighted(
        (3, st.floats(0.0, 1.0, width=width)),
        (1, st.sampled_from(special)),
        (1, st.floats(-2.0, 2.0, width=width)),
        (1, st.floats(width=width)),  # NaN, infinities and huge values included
    )


def _max_new_tokens(strategies: Strategies, field: FieldDescriptor) -> st.SearchStrategy[Any]:
    return weighted((12, st.integers(0, 8)), (2, strategies.integers(field)), (1, st.just(UNSET)))


def _request_id(strategies: Strategies, field: FieldDescriptor) -> st.SearchStrategy[str]:
    return weighted((3, st.sampled_from(REQUEST_IDS)), (1, strings()))


def _lora_name(strategies: Strategies, field: FieldDescriptor) -> st.SearchStrategy[str]:
    # mostly the base model: a name the server lacks ends the call before the engine sees it
    return weighted((8, st.just("")), (1, strings()))


# field name -> its values' strategy, where the type's full range would make calls slow or
# never collide; a hinted optional field decides its own presence (UNSET is one of its values)
FIELD_HINTS: dict[str, Callable[[Strategies, FieldDescriptor], st.SearchStrategy[Any]]] = {
    "max_new_tokens": _max_new_tokens,
    "request_id": _request_id,
    "request_ids": _request_id,
    "lora_name": _lora_name,
}


_INT_RANGES = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1),
    F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1),
    F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1),
    F.TYPE_SINT64: (-(2**63), 2**63 - 1),
    F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1),
    F.TYPE_FIXED64: (0, 2**64 - 1),
}


def _is_synthetic(oneof: Any) -> bool:
    """The oneof protoc makes for a proto3 `optional` field (`_name` around one field)."""
    fields = oneof.fields
    return len(fields) == 1 and oneof.name == f"_{fields[0].name}"


def _differs_from(default: Any) -> Callable[[Any], bool]:
    return lambda value: value != default


def _one(pair: tuple[FieldDescriptor, Any]) -> list[tuple[FieldDescriptor, Any]]:
    return [pair]


def _assignments(field: FieldDescriptor) -> Callable[[Any], list[tuple[FieldDescriptor, Any]]]:
    return lambda value: [] if value is UNSET else [(field, value)]


def _assign(msg: Message, field: FieldDescriptor, value: Any) -> None:
    if field.is_repeated:
        getattr(msg, field.name).extend(value)
    elif field.type == F.TYPE_MESSAGE:
        getattr(msg, field.name).CopyFrom(value)
    else:
        setattr(msg, field.name, value)


def _literal(field: FieldDescriptor, value: Any) -> str:
    if not field.is_repeated:
        return _scalar_literal(value)
    runs: list[list[Any]] = []  # runs of equal items
    for item in value:
        if runs and runs[-1][0] == item:
            runs[-1].append(item)
        else:
            runs.append([item])
    parts: list[str] = []
    loose: list[Any] = []  # the items of short runs, written out one by one
    for run in [*runs, []]:
        if len(run) > 2 or not run:
            if loose:
                parts.append(f"[{', '.join(map(_scalar_literal, loose))}]")
                loose = []
            if run:
                parts.append(f"[{_scalar_literal(run[0])}] * {len(run)}")
        else:
            loose += run
    return " + ".join(parts) or "[]"


def _scalar_literal(value: Any) -> str:
    if isinstance(value, Message):
        return literal(value)
    if isinstance(value, float) and not math.isfinite(value):
        return f"float('{value}')"
    if isinstance(value, str) and len(value) > 80:
        for period in range(1, 17):  # the long strings drawn repeat a short unit
            count, rest = divmod(len(value), period)
            if value == value[:period] * count + value[:rest]:
                return f"{value[:period]!r} * {count}" + (f" + {value[:rest]!r}" if rest else "")
        if len(value) > 2000:  # rare: only a shrunk long string has no short unit
            return f"{value[:500]!r} + '<{len(value) - 500} more characters cut>'"
    return repr(value)


def _within_budget(items: list[Any]) -> list[Any]:
    """The longest prefix of `items` (at least one) within MAX_REPEATED_BYTES."""
    total = 0
    for i, item in enumerate(items):
        total += _wire_size(item)
        if total > MAX_REPEATED_BYTES:
            return items[: max(1, i)]
    return items


def _wire_size(value: Any) -> int:
    if isinstance(value, Message):
        return value.ByteSize() + 3
    if isinstance(value, str):
        return len(value.encode()) + 3
    return 10
