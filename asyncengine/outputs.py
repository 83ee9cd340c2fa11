"""What `generate()` returns: one `RequestOutput` per request, cumulative so far."""

from __future__ import annotations

from dataclasses import dataclass

# token id -> logprob for the sampled token and the top-n alternatives at one position
Logprobs = dict[int, float]


@dataclass
class CompletionOutput:
    """One sample of a request: text and token ids generated so far."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Logprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    # the stop string or stop token id that ended the sample (None for eos or length)
    stop_reason: str | int | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timings (time.monotonic seconds) and counts of one request, for usage reports."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0


@dataclass
class RequestOutput:
    """The state of one request after a step; `finished` is True on its last output."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None
    metrics: RequestMetrics | None = None
