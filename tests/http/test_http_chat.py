"""/v1/chat/completions through the official `openai` clients: the chat template renders the
prompt (the tokenizer's, or --chat-template's), streamed and whole, n=2 seeded, logprobs, and
a clear 400 for a model with no template."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest
from serving_http import CORES, ServerThread, http_server
from transformers import AutoTokenizer

from asyncengine import LLM, SamplingParams, testing

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "양자역학 설명해줄래? 🐱"},
]


def test_chat_renders_the_template_and_equals_llm_chat(
    server: ServerThread, chat_model: Path
) -> None:
    reply = server.client().chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_completion_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    llm = LLM(model=str(chat_model), dtype="float32", device="cpu")
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    [expected] = llm.chat(MESSAGES, params, use_tqdm=False)
    [choice] = reply.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == "length"
    assert reply.object == "chat.completion"
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert reply.usage.completion_tokens == 20


def test_content_parts_render_as_their_text(server: ServerThread) -> None:
    client = server.client()
    parts = [{"type": "text", "text": "양자역학 "}, {"type": "text", "text": "설명해줄래? 🐱"}]
    as_parts = [MESSAGES[0], {"role": "user", "content": parts}]
    replies = [
        client.chat.completions.create(model=server.model, messages=m, max_tokens=8, temperature=0)
        for m in (MESSAGES, as_parts)
    ]
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    assert replies[0].usage.prompt_tokens == replies[1].usage.prompt_tokens


def test_streamed_chat_frames_as_openai_does(server: ServerThread) -> None:
    client = server.client()
    kwargs = {"model": server.model, "messages": MESSAGES, "max_tokens": 16, "n": 2, "seed": 11}
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    *content, last = chunks
    assert last.choices == [] and last.usage.model_dump() == whole.usage.model_dump()
    assert all(c.object == "chat.completion.chunk" and c.usage is None for c in content)
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in content:
        [choice] = chunk.choices
        index = choice.index
        if index not in texts:  # the role comes first, alone
            assert choice.delta.role == "assistant" and choice.delta.content == ""
            texts[index] = ""
            continue
        assert choice.delta.role is None
        assert index not in finishes, "a chunk after the one with the finish reason"
        texts[index] += choice.delta.content or ""
        if choice.finish_reason is not None:  # with the last content, not after it
            finishes[index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}


def test_n2_seeded_chat_reproduces(server: ServerThread) -> None:
    async def sample(seed: int) -> list[str]:
        async with server.async_client() as client:
            reply = await client.chat.completions.create(
                model=server.model, messages=MESSAGES, max_tokens=12, n=2, seed=seed
            )
            return [c.message.content or "" for c in reply.choices]

    first = asyncio.run(sample(5))
    assert len(first) == 2 and first[0] != first[1]
    assert asyncio.run(sample(5)) == first
    assert asyncio.run(sample(6)) != first


def test_chat_logprobs_give_each_token_and_its_top(server: ServerThread) -> None:
    reply = server.client().chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy
        assert entry.bytes == list(entry.token.encode())
    with pytest.raises(openai.BadRequestError) as raised:
        server.client().chat.completions.create(
            model=server.model, messages=MESSAGES, top_logprobs=3
        )
    assert raised.value.body["param"] == "top_logprobs"


def test_a_model_without_a_template_says_so(model_dir, tmp_path: Path) -> None:
    plain = model_dir("llama")
    # in-process only: the template renders in the front end, whichever core runs the engine
    inline = CORES["in-process"]
    with http_server(plain, *inline, fake_runner=True) as served:
        with pytest.raises(openai.BadRequestError) as raised:
            served.client().chat.completions.create(model=served.model, messages=MESSAGES)
        assert raised.value.status_code == 400
        assert raised.value.body["param"] == "messages"
        assert "no chat template" in raised.value.body["message"]
        assert "--chat-template" in raised.value.body["message"]
    template = tmp_path / "chat.jinja"
    template.write_text(testing.CHAT_TEMPLATE)
    with http_server(plain, "--chat-template", str(template), *inline, fake_runner=True) as served:
        reply = served.client().chat.completions.create(
            model=served.model, messages=MESSAGES, max_tokens=4
        )
        tokenizer = AutoTokenizer.from_pretrained(plain)
        rendered = tokenizer.apply_chat_template(
            MESSAGES, chat_template=testing.CHAT_TEMPLATE, add_generation_prompt=True,
            tokenize=False,
        )  # fmt: skip
        ids = tokenizer.encode(rendered, add_special_tokens=False)
        assert reply.usage.prompt_tokens == len(ids)
        served.assert_nothing_left()


def test_chat_errors_name_openai_fields(server: ServerThread) -> None:
    client = server.client()
    cases = [
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"messages": []}, "messages"),
    ]
    for overrides, param in cases:
        kwargs = {"model": server.model, "messages": MESSAGES, **overrides}
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(**kwargs)
        assert raised.value.body["param"] == param, (overrides, raised.value.body)
