"""/v1/completions and /v1/models through the official `openai` clients (sync and async):
every prompt form, n, stop, seeds, logprobs, echo scoring against transformers, SSE, and the
same greedy text as `LLM.generate`."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch
from serving_http import ServerThread
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncengine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["The capital of France is", "양자역학 설명해줄래?", "I love pizza 🍕 and", "Hi"]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def tokenizer(chat_model: Path):
    return AutoTokenizer.from_pretrained(chat_model)


def test_models_names_the_served_model(server: ServerThread, chat_model: Path) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == [chat_model.name] == [server.model]
    assert models.data[0].object == "model"

    async def listed() -> list[str]:
        async with server.async_client() as client:
            return [m.id async for m in client.models.list()]

    assert asyncio.run(listed()) == [chat_model.name]


def test_greedy_text_equals_llm_generate(server: ServerThread, chat_model: Path) -> None:
    client = server.client()
    one_by_one = [
        client.completions.create(model=server.model, prompt=p, max_tokens=24, **GREEDY)
        for p in PROMPTS
    ]
    batch = client.completions.create(model=server.model, prompt=PROMPTS, max_tokens=24, **GREEDY)
    llm = LLM(model=str(chat_model), dtype="float32", device="cpu")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [out.outputs[0].text for out in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert [r.choices[0].text for r in one_by_one] == expected
    assert [c.text for c in batch.choices] == expected
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in batch.choices)
    assert batch.usage.completion_tokens == 4 * 24
    assert batch.usage.total_tokens == batch.usage.prompt_tokens + 4 * 24


def test_every_prompt_form_gives_the_same_completion(server: ServerThread, tokenizer) -> None:
    client = server.client()
    ids = [tokenizer.encode(p) for p in PROMPTS[:2]]
    forms = [PROMPTS[0], ids[0], PROMPTS[:2], ids]
    texts = [
        [
            c.text
            for c in client.completions.create(
                model=server.model, prompt=f, max_tokens=8, **GREEDY
            ).choices
        ]
        for f in forms
    ]
    assert texts[0] == texts[1] == texts[2][:1] == texts[3][:1]
    assert texts[2] == texts[3] and len(texts[2]) == 2
    usage = client.completions.create(
        model=server.model, prompt=ids[0], max_tokens=8, **GREEDY
    ).usage
    assert usage.prompt_tokens == len(ids[0])


def test_n_samples_and_seeds_reproduce(server: ServerThread) -> None:
    client = server.client()

    def sample(seed: int, n: int = 3) -> list[str]:
        reply = client.completions.create(
            model=server.model, prompt=PROMPTS[0], max_tokens=12, temperature=1.0, n=n, seed=seed
        )
        assert [c.index for c in reply.choices] == list(range(n))
        return [c.text for c in reply.choices]

    first = sample(7)
    assert sample(7) == first
    assert len(set(first)) > 1  # three samples, not one thrice
    assert sample(8) != first
    # sample i is seeded seed + i, as a request of its own would be
    assert sample(8, n=1) == first[1:2]


def test_stop_strings_end_the_text_before_them(server: ServerThread) -> None:
    client = server.client()
    full = (
        client.completions.create(model=server.model, prompt=PROMPTS[2], max_tokens=32, **GREEDY)
        .choices[0]
        .text
    )
    stop = full[10:13]
    start = full.index(stop)
    choice = client.completions.create(
        model=server.model, prompt=PROMPTS[2], max_tokens=32, stop=[stop, "never-in-it"], **GREEDY
    ).choices[0]
    assert choice.text == full[:start]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    streamed = client.completions.create(
        model=server.model, prompt=PROMPTS[2], max_tokens=32, stop=stop, stream=True, **GREEDY
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == full[:start]  # held back, never sent
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_have_openai_shape(server: ServerThread) -> None:
    reply = server.client().completions.create(
        model=server.model, prompt=PROMPTS[0], max_tokens=10, logprobs=3, **GREEDY
    )
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 10
    assert len(logprobs.top_logprobs) == len(logprobs.text_offset) == 10
    for i, (_token, lp, top) in enumerate(
        zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs)
    ):
        assert len(top) in (3, 4) or len(set(top)) < 3  # tokens may share a text
        assert lp <= 0 and max(top.values()) == pytest.approx(lp)  # greedy: the top one
        if i:
            assert logprobs.text_offset[i] == logprobs.text_offset[i - 1] + len(
                logprobs.tokens[i - 1]
            )


@pytest.fixture(scope="module")
def hf_model(chat_model: Path):
    return AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32).eval()


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_scores_the_prompt_as_transformers_does(
    server: ServerThread, hf_model, tokenizer, max_tokens: int
) -> None:
    """lm-eval's loglikelihood request: token ids, echo, logprobs=k, max_tokens 0 or 1."""
    prompts = [tokenizer.encode(p) for p in PROMPTS[:3]]
    reply = server.client().completions.create(
        model=server.model,
        prompt=prompts,
        max_tokens=max_tokens,
        echo=True,
        logprobs=2,
        temperature=0,
    )
    for ids, choice in zip(prompts, reply.choices):
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(ids) + max_tokens
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        with torch.no_grad():
            hf = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
        for position, token_id in enumerate(ids[1:], start=1):
            expected = float(hf[position - 1, token_id])
            assert math.isclose(logprobs.token_logprobs[position], expected, abs_tol=1e-4)
            top = torch.topk(hf[position - 1], 2)
            best = max(logprobs.top_logprobs[position].values())
            assert math.isclose(best, float(top.values[0]), abs_tol=1e-4)
        prompt_text = tokenizer.decode(ids, skip_special_tokens=False)
        assert choice.text.startswith(prompt_text)
        assert choice.finish_reason == "length"
        if max_tokens == 0:
            assert choice.text == prompt_text
    expected_completion = 0 if max_tokens == 0 else len(prompts)
    assert reply.usage.completion_tokens == expected_completion


