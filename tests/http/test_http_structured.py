"""Structured outputs over the OpenAI API: `response_format` (json_schema, json_object) and
vLLM's `structured_outputs` extra body, through the official `openai` client. The model has
random weights, so the constraint does all the work: every output must satisfy it."""

from __future__ import annotations

import json
import re
import urllib.request

import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving_http import ServerThread

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCHEMA = {
    "type": "object",
    # bounded, so every sample ends: a string of at most 6 characters and a boolean
    "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}
# random weights fill JSON with whitespace without end: vLLM's option for compact JSON
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


def chat(server: ServerThread, n: int, **kwargs: object) -> list[tuple[str, str]]:
    """(finish_reason, text) of each of `n` seeded samples."""
    reply = server.client().chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "who are you?"}],
        max_completion_tokens=200,
        seed=3,
        n=n,
        **kwargs,  # type: ignore[arg-type]
    )
    return [(c.finish_reason, c.message.content or "") for c in reply.choices]


def test_a_json_schema_response_format_validates(server: ServerThread) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "who", "schema": SCHEMA}}
    for finish, text in chat(server, 2, response_format=response_format, extra_body=COMPACT):
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_a_json_object_response_format_is_an_object(server: ServerThread) -> None:
    samples = chat(server, 4, response_format={"type": "json_object"}, extra_body=COMPACT)
    ended = [text for finish, text in samples if finish == "stop"]
    assert ended  # random weights write long strings: not every sample ends within 200 tokens
    for text in ended:
        assert isinstance(json.loads(text), dict)


def test_vllm_structured_outputs_choice_and_regex(server: ServerThread) -> None:
    client = server.client()
    choices = ["yes", "no", "maybe"]
    picked = client.completions.create(
        model=server.model,
        prompt="Is it?",
        max_tokens=8,
        n=3,
        seed=1,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert {c.text for c in picked.choices} <= set(choices)
    matched = client.completions.create(
        model=server.model,
        prompt="A date:",
        max_tokens=16,
        seed=2,
        extra_body={"structured_outputs": {"regex": r"\d{4}-\d{2}-\d{2}"}},
    )
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", matched.choices[0].text)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"json": {"type": "no-such-type"}}}, "structured_outputs.json"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
         "response_format.json_schema.schema"),
        ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a"]}},
         "structured_outputs"),
    ],
)  # fmt: skip
def test_a_bad_constraint_is_a_400_naming_it(
    server: ServerThread, extra: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        server.client().chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": "hi"}],
            max_completion_tokens=4,
            extra_body=extra,
        )
    assert refused.value.body["param"] == param  # type: ignore[index]


def _metrics(server: ServerThread) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_compile_shows_on_metrics_with_its_time_and_the_cache(server: ServerThread) -> None:
    """Over either core (the engine in its own process reports its compiles and cache across
    the process boundary): one new regex is one compile of a time > 0, and the cache holds it."""
    regex_kind = (("kind", "regex"),)
    before = _metrics(server)
    regex = f"(probe{server.grpc_port}|x)"  # a spec no other test of the session compiled
    server.client().completions.create(
        model=server.model,
        prompt="hi",
        max_tokens=8,
        extra_body={"structured_outputs": {"regex": regex}},
    )
    after = _metrics(server)

    def grew(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        key = (f"asyncengine_{name}", labels)
        return after[key] - before.get(key, 0.0)

    assert grew("grammar_compile_seconds_count", regex_kind) == 1
    assert 0 < grew("grammar_compile_seconds_sum", regex_kind) < 60
    assert grew("structured_output_requests_total", regex_kind) == 1
    assert grew("grammar_compile_busy_seconds_total") > 0
    assert after[("asyncengine_grammar_cache_entries", ())] >= 1
    assert after[("asyncengine_grammar_cache_bytes", ())] > 0
    assert after[("asyncengine_grammar_compile_timeouts_total", ())] == 0
