"""The wire walker that names the field of a request that does not parse, on hand-built bytes."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.server.decode import MESSAGE_FIELD, find_wire_fault
from asyncengine.v1 import control_pb2 as cpb
from asyncengine.v1 import generation_pb2 as pb

NOT_UTF8 = b"\xff\xfe"


def varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes([*out, value])


def tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def length_delimited(number: int, payload: bytes) -> bytes:
    return tag(number, 2) + varint(len(payload)) + payload


def fault_field(data: bytes, message_type: Any = pb.GenerateRequest) -> str | None:
    """The field the walker blames, after checking the real parser rejects the bytes too."""
    fault = find_wire_fault(data, message_type.DESCRIPTOR)
    if fault is not None:
        with pytest.raises(DecodeError):
            message_type.FromString(data)
    return None if fault is None else fault.field


def stopping(*stops: bytes) -> bytes:
    """A GenerateRequest's `stopping` (field 6) holding these stop strings (field 3)."""
    return length_delimited(6, b"".join(length_delimited(3, s) for s in stops))


def test_valid_messages_have_no_fault() -> None:
    request = pb.GenerateRequest(
        text="안녕 🍕",
        request_id="r1",
        priority=-3,
        sampling=pb.SamplingOptions(temperature=0.5, seed=2**63),
        stopping=pb.StoppingOptions(stop=["a", "b"], stop_token_ids=[1, 300, 70000]),
    )
    assert fault_field(request.SerializeToString()) is None
    batch = pb.GenerateBatchRequest(
        prompts=[pb.Prompt(text="x"), pb.Prompt(token_ids={"ids": [5]})]
    )
    assert fault_field(batch.SerializeToString(), pb.GenerateBatchRequest) is None
    assert fault_field(b"") is None


def test_top_level_string() -> None:
    assert fault_field(length_delimited(1, b"hi") + length_delimited(3, NOT_UTF8)) == "request_id"
    assert fault_field(length_delimited(1, b"ok" + NOT_UTF8)) == "text"


def test_nested_repeated_string_is_named_with_its_index() -> None:
    assert fault_field(stopping(b"a", b"b", b"c" + NOT_UTF8)) == "stopping.stop[2]"
    # only the first bad string is named
    assert fault_field(stopping(NOT_UTF8) + length_delimited(3, NOT_UTF8)) == "stopping.stop[0]"


def test_repeated_message_index_then_its_field() -> None:
    prompts = length_delimited(1, length_delimited(1, b"fine")) + length_delimited(
        1, length_delimited(1, NOT_UTF8)
    )
    assert fault_field(prompts, pb.GenerateBatchRequest) == "prompts[1].text"
    ids = cpb.AbortRequest(request_ids=["a", "b"]).SerializeToString()
    assert fault_field(ids + length_delimited(1, NOT_UTF8), cpb.AbortRequest) == "request_ids[2]"


def test_where_the_wire_format_breaks() -> None:
    # a length past the end: the field it belongs to
    assert fault_field(tag(3, 2) + varint(10) + b"abc") == "request_id"
    assert fault_field(length_delimited(6, tag(3, 2) + varint(9) + b"x")) == "stopping.stop[0]"
    # a torn tag, field number 0: outside any field
    assert fault_field(b"\xff\xff") == MESSAGE_FIELD
    assert fault_field(tag(0, 0) + b"\x01") == MESSAGE_FIELD
    # an end-group with no group: the field its tag names
    assert fault_field(tag(4, 4)) == "priority"
    # a torn tag inside a sub-message: that sub-message
    assert fault_field(length_delimited(6, b"\x80")) == "stopping"
    # a fixed32 (temperature, a float) cut short
    assert fault_field(length_delimited(5, tag(1, 5) + b"\x00\x00")) == "sampling.temperature"


def test_unknown_fields_and_other_wire_types_are_skipped_as_the_parser_does() -> None:
    unknown = tag(99, 0) + varint(7) + tag(98, 1) + bytes(8) + length_delimited(97, NOT_UTF8)
    group = tag(96, 3) + length_delimited(1, NOT_UTF8) + tag(96, 4)
    assert fault_field(unknown + group) is None
    pb.GenerateRequest.FromString(unknown + group)
    # request_id sent as a varint is an unknown field, so it is no element of `stop` either
    as_varint = length_delimited(3, b"a") + tag(3, 0) + varint(1) + length_delimited(3, NOT_UTF8)
    assert fault_field(length_delimited(6, as_varint)) == "stopping.stop[1]"


def test_groups_nested_past_the_parsers_limit_are_a_fault_not_a_recursion_error() -> None:
    deep = tag(1, 3) * 5000 + tag(1, 4) * 5000
    assert fault_field(deep) == "text"


def test_the_walk_gives_up_past_its_field_budget() -> None:
    """It runs on the event loop: a fault behind 100k tiny fields is not searched for."""
    many = (tag(4, 0) + varint(1)) * 100_000
    assert fault_field(many + length_delimited(3, NOT_UTF8)) is None
    assert fault_field(length_delimited(3, NOT_UTF8) + many) == "request_id"


VALID = [
    pb.GenerateRequest(
        text="héllo",
        request_id="id-7",
        sampling=pb.SamplingOptions(temperature=0.0, top_k=4),
        stopping=pb.StoppingOptions(stop=["x", "yz"], stop_token_ids=[9, 999]),
    ).SerializeToString(),
    pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), cache_salt="s").SerializeToString(),
]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid request with a few bytes set, cut or inserted."""
    data = bytearray(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data)))
        edit = draw(st.sampled_from(["set", "cut", "insert"]))
        if edit == "set" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif edit == "cut":
            del data[at:]
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=3))
    return bytes(data)


@settings(max_examples=400, deadline=None)
@given(st.one_of(mutated(), st.binary(max_size=40)))
def test_a_fault_is_named_only_where_the_parser_fails_too(data: bytes) -> None:
    fault_field(data)  # checks the parser's verdict whenever the walker finds a fault
