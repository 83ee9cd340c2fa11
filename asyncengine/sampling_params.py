"""Per-request sampling and stopping parameters, validated at construction."""

from __future__ import annotations

import enum
import json as _json
import math
from collections.abc import Iterable, Sized
from dataclasses import dataclass, field
from typing import Any

from asyncengine.errors import InvalidRequestError
from asyncengine.json_schema_rules import schema_problem

_GREEDY_EPS = 1e-5
MAX_SAMPLES = 64
MAX_SEED = 2**63  # a seed is in [0, MAX_SEED); sample i of n > 1 runs (seed + i) % MAX_SEED
# integers travel to the engine process as msgpack's 64-bit ones: a count or rank past this
# is refused by its field's name (it failed in the hand-off, a server error)
MAX_INT = 2**63 - 1
# bounds on what one request may carry, checked by count before anything is copied or scanned
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LEN = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024
MAX_ALLOWED_TOKEN_IDS = 4096  # the mask is built from them on every step
_IN_INT64_FROM_0 = "must be in [0, 2**63)"
_IN_INT64_FROM_1 = "must be in [1, 2**63)"
_MAX_SHOWN = 120  # characters of a bad value an error message repeats
# bounds on a constraint, measured before it is parsed or compiled
MAX_CONSTRAINT_LEN = 64 * 1024  # characters of a schema, regex or grammar
MAX_CHOICES = 256
MAX_CHOICE_LEN = 1024
_CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


class RequestOutputKind(enum.Enum):
    """What each output of `generate` carries (vLLM's names)."""

    CUMULATIVE = enum.auto()  # everything so far
    DELTA = enum.auto()  # only what is new since the last output the caller took
    FINAL_ONLY = enum.auto()  # one output, the final one


@dataclass
class StructuredOutputsParams:
    """A constraint on a request's output (vLLM's shape): set exactly one field.

    `json`: a JSON schema (a dict, or its JSON text) the output validates against; `regex`: a
    pattern the whole output matches; `choice`: the output is one of these strings; `grammar`:
    an EBNF grammar (xgrammar's dialect of GBNF, start rule `root`); `json_object=True`: any
    JSON object. `disable_any_whitespace` makes JSON compact (`", "` and `": "` only); the
    default (vLLM's) allows any whitespace between tokens, which some models emit without end
    (docs/operations.md). Each value is bounded and checked here, a schema also for keywords
    the grammar would not enforce (json_schema_rules.py); a schema, regex or grammar that does
    not compile is an error naming its field when the request is added, before it is queued
    (`structured_outputs.regex`, ...).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        # json_object=False is unset; json=False is a schema (one that admits nothing)
        kinds = [
            k
            for k in _CONSTRAINT_KINDS
            if getattr(self, k) is not None and not (k == "json_object" and not self.json_object)
        ]
        if len(kinds) != 1:
            rule = "set exactly one of json, regex, choice, grammar or json_object"
            raise InvalidRequestError(
                "structured_outputs", rule + (f", got {' and '.join(kinds)}" if kinds else "")
            )
        if self.json is not None:
            self.json = _schema_text(self.json)
            _check_schema(self.json)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                is_text = isinstance(value, str) and value != ""
                sent = value if isinstance(value, str) else type(value).__name__
                _check(is_text, _field(name), "must be a non-empty string", sent)
                _check_len(value, _field(name))
        if self.choice is not None:
            _check_count(self.choice, _field("choice"), MAX_CHOICES)
            # a list, or any sequence (a protobuf repeated field), copied once it is bounded
            is_sequence = isinstance(self.choice, Iterable) and not isinstance(self.choice, str)
            choices = list(self.choice) if is_sequence else []
            _check(
                len(choices) > 0
                and all(isinstance(c, str) and 0 < len(c) <= MAX_CHOICE_LEN for c in choices),
                _field("choice"),
                f"must be 1 to {MAX_CHOICES} non-empty strings of at most {MAX_CHOICE_LEN} "
                "characters",
                [c[:MAX_CHOICE_LEN] if isinstance(c, str) else c for c in choices][:4],
            )
            self.choice = choices
        if self.json_object is not None:
            is_true = self.json_object is True
            _check(is_true, _field("json_object"), "must be True when set", self.json_object)

    @property
    def kind(self) -> str:
        """The constraint that is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(k for k in _CONSTRAINT_KINDS if getattr(self, k) not in (None, False))


