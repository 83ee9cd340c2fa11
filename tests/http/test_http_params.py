"""No request field passes in silence (issue 25): vLLM's guided_* fields constrain the output,
add_special_tokens is honoured on completions and chat, echo's text_offset indexes the text
returned, fields this server does not implement are a 400 naming them, and the ones it does
not read are logged once each. Through the official `openai` client, on the shared server."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import openai
import pytest
from serving_http import ServerThread
from structlog.testing import capture_logs
from transformers import AutoTokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "I love pizza 🍕 and"


@pytest.fixture(scope="module")
def tokenizer(chat_model: Path) -> Any:
    return AutoTokenizer.from_pretrained(chat_model)


def complete(server: ServerThread, **kwargs: Any) -> Any:
    return server.client().completions.create(model=server.model, **kwargs)


def test_guided_choice_constrains_a_random_model(server: ServerThread) -> None:
    reply = complete(
        server,
        prompt="Is it?",
        max_tokens=8,
        n=4,
        seed=5,
        extra_body={"guided_choice": ["yes", "no"], "guided_decoding_backend": "xgrammar"},
    )
    assert [c.text in ("yes", "no") for c in reply.choices] == [True] * 4, reply.choices
    assert all(c.finish_reason == "stop" for c in reply.choices)


def test_guided_regex_and_json_constrain_chat(server: ServerThread) -> None:
    client = server.client()
    messages = [{"role": "user", "content": "a date?"}]
    dated = client.chat.completions.create(
        model=server.model,
        messages=messages,  # type: ignore[arg-type]
        max_completion_tokens=16,
        seed=2,
        extra_body={"guided_regex": r"\d{4}-\d{2}-\d{2}"},
    )
    assert len(dated.choices[0].message.content or "") == 10
    assert dated.choices[0].message.content[4] == "-"  # type: ignore[index]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    shaped = complete(
        server,
        prompt="JSON:",
        max_tokens=24,
        seed=1,
        extra_body={"guided_json": schema, "structured_outputs": {"disable_any_whitespace": True}},
    )
    assert json.loads(shaped.choices[0].text) in ({"ok": True}, {"ok": False})


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}},
         "guided_json"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "[1"}, "guided_json"),
        ({"guided_choice": ["a"], "guided_decoding_backend": "outlines"},
         "guided_decoding_backend"),
        ({"guided_json": {}, "guided_whitespace_pattern": "[ ]?"}, "guided_whitespace_pattern"),
        ({"structured_outputs": {"choice": ["a"], "whitespace_pattern": " "}},
         "structured_outputs.whitespace_pattern"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),  # vLLM refuses an empty list too
        ({"allowed_token_ids": [10**9]}, "allowed_token_ids"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
         "stream_options.continuous_usage_stats"),
        # past 64 bits: was a 500, the engine process's message could not carry it
        ({"priority": 10**30}, "priority"), ({"priority": -(10**30)}, "priority"),
        ({"top_k": 2**64}, "top_k"),
    ],
)  # fmt: skip
def test_a_field_that_is_not_honoured_or_out_of_range_is_a_400_naming_it(
    server: ServerThread, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        complete(server, prompt="hi", max_tokens=2, extra_body=extra)
    assert refused.value.body["param"] == param  # type: ignore[index]


def test_truncate_prompt_tokens_keeps_the_prompts_end(server: ServerThread) -> None:
    """vLLM's field, on completions and chat: the prompt is its last k tokens (was a 400)."""
    ids = list(range(10, 40))
    done = complete(server, prompt=ids, max_tokens=2, extra_body={"truncate_prompt_tokens": 7})
    assert done.usage.prompt_tokens == 7
    chat = server.client().chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "a long question " * 8}],
        max_tokens=2,
        extra_body={"truncate_prompt_tokens": 5},
    )
    assert chat.usage.prompt_tokens == 5
    with pytest.raises(openai.BadRequestError) as refused:
        complete(server, prompt=ids, max_tokens=2, extra_body={"truncate_prompt_tokens": 0})
    assert refused.value.body["param"] == "truncate_prompt_tokens"  # type: ignore[index]


def test_allowed_token_ids_are_the_only_tokens_sampled(
    server: ServerThread, tokenizer: Any
) -> None:
    """vLLM's field: the completion is made of the allowed tokens only (was a 400)."""
    allowed = [tokenizer.convert_tokens_to_ids(t) for t in ("x", "y")]
    done = complete(
        server,
        prompt="Say something:",
        max_tokens=12,
        temperature=1.0,
        seed=3,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True},
    )
    text = done.choices[0].text
    assert len(text) == 12 and set(text) <= {"x", "y"}, text


def test_a_false_json_schema_is_named_as_the_schema(server: ServerThread) -> None:
    """`false` is a JSON Schema (it admits nothing), not an unset one: was a 400 blaming
    response_format for setting no constraint."""
    schema_false = {"type": "json_schema", "json_schema": {"name": "x", "schema": False}}
    with pytest.raises(openai.BadRequestError) as refused:
        complete(server, prompt="hi", max_tokens=2, extra_body={"response_format": schema_false})
    assert refused.value.body["param"] == "response_format.json_schema.schema"  # type: ignore[index]


def test_a_grammar_that_does_not_compile_names_guided_grammar(server: ServerThread) -> None:
    """Named by the field it came from, though the engine refuses it when the request is added."""
    with pytest.raises(openai.BadRequestError) as refused:
        complete(server, prompt="hi", max_tokens=2, extra_body={"guided_grammar": "root ::= ("})
    assert refused.value.body["param"] == "guided_grammar"  # type: ignore[index]


