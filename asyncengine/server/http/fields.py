"""What a request's fields ask for beyond sampling: the one constraint on its output (from
OpenAI's `response_format`, vLLM's `structured_outputs` or its older `guided_*` fields), the
fields refused unless they ask for nothing, and the log of the fields nobody here reads."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from asyncengine.errors import InvalidRequestError
from asyncengine.logging import get_logger
from asyncengine.sampling_params import StructuredOutputsParams
from asyncengine.server.http import protocol
from asyncengine.server.http.errors import InvalidParamError, UnsupportedParamError

logger = get_logger(__name__)

# the one backend of structured outputs here; vLLM's "auto" picks it too
BACKENDS = ("auto", "xgrammar")
_KINDS = ("json", "regex", "choice", "grammar")  # vLLM's guided_* names these
_ENGINE_FIELDS = {f.name for f in dataclasses.fields(StructuredOutputsParams)}
# vLLM's structured_outputs fields beside the engine's: honoured here, or refused when set
_VLLM_OPTIONS = {
    "backend": "BACKENDS",
    "disable_fallback": "honoured",  # nothing here falls back to another backend
    "whitespace_pattern": "use structured_outputs.disable_any_whitespace for compact JSON",
    "disable_additional_properties": "is not supported (set additionalProperties in the schema)",
    "structural_tag": "is not supported",
}


@dataclass
class Constraint:
    """The request's constraint (None: none), and the OpenAI fields that the engine's names
    of its parts (`structured_outputs.regex`) come from, for errors raised later."""

    params: StructuredOutputsParams | None = None
    names: dict[str, str] = field(default_factory=dict)


def constraint(
    request: protocol.CompletionRequest | protocol.ChatRequest,
) -> Constraint:
    """The constraint of at most one of `response_format`, `structured_outputs` and
    `guided_*`; two of them is a 400 naming the second. Options (compact JSON, the backend)
    go with any."""
    extra = dict(request.structured_outputs or {})
    options = _options(request, extra)
    sources: list[tuple[str, dict[str, Any], dict[str, str]]] = []
    response_format = _response_format(request.response_format)
    if response_format is not None:
        sources.append(response_format)
    if extra:  # its options taken out: json, regex, choice, grammar or json_object
        sources.append(("structured_outputs", extra, {}))
    for kind in _KINDS:
        value = getattr(request, f"guided_{kind}")
        if value is not None:
            name = f"guided_{kind}"
            sources.append((name, {kind: value}, {f"structured_outputs.{kind}": name}))
    if not sources:
        return Constraint()
    if len(sources) > 1:
        first, second = sources[0][0], sources[1][0]
        raise InvalidParamError(second, f"constrains the output as {first} does: give one")
    source, kinds, names = sources[0]
    names = {"structured_outputs": source, **names}
    try:
        params = StructuredOutputsParams(**kinds, **options)
    except InvalidRequestError as exc:
        raise InvalidParamError(names.get(exc.field, exc.field), exc.description) from None
    return Constraint(params, names)


def _options(
    request: protocol.CompletionRequest | protocol.ChatRequest, extra: dict[str, Any]
) -> dict[str, Any]:
    """The options of `structured_outputs` (taken out of `extra`), vLLM's checked."""
    unknown = sorted(set(extra) - _ENGINE_FIELDS - set(_VLLM_OPTIONS))
    if unknown:
        raise InvalidParamError("structured_outputs", f"unknown fields {unknown[:4]}")
    for name, rule in _VLLM_OPTIONS.items():
        value = extra.pop(name, None)
        if rule == "BACKENDS":
            _check_backend(f"structured_outputs.{name}", value)
        elif rule != "honoured" and value not in (None, False):
            raise UnsupportedParamError(f"structured_outputs.{name}", rule)
    _check_backend("guided_decoding_backend", request.guided_decoding_backend)
    if "disable_any_whitespace" in extra:
        return {"disable_any_whitespace": extra.pop("disable_any_whitespace")}
    return {}


def _check_backend(name: str, backend: object) -> None:
    if backend is not None and str(backend).lower() not in BACKENDS:
        shown = str(backend)[:64]
        raise UnsupportedParamError(
            name, f"this server's backend is xgrammar (or give auto), got {shown!r}"
        )


def _response_format(
    response_format: dict[str, Any] | None,
) -> tuple[str, dict[str, Any], dict[str, str]] | None:
    """(source, the engine's constraint fields, their OpenAI names) of `response_format`."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", {"json_object": True}, {}
    if kind == "json_schema":
        json_schema = (response_format or {}).get("json_schema")
        schema = json_schema.get("schema") if isinstance(json_schema, dict) else None
        name = "response_format.json_schema.schema"
        if schema is None:
            raise InvalidParamError(name, "a json_schema response format needs one")
        return "response_format", {"json": schema}, {"structured_outputs.json": name}
    raise InvalidParamError(
        "response_format.type", f"must be text, json_object or json_schema, got {kind!r}"
    )


def check_supported(request: protocol.CompletionRequest | protocol.ChatRequest) -> None:
    """A 400 naming the first field this server does not implement, unless it asks for
    nothing (its no-op value, None, [] or {})."""
    for name, no_op in request.unsupported.items():
        value = getattr(request, name)
        if value is None or value == no_op or value in ([], {}):
            continue
        raise UnsupportedParamError(name, f"is not supported by this server, got {_shown(value)}")
    options = request.stream_options
    if options is not None and options.continuous_usage_stats:
        raise UnsupportedParamError(
            "stream_options.continuous_usage_stats",
            "is not supported: ask for include_usage, the usage chunk at the end",
        )


def _shown(value: object) -> str:
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


class IgnoredFields:
    """Each (endpoint, field name) that a request carried and nothing here reads, logged
    once as a warning. At most `max_names` are remembered (a name cut to `max_name_len`
    characters): past that, one warning says so and new names go unlogged."""

    def __init__(self, max_names: int = 256, max_name_len: int = 64) -> None:
        self._seen: set[tuple[str, str]] = set()
        self._max_names, self._max_name_len = max_names, max_name_len
        self._is_full = False

    def report(self, body: protocol.Lenient) -> None:
        for raw in body.undeclared:
            key = (body.endpoint, raw[: self._max_name_len])
            if key in self._seen:
                continue
            if len(self._seen) >= self._max_names:
                if not self._is_full:
                    self._is_full = True
                    logger.warning("ignored_fields_unlogged", max_names=self._max_names)
                return
            self._seen.add(key)
            known = key[1] in body.ignored
            logger.warning(
                "ignored_request_field",
                field=key[1],
                endpoint=body.endpoint,
                reason="vLLM's, not used by this server" if known else "unknown field",
            )


# one per process: the routes of every server here log through it
IGNORED_FIELDS = IgnoredFields()