def test_echo_of_a_text_prompt_starts_with_it(server: ServerThread) -> None:
    choice = (
        server.client()
        .completions.create(
            model=server.model, prompt=PROMPTS[1], max_tokens=4, echo=True, **GREEDY
        )
        .choices[0]
    )
    assert choice.text.startswith(PROMPTS[1]) and len(choice.text) > len(PROMPTS[1])
    assert choice.logprobs is None


def test_streaming_with_usage_frames_as_openai_does(server: ServerThread) -> None:
    client = server.client()
    whole = client.completions.create(
        model=server.model, prompt=PROMPTS[:2], max_tokens=16, n=2, seed=3
    )
    chunks = list(
        client.completions.create(
            model=server.model,
            prompt=PROMPTS[:2],
            max_tokens=16,
            n=2,
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *content, last = chunks
    assert last.choices == [] and last.usage is not None
    assert last.usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None and c.object == "text_completion" for c in content)
    texts: dict[int, str] = {}
    finishes: dict[int, str | None] = {}
    for chunk in content:
        [choice] = chunk.choices
        assert choice.index not in finishes, "a chunk after the one with the finish reason"
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.finish_reason is not None:
            finishes[choice.index] = choice.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}


def test_the_async_client_streams_concurrently(server: ServerThread) -> None:
    async def main() -> tuple[list[str], list[str]]:
        async with server.async_client() as client:

            async def one(prompt: str) -> str:
                stream = await client.completions.create(
                    model=server.model, prompt=prompt, max_tokens=12, stream=True, **GREEDY
                )
                return "".join([chunk.choices[0].text async for chunk in stream])

            streamed = await asyncio.gather(*(one(p) for p in PROMPTS))
            whole = await client.completions.create(
                model=server.model, prompt=PROMPTS, max_tokens=12, **GREEDY
            )
            return list(streamed), [c.text for c in whole.choices]

    streamed, whole = asyncio.run(main())
    assert streamed == whole
