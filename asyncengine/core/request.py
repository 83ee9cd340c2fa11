"""Request state shared by the scheduler and the engine (no torch)."""

from __future__ import annotations

import dataclasses
import enum
import itertools
import time

from asyncengine.sampling_params import MAX_SEED, SamplingParams

_arrival_counter = itertools.count()


class RequestStatus(enum.Enum):
    """Where a request is; the precise reason a finished one ended is its `FinishReason`."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()  # could never be scheduled (too long for the cache)
    FINISHED_ERROR = enum.auto()  # a failure of this request alone (sampling, stops, text)

    @property
    def is_finished(self) -> bool:
        # a tuple compares by identity first: no Enum.__hash__ (Python code) per check, and
        # this runs several times per request per step
        return self not in _UNFINISHED


_UNFINISHED = (RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.SWAPPED)


class FinishReason(enum.Enum):
    """Why a sequence ended: decided once, where the stop is decided; front ends map it."""

    EOS = enum.auto()
    STOP_STRING = enum.auto()
    STOP_TOKEN = enum.auto()
    LENGTH = enum.auto()  # max_tokens reached
    CONTEXT_LIMIT = enum.auto()  # max_model_len reached
    CACHE_LIMIT = enum.auto()  # the whole KV cache is full: the sequence cannot grow
    ABORTED = enum.auto()
    REJECTED = enum.auto()  # could never be scheduled
    ERROR = enum.auto()  # this request's own failure; the engine kept stepping

    @property
    def status(self) -> RequestStatus:
        return _STATUS_OF[self]

    @property
    def vllm_name(self) -> str:
        """vLLM's `finish_reason` string: "stop", "length", "abort" or "error"."""
        return _VLLM_NAMES[self.status]


_STATUS_OF = {
    FinishReason.EOS: RequestStatus.FINISHED_STOPPED,
    FinishReason.STOP_STRING: RequestStatus.FINISHED_STOPPED,
    FinishReason.STOP_TOKEN: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.CONTEXT_LIMIT: RequestStatus.FINISHED_LENGTH,
    FinishReason.CACHE_LIMIT: RequestStatus.FINISHED_LENGTH,
    FinishReason.ABORTED: RequestStatus.FINISHED_ABORTED,
    FinishReason.REJECTED: RequestStatus.FINISHED_IGNORED,
    FinishReason.ERROR: RequestStatus.FINISHED_ERROR,
}
_VLLM_NAMES = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "error",
    RequestStatus.FINISHED_ERROR: "error",
}
_request_ids = itertools.count()


def new_request_id() -> str:
    """A fresh engine-internal id: callers' ids never reach the scheduler or the cache."""
    return str(next(_request_ids))


class Request:
    """One sequence being generated.

    Its tokens are the prompt followed by the outputs so far; `num_computed_tokens` of them
    have K/V in the cache. Every phase (prefill, chunked prefill, resume after recompute,
    decode) is the same thing: compute tokens until `num_computed_tokens == num_tokens`.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora_int_id: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        # requests with different salts never share prefix-cache blocks (per-tenant isolation)
        self.cache_salt = cache_salt
        # the LoRA adapter it runs with (0: the base model); it keys its cached blocks too
        self.lora_int_id = lora_int_id
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at admission
        # parallel sampling (n > 1): samples 1..n-1 are forked from this request once all but
        # the last prompt token is computed; each then computes that token itself
        self.group_id = request_id
        self.sample_index = 0
        self.num_pending_samples = sampling_params.n - 1
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # ties in priority go to the earlier arrival; the counter breaks exact-time ties
        self.sort_key = (priority, self.arrival_time, next(_arrival_counter))
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        # speculative decoding: the recent share of drafts accepted (a moving average), and
        # decode steps since speculation was last tried while that share was too low
        self.spec_acceptance = 1.0
        self.num_steps_without_spec = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens to compute before sampling; a parent stops short of its last prompt token
        until its samples are forked, so each sample samples its own first token."""
        return self.num_prompt_tokens - 1 if self.num_pending_samples else self.num_tokens

    @property
    def is_ready_to_fork(self) -> bool:
        return bool(self.num_pending_samples) and (
            self.num_computed_tokens == self.num_prompt_tokens - 1
        )

    def fork_sample(self, index: int) -> Request:
        """Sample `index` of this request (an id of its own, the same group): same prompt and
        K/V so far, seed `seed + index` (modulo 2**63, the seeds a request may give)."""
        params = self.sampling_params
        seed = None if params.seed is None else (params.seed + index) % MAX_SEED
        child = Request(
            new_request_id(),
            self.prompt_token_ids,
            dataclasses.replace(params, n=1, seed=seed),
            self.eos_token_ids,
            self.priority,
            self.arrival_time,
            self.cache_salt,
            self.lora_int_id,
        )
        child.sort_key = self.sort_key
        child.group_id = self.group_id
        child.sample_index = index
        child.num_computed_tokens = self.num_computed_tokens
        child.first_scheduled_time = self.first_scheduled_time
        return child

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status not in _UNFINISHED  # (RequestStatus.is_finished, one call less)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
