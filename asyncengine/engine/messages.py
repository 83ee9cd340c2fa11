"""What crosses between the front process and the engine process: msgspec structs over ZMQ.

Every message is one tagged struct in one frame; each side decodes with one typed decoder
(a message that does not decode is logged and, if it names a request, fails that request
alone). The engine's own dataclasses (`ValidatedRequest`, `RequestOutput`, `EngineStats`)
travel as they are: msgspec encodes dataclasses and enums natively, several times faster
than pickle, so there is no second copy of their fields to keep in step.

    front -> engine   AddRequest, AbortRequests, ResetPrefixCache, OutputsTaken, AddLoRA,
                      RemoveLoRA, ListLoRAs, Shutdown
    engine -> front   Ready, StepOutputs, Added, Aborted, PrefixCacheReset, LoRAAnswer,
                      Heartbeat, Failed

While the front has not taken the last `StepOutputs` (its `OutputsTaken` says it has), the
engine gathers the steps it makes meanwhile into the next one (engine/output_batch.py).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import msgspec

from asyncengine.core.kv_events import KvEvent
from asyncengine.engine.llm_engine import EngineStats
from asyncengine.engine.validator import ValidatedRequest
from asyncengine.errors import InvalidRequestError, LoRAInUseError, LoRANotFoundError
from asyncengine.lora.request import LoRARequest
from asyncengine.outputs import RequestOutput


@dataclass
class StepStats:
    """What one step took and moved, for an `EngineObserver`."""

    schedule_s: float
    execute_s: float  # block moves, forward and sampling
    update_s: float  # token appends, stop checks, detokenization
    num_generated_tokens: int
    num_blocks_swapped_out: int
    num_blocks_swapped_in: int


# -- front -> engine ------------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    """Queue a validated request (its id is the core's own, unique per engine)."""

    request_id: str
    request: ValidatedRequest


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    """Abort requests by core id; `Aborted` with the same ticket answers after their finals."""

    ticket: int
    request_ids: list[str]


class ResetPrefixCache(msgspec.Struct, tag=True, array_like=True):
    """Forget every cached prefix if no request holds a block; `PrefixCacheReset` answers."""

    ticket: int


class OutputsTaken(msgspec.Struct, tag=True, array_like=True):
    """The front has handed every `StepOutputs` it received to its streams: the engine may
    send the next one (until then it gathers its steps' outputs into one)."""


class AddLoRA(msgspec.Struct, tag=True, array_like=True):
    """Register an adapter (read off the step); `LoRAAnswer` with the ticket answers."""

    ticket: int
    lora_request: LoRARequest


class RemoveLoRA(msgspec.Struct, tag=True, array_like=True):
    """Forget an adapter no request uses; `LoRAAnswer` answers."""

    ticket: int
    lora_int_id: int


class ListLoRAs(msgspec.Struct, tag=True, array_like=True):
    """The registered adapters' ids; `LoRAAnswer` answers with them."""

    ticket: int


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Abort what is in flight and exit."""


ToEngine = (
    AddRequest
    | AbortRequests
    | ResetPrefixCache
    | OutputsTaken
    | AddLoRA
    | RemoveLoRA
    | ListLoRAs
    | Shutdown
)


# -- engine -> front ------------------------------------------------------------------------


class Ready(msgspec.Struct, tag=True, array_like=True):
    """The engine is built: what the front door needs that only the engine knows."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    num_gpu_blocks: int
    stats: EngineStats


class StepOutputs(msgspec.Struct, tag=True, array_like=True, gc=False):
    """The outputs of the steps made since the last one (one per request, merged), or an
    abort's finals, with each step's figures in order and the engine's figures now.

    Outputs carry no prompt: the front's stream has it. `phases` (every request's phase, for
    heartbeats to callers) comes at most every few hundred milliseconds.
    """

    outputs: list[RequestOutput]
    steps: list[StepStats]
    stats: EngineStats
    phases: dict[str, str] | None = None
    kv_events: list[KvEvent] = []  # the step's prefix-cache events, when they are on


class Added(msgspec.Struct, tag=True, array_like=True):
    """The answer to a constrained `AddRequest` (or to one the engine could not queue).

    `error_field` names the invalid field (an `InvalidRequestError`); `error` alone, without
    a field, is an engine bug queuing it; `is_aborted`: aborted while its grammar compiled.
    """

    request_id: str
    is_aborted: bool = False
    error_field: str | None = None
    error: str | None = None
    constraint_kind: str | None = None
    compile_s: float | None = None


class Aborted(msgspec.Struct, tag=True, array_like=True):
    """The answer to `AbortRequests`: the ids it aborted (a request that finished in the step
    the abort raced is not among them). Their finals came in a `StepOutputs` before this."""

    ticket: int
    request_ids: list[str]


class PrefixCacheReset(msgspec.Struct, tag=True, array_like=True):
    """Whether `ResetPrefixCache` with this ticket reset the cache (its CLEARED event came in
    a `StepOutputs` before this)."""

    ticket: int
    is_reset: bool


class LoRAAnswer(msgspec.Struct, tag=True, array_like=True):
    """The answer to a LoRA call: its result (added / removed) and the registered ids, or
    the error a caller can act on (`error_kind` "invalid" with its field, "not_found",
    "in_use")."""

    ticket: int
    result: bool = False
    lora_int_ids: list[int] = []
    error_kind: str | None = None
    error_field: str | None = None
    error: str | None = None
    lora_int_id: int = 0  # the adapter an in_use error names
    num_requests: int = 0  # (and how many requests use it)
    not_found: str | int = 0  # the name or id a not_found error names

    @classmethod
    def failed(cls, ticket: int, exc: Exception) -> LoRAAnswer:
        """The answer carrying `exc` (InvalidRequestError or a LoRA error)."""
        if isinstance(exc, InvalidRequestError):
            return cls(ticket, error_kind="invalid", error_field=exc.field, error=exc.description)
        if isinstance(exc, LoRAInUseError):
            return cls(
                ticket, error_kind="in_use", lora_int_id=exc.lora_int_id,
                num_requests=exc.num_requests,
            )  # fmt: skip
        assert isinstance(exc, LoRANotFoundError), exc
        return cls(ticket, error_kind="not_found", not_found=exc.name_or_id)

    def exception(self) -> Exception | None:
        if self.error_kind == "invalid":
            return InvalidRequestError(self.error_field or "lora_request", self.error or "")
        if self.error_kind == "in_use":
            return LoRAInUseError(self.lora_int_id, self.num_requests)
        if self.error_kind == "not_found":
            return LoRANotFoundError(self.not_found)
        return None


class Heartbeat(msgspec.Struct, tag=True, array_like=True):
    """Sent every heartbeat interval by a thread of its own, whatever the steps are doing."""


class Failed(msgspec.Struct, tag=True, array_like=True):
    """The engine process is dying: why, its traceback, and the exception pickled when it
    comes back whole (a start-up `ValueError` is raised in the front as it would in-process)."""

    reason: str
    traceback: str
    exception: bytes | None = None

    @classmethod
    def of(cls, reason: str, traceback: str, exc: BaseException | None) -> Failed:
        pickled = None
        if exc is not None:
            try:
                pickled = pickle.dumps(exc)
                pickle.loads(pickled)  # one that does not come back whole is not sent
            except Exception:
                pickled = None
        return cls(reason, traceback, pickled)

    def error(self) -> BaseException:
        if self.exception is not None:
            exc = pickle.loads(self.exception)
            if isinstance(exc, BaseException):
                return exc
        return RuntimeError(self.reason)


FromEngine = (
    Ready | StepOutputs | Added | Aborted | PrefixCacheReset | LoRAAnswer | Heartbeat | Failed
)


def request_id_of_malformed(frame: bytes) -> str | None:
    """The request id of an `AddRequest` whose request did not decode, if it can be read."""
    try:
        raw: Any = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return None
    if isinstance(raw, list) and len(raw) >= 2 and raw[0] == "AddRequest":
        request_id = raw[1]
        return request_id if isinstance(request_id, str) else None
    return None