@dataclass
class SamplingParams:
    """How one request samples and when it stops (vLLM's field names and defaults).

    `temperature=0` means greedy. `seed` makes a request's samples reproducible whatever else
    is in the batch. Every value is checked here on its own; a bad one raises
    `InvalidRequestError` (a `ValueError`) naming the field. What depends on the model (token
    ids against the vocabulary, lengths against the context) the engine's validator checks.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or vLLM's -1, taken as 0): every token
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
    # the logprob of each prompt token given the ones before it (the first gets None), with
    # this many top alternatives: what OpenAI's `echo` scores (lm-eval's loglikelihood)
    prompt_logprobs: int | None = None
    # keep only the prompt's last k tokens (left truncation; -1: the model's context length)
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # sample only these (vLLM's); None: any
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        stop: object = self.stop
        stops = [stop] if isinstance(stop, str) else self.stop or []
        _check_count(stops, "stop", MAX_STOP_STRINGS)
        _check_count(self.stop_token_ids or [], "stop_token_ids", MAX_STOP_TOKEN_IDS)
        _check_count(self.logit_bias or {}, "logit_bias", MAX_LOGIT_BIAS)
        _check_count(self.allowed_token_ids or [], "allowed_token_ids", MAX_ALLOWED_TOKEN_IDS)
        self.stop = list(stops)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.top_k == -1:  # vLLM's "no top-k"
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        _check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            "must be a StructuredOutputsParams",
            type(self.structured_outputs).__name__,
        )
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            _check(math.isfinite(value), name, "must be a finite number", value)
        _check(1 <= self.n <= MAX_SAMPLES, "n", f"must be in [1, {MAX_SAMPLES}]", self.n)
        if self.max_tokens is not None:
            _check(1 <= self.max_tokens <= MAX_INT, "max_tokens", _IN_INT64_FROM_1, self.max_tokens)
        _check(0 <= self.min_tokens <= MAX_INT, "min_tokens", _IN_INT64_FROM_0, self.min_tokens)
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens})",
                self.min_tokens,
            )
        _check(self.temperature >= 0.0, "temperature", "must be >= 0", self.temperature)
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]", self.top_p)
        _check(
            0 <= self.top_k <= MAX_INT,
            "top_k",
            f"{_IN_INT64_FROM_0} (0 or -1 disables)",
            self.top_k,
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]", self.min_p)
        if self.seed is not None:
            _check(0 <= self.seed < MAX_SEED, "seed", "must be in [0, 2**63)", self.seed)
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
            all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_LEN for s in self.stop),
            "stop",
            f"must be non-empty strings of at most {MAX_STOP_STRING_LEN} characters",
            [s[:MAX_STOP_STRING_LEN] for s in self.stop if isinstance(s, str)][:4],
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative integers",
            self.stop_token_ids,
        )
        if self.allowed_token_ids is not None:
            allowed = self.allowed_token_ids
            _check(
                len(allowed) > 0 and all(isinstance(t, int) and t >= 0 for t in allowed),
                "allowed_token_ids",
                "must be non-negative integers, at least one",
                allowed[:8],
            )
        if self.truncate_prompt_tokens is not None:
            keep = self.truncate_prompt_tokens
            is_valid = keep == -1 or 1 <= keep <= MAX_INT
            _check(is_valid, "truncate_prompt_tokens", "must be -1 or in [1, 2**63)", keep)
        if self.logprobs is not None:
            _check(0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]", self.logprobs)
        if self.prompt_logprobs is not None:
            _check(
                0 <= self.prompt_logprobs <= 20,
                "prompt_logprobs",
                "must be in [0, 20]",
                self.prompt_logprobs,
            )
        if self.logit_bias:
            _check(
                all(
                    isinstance(t, int) and t >= 0 and -100.0 <= b <= 100.0
                    for t, b in self.logit_bias.items()
                ),
                "logit_bias",
                "must map non-negative token ids to biases in [-100, 100]",
                dict(list(self.logit_bias.items())[:4]),
            )

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
        raise InvalidRequestError(name, f"{rule}, got {shown(value)}")


def shown(value: object) -> str:
    """What the caller sent, as an error repeats it: never more than a line of it."""
    if isinstance(value, int) and value.bit_length() > 256:  # repr refuses past 4300 digits
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


def _check_count(values: object, name: str, limit: int) -> None:
    """Bound a collection by its length alone, before anything walks it."""
    num_values = len(values) if isinstance(values, Sized) else 0
    if num_values > limit:
        raise InvalidRequestError(name, f"at most {limit} entries, got {num_values}")


def _field(name: str) -> str:
    return f"structured_outputs.{name}"


def _check_len(text: str, name: str) -> None:
    if len(text) > MAX_CONSTRAINT_LEN:
        raise InvalidRequestError(name, f"at most {MAX_CONSTRAINT_LEN} characters, got {len(text)}")


def _schema_text(schema: object) -> str:
    """A JSON schema as JSON text of a JSON object, bounded before it is parsed."""
    name = _field("json")
    if isinstance(schema, dict):
        try:
            text = _json.dumps(schema)
        except (TypeError, ValueError, RecursionError) as exc:
            raise InvalidRequestError(name, f"is not JSON-serializable: {exc}") from None
        _check_len(text, name)
        return text
    _check(isinstance(schema, str), name, "must be a dict or its JSON text", type(schema).__name__)
    assert isinstance(schema, str)
    _check_len(schema, name)
    try:
        parsed = _json.loads(schema)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequestError(name, f"is not valid JSON: {exc}") from None
    _check(
        isinstance(parsed, dict), name, "must be a JSON object (a schema)", type(parsed).__name__
    )
    return schema


def _check_schema(text: str) -> None:
    """Refuse what the grammar would not enforce (json_schema_rules.py); `text` is bounded."""
    problem = schema_problem(_json.loads(text))
    if problem is not None:
        raise InvalidRequestError(_field("json"), problem)


# vLLM's name for the same class before it was renamed (`vllm.sampling_params.GuidedDecodingParams`)
GuidedDecodingParams = StructuredOutputsParams
