"""Typed results: plain dataclasses mirroring the asyncengine.v1 messages, free of protobuf."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, TypeVar

from google.protobuf.message import Message

from asyncengine_client.v1 import control_pb2, generation_pb2

T = TypeVar("T")


class FinishReason(str, enum.Enum):
    """Why a sample ended (`asyncengine.v1.FinishReason`, lower-cased)."""

    UNSPECIFIED = "unspecified"
    LENGTH = "length"  # max_new_tokens reached
    CONTEXT_LIMIT = "context_limit"
    EOS = "eos"
    STOP_STRING = "stop_string"
    STOP_TOKEN = "stop_token"
    TIME_LIMIT = "time_limit"
    CANCELLED = "cancelled"  # Control.Abort
    ABORTED_BY_SERVER = "aborted_by_server"  # drain or shutdown

    @classmethod
    def from_proto(cls, value: int) -> FinishReason:
        name = generation_pb2.FinishReason.Name(value)
        return cls(name.removeprefix("FINISH_REASON_").lower())


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    token: str


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """The sampled token's logprob and the top alternatives at one position."""

    sampled: TokenLogprob
    top: list[TokenLogprob]


@dataclasses.dataclass(frozen=True)
class Accepted:
    """Always the first stream event: the server admitted the request."""

    request_id: str
    prompt_tokens: int
    seed: int
    queue_position: int
    prompt_text: str
    prompt_token_ids: list[int]


@dataclasses.dataclass(frozen=True)
class Delta:
    """New text (never a partial UTF-8 character) of one sample."""

    sample_index: int
    sequence_number: int
    token_offset: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    completion_tokens: int


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """Sent while nothing is produced (queued, long prefill, preempted)."""

    phase: str  # "queued", "prefill", "decode", "preempted"
    sequence_number: int


@dataclasses.dataclass(frozen=True)
class Finished:
    """One per sample, after its last Delta."""

    sample_index: int
    reason: FinishReason
    stop_string: str
    stop_token_id: int | None
    sequence_number: int


@dataclasses.dataclass(frozen=True)
class Usage:
    """Token counts and timings; the last stream event."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_time_s: float
    time_to_first_token_s: float
    decode_time_s: float
    preemptions: int
    sequence_number: int


StreamEvent = Accepted | Delta | Heartbeat | Finished | Usage


@dataclasses.dataclass(frozen=True)
class Completion:
    """The result of one prompt of a unary `generate`."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    stop_string: str
    stop_token_id: int | None
    logprobs: list[TokenLogprobs]
    usage: Usage


@dataclasses.dataclass(frozen=True)
class TokenizeResult:
    token_ids: list[int]
    tokens: list[str]  # set when return_tokens
    offsets: list[tuple[int, int]]  # character (start, end) per token, when return_offsets
    token_count: int


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    model_name: str
    architecture: str
    max_context_length: int
    vocab_size: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    block_size: int
    dtype: str
    device: str
    max_num_seqs: int
    max_num_batched_tokens: int
    max_queued_requests: int


@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
    """A LoRA adapter the server serves: requests give `lora_name` to generate with it."""

    lora_name: str
    lora_id: int
    lora_path: str
    base_model_name: str


@dataclasses.dataclass(frozen=True)
class LoadReport:
    running: int
    waiting: int
    swapped: int
    gpu_blocks_total: int
    gpu_blocks_free: int
    cpu_blocks_total: int
    cpu_blocks_free: int
    block_usage_ratio: float
    cpu_block_usage_ratio: float
    preemptions_swap: int
    preemptions_recompute: int


@dataclasses.dataclass(frozen=True)
class ServerInfo:
    version: str
    load: LoadReport
    uptime_s: float
    draining: bool


def from_proto(cls: type[T], msg: Message, **converted: Any) -> T:
    """`cls` from the same-named fields of `msg`: unset optionals become None, repeated a list.

    Fields that need more than that (nested messages, enums) are passed in `converted`.
    """
    values = dict(converted)
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if field.name in values:
            continue
        proto_field = msg.DESCRIPTOR.fields_by_name[field.name]
        if proto_field.is_repeated:
            values[field.name] = list(getattr(msg, field.name))
        elif proto_field.has_presence and not msg.HasField(field.name):
            values[field.name] = None
        else:
            values[field.name] = getattr(msg, field.name)
    return cls(**values)


def _logprobs(entries: Any) -> list[TokenLogprobs]:
    return [
        TokenLogprobs(
            sampled=from_proto(TokenLogprob, entry.sampled),
            top=[from_proto(TokenLogprob, top) for top in entry.top],
        )
        for entry in entries
    ]


def stream_event(msg: generation_pb2.GenerateResponse) -> StreamEvent:
    """The typed event held by one GenerateStream message."""
    kind = msg.WhichOneof("event")
    if kind == "accepted":
        return from_proto(Accepted, msg.accepted)
    if kind == "delta":
        return from_proto(Delta, msg.delta, logprobs=_logprobs(msg.delta.logprobs))
    if kind == "heartbeat":
        phase = generation_pb2.Heartbeat.Phase.Name(msg.heartbeat.phase).lower()
        return from_proto(Heartbeat, msg.heartbeat, phase=phase)
    if kind == "finished":
        reason = FinishReason.from_proto(msg.finished.reason)
        return from_proto(Finished, msg.finished, reason=reason)
    if kind == "usage":
        return from_proto(Usage, msg.usage)
    raise ValueError(f"unknown stream event {kind!r} (a newer server?)")


def completion(msg: generation_pb2.GenerateResult) -> Completion:
    return from_proto(
        Completion,
        msg,
        finish_reason=FinishReason.from_proto(msg.finish_reason),
        logprobs=_logprobs(msg.logprobs),
        usage=from_proto(Usage, msg.usage),
    )


def tokenize_result(msg: generation_pb2.TokenizeResult) -> TokenizeResult:
    offsets = [(offset.start, offset.end) for offset in msg.offsets]
    return from_proto(TokenizeResult, msg, offsets=offsets)


def load_report(msg: control_pb2.LoadReport) -> LoadReport:
    return from_proto(LoadReport, msg)


def server_info(msg: control_pb2.ServerInfo) -> ServerInfo:
    return from_proto(ServerInfo, msg, load=load_report(msg.load))
