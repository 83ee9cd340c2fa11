"""Per-request sampling and stopping parameters, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
MAX_SAMPLES = 64


@dataclass
class SamplingParams:
    """How one request samples and when it stops (vLLM's field names and defaults).

    `temperature=0` means greedy. `seed` makes a request's samples reproducible whatever else
    is in the batch. Every field is checked here; a bad value raises `ValueError` naming it.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)  # a single string is accepted too
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        stop: object = self.stop
        self.stop = [stop] if isinstance(stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        _check(1 <= self.n <= MAX_SAMPLES, "n", f"must be in [1, {MAX_SAMPLES}]", self.n)
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", "must be >= 1", self.max_tokens)
        _check(self.min_tokens >= 0, "min_tokens", "must be >= 0", self.min_tokens)
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens})",
                self.min_tokens,
            )
        _check(self.temperature >= 0.0, "temperature", "must be >= 0", self.temperature)
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]", self.top_p)
        _check(self.top_k >= 0, "top_k", "must be >= 0 (0 disables)", self.top_k)
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]", self.min_p)
        if self.seed is not None:
            _check(0 <= self.seed < 2**63, "seed", "must be in [0, 2**63)", self.seed)
        _check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            "must be > 0",
            self.repetition_penalty,
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, "must be in [-2, 2]", value)
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "must be non-empty strings",
            self.stop,
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative integers",
            self.stop_token_ids,
        )
        if self.logprobs is not None:
            _check(0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]", self.logprobs)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _check(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} {rule}, got {value!r}")