def test_add_special_tokens_false_drops_the_bos(server: ServerThread, tokenizer: Any) -> None:
    with_bos, without = tokenizer.encode(PROMPT), tokenizer.encode(PROMPT, add_special_tokens=False)
    assert with_bos == [tokenizer.bos_token_id, *without]  # the test model adds a BOS
    greedy = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 1}
    default = complete(server, **greedy)
    plain = complete(server, **greedy, extra_body={"add_special_tokens": False})
    by_ids = complete(server, **{**greedy, "prompt": without})
    assert default.usage.prompt_tokens == len(with_bos)
    assert plain.usage.prompt_tokens == len(without)
    assert plain.choices[0].text.startswith(PROMPT) and "<s>" not in plain.choices[0].text
    assert (
        plain.choices[0].logprobs.tokens[: len(without)]
        == by_ids.choices[0].logprobs.tokens[: len(without)]
    )
    assert plain.choices[0].text == by_ids.choices[0].text  # the same tokens, the same text


def test_chat_add_special_tokens_puts_a_bos_before_the_template(server: ServerThread) -> None:
    client = server.client()
    messages = [{"role": "user", "content": "hi"}]
    usages = [
        client.chat.completions.create(
            model=server.model,
            messages=messages,  # type: ignore[arg-type]
            max_completion_tokens=1,
            extra_body=extra,
        ).usage.prompt_tokens
        for extra in ({}, {"add_special_tokens": False}, {"add_special_tokens": True})
    ]
    assert usages[0] == usages[1] == usages[2] - 1  # vLLM's chat default: false


def test_chat_template_kwargs_reach_the_template(server: ServerThread) -> None:
    """`testing.CHAT_TEMPLATE` opens with `{{ bos_token }}`: a variable of that name replaces
    it. One the server sets itself is a 400."""
    client = server.client()
    messages = [{"role": "user", "content": "hi"}]
    usages = [
        client.chat.completions.create(
            model=server.model,
            messages=messages,  # type: ignore[arg-type]
            max_completion_tokens=1,
            extra_body=extra,
        ).usage.prompt_tokens
        for extra in ({}, {"chat_template_kwargs": {"bos_token": ""}})
    ]
    assert usages[1] == usages[0] - 1
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=server.model,
            messages=messages,  # type: ignore[arg-type]
            max_completion_tokens=1,
            extra_body={"chat_template_kwargs": {"tokenize": True}},
        )
    assert refused.value.body["param"] == "chat_template_kwargs.tokenize"  # type: ignore[index]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_text_offset_indexes_the_returned_text(
    server: ServerThread, tokenizer: Any, stream: bool
) -> None:
    """A text prompt's BOS is not in the echoed text: it takes up none of it. (ASCII: a
    character split over tokens is counted once per piece, as vLLM counts it.)"""
    prompt = "The capital of France is"
    kwargs = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 0}
    if stream:
        chunks = list(complete(server, **kwargs, stream=True))
        text = "".join(c.choices[0].text for c in chunks)
        tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        offsets = [
            o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset
        ]
    else:
        choice = complete(server, **kwargs).choices[0]
        text, tokens, offsets = choice.text, choice.logprobs.tokens, choice.logprobs.text_offset
    num_prompt = len(tokenizer.encode(prompt))
    assert text.startswith(prompt) and tokens[0] == "<s>"
    assert offsets[:2] == [0, 0]  # the BOS, then the prompt's first token at the start
    for token, offset in zip(tokens[1:num_prompt], offsets[1:num_prompt]):
        assert text[offset : offset + len(token)] == token, (token, offset, text)
    assert offsets[num_prompt] == len(prompt)  # the first token generated


def test_ignored_fields_are_logged_once_each(server: ServerThread) -> None:
    unknown = f"foo_bar_{uuid.uuid4().hex[:8]}"  # the log is per process: a name not seen yet
    with capture_logs() as logs:
        for _ in range(2):
            complete(server, prompt="hi", max_tokens=1, user="u", extra_body={unknown: 1})
    named = [e for e in logs if e["event"] == "ignored_request_field"]
    mine = [e for e in named if e["field"] == unknown]
    assert len(mine) == 1 and mine[0]["log_level"] == "warning"
    assert mine[0]["endpoint"] == "/v1/completions" and mine[0]["reason"] == "unknown field"
    # `user` is vLLM's too: logged as such, once in the process (an earlier test may have)
    assert len([e for e in named if e["field"] == "user"]) <= 1


def test_the_log_of_ignored_names_is_bounded() -> None:
    from asyncengine.server.http.fields import IgnoredFields  # here: main lacks it (issue 25)
    from asyncengine.server.http.protocol import CompletionRequest

    log = IgnoredFields(max_names=3, max_name_len=8)
    with capture_logs() as logs:
        for index in range(10):
            body = CompletionRequest(prompt="x")
            body._undeclared = [f"f{index}" + "x" * 100, "user"]
            log.report(body)
    events = [(e["event"], e.get("field"), e.get("reason")) for e in logs]
    assert events == [
        ("ignored_request_field", "f0xxxxxx", "unknown field"),
        ("ignored_request_field", "user", "vLLM's, not used by this server"),
        ("ignored_request_field", "f1xxxxxx", "unknown field"),
        ("ignored_fields_unlogged", None, None),
    ]
