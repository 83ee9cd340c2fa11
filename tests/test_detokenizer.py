"""Streamed text is UTF-8 safe, deltas join to the full decode, stop strings never leak."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from transformers import AutoTokenizer

from asyncengine import AsyncLLMEngine, EngineArgs, SamplingParams
from asyncengine.core.request import Request
from asyncengine.engine.detokenizer import (
    IncrementalDetokenizer,
    NewDetokenizer,
    StreamDetokenizer,
    make_decode,
    make_detokenizer,
    make_vocab,
)
from asyncengine.engine.llm_engine import LLMEngine
from asyncengine.worker.fake_runner import FakeModelRunner

TEXTS = [
    "양자역학은 아주 작은 세계의 물리학이에요 🌸🌷 끝.",
    "봄에 관한 시: 꽃이 피고 🐝 벌이 날아요",
    "emoji 👩‍👩‍👧 family and 한국어 mixed",
]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir("llama"))


def detokenizers(tokenizer) -> dict[str, NewDetokenizer]:
    decode = make_decode(tokenizer)
    backend = tokenizer.backend_tokenizer
    vocab = make_vocab(tokenizer, decode)
    return {
        "two decodes": lambda prompt, skip: IncrementalDetokenizer(
            decode, vocab, len(prompt), skip
        ),
        "DecodeStream": lambda prompt, skip: StreamDetokenizer(
            backend, decode, vocab, len(prompt), skip
        ),
    }


def test_the_engine_takes_the_decode_stream_when_tokenizers_has_one(tokenizer) -> None:
    assert isinstance(make_detokenizer(tokenizer)([1, 2], True), StreamDetokenizer)


@pytest.mark.parametrize("kind", ["two decodes", "DecodeStream"])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_join_to_the_full_decode_with_no_split_character(tokenizer, text, kind) -> None:
    prompt = tokenizer.encode("prompt")
    output = tokenizer.encode(text, add_special_tokens=False)
    assert len(output) > len(text.encode()) // 4  # multi-byte characters span several tokens
    detok = detokenizers(tokenizer)[kind](prompt, True)
    deltas = []
    for i in range(1, len(output) + 1):
        deltas.append(detok.decode_next(prompt + output[:i], is_final=i == len(output)))
        assert "\ufffd" not in "".join(deltas)
    assert "".join(deltas) == text == tokenizer.decode(output)


@pytest.mark.parametrize("kind", ["two decodes", "DecodeStream"])
def test_a_sequence_cut_inside_a_character_ends_as_a_full_decode_shows_it(tokenizer, kind) -> None:
    prompt = tokenizer.encode("prompt")
    output = tokenizer.encode(TEXTS[0], add_special_tokens=False)
    # the first prefix whose decode ends in a half-made character
    cut = next(i for i in range(1, len(output)) if tokenizer.decode(output[:i]).endswith("\ufffd"))
    detok = detokenizers(tokenizer)[kind](prompt, True)
    text = "".join(
        detok.decode_next(prompt + output[:i], is_final=i == cut) for i in range(1, cut + 1)
    )
    assert text == tokenizer.decode(output[:cut])


@pytest.mark.parametrize("kind", ["two decodes", "DecodeStream"])
def test_a_prompt_ending_inside_a_character_leaks_nothing_into_the_output(tokenizer, kind) -> None:
    flower = tokenizer.encode("x 🌸", add_special_tokens=False)
    assert tokenizer.decode(flower[:-1]).endswith("\ufffd")  # the emoji spans tokens
    prompt, output = flower[:-1], flower[-1:] + tokenizer.encode(" ok", add_special_tokens=False)
    detok = detokenizers(tokenizer)[kind](prompt, True)
    text = "".join(
        detok.decode_next(prompt + output[:i], is_final=i == len(output))
        for i in range(1, len(output) + 1)
    )
    assert text == tokenizer.decode(output) and text.endswith("\ufffd ok")


def scripted_engine(model_dir, tokenizer, text: str) -> AsyncLLMEngine:
    """An engine whose 'model' emits the tokens of `text`, then eos."""
    tokens = tokenizer.encode(text, add_special_tokens=False)
    eos = tokenizer.eos_token_id

    def script(req: Request) -> int:
        return tokens[req.num_output_tokens] if req.num_output_tokens < len(tokens) else eos

    config = EngineArgs(model=str(model_dir("llama")), device="cpu").create_engine_config()
    return AsyncLLMEngine(LLMEngine(config, FakeModelRunner(config, script)))


async def stream_texts(engine: AsyncLLMEngine, params: SamplingParams) -> list[str]:
    texts = [out.outputs[0].text async for out in engine.generate("hi", params, request_id="x")]
    await engine.shutdown()
    return texts


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_korean_and_emoji_are_utf8_safe(model_dir, tokenizer, text) -> None:
    engine = scripted_engine(model_dir, tokenizer, text)
    texts = asyncio.run(stream_texts(engine, SamplingParams(max_tokens=200)))
    assert texts[-1] == text
    for before, after in itertools.pairwise(texts):
        assert after.startswith(before)
    assert all("\ufffd" not in t for t in texts)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stop", ["🌷 끝", "물리학", "세계의 물"])
def test_stop_strings_split_across_tokens_never_leak(model_dir, tokenizer, stop, include) -> None:
    text = TEXTS[0]
    assert len(tokenizer.encode(stop, add_special_tokens=False)) > 1
    engine = scripted_engine(model_dir, tokenizer, text)
    params = SamplingParams(max_tokens=200, stop=[stop], include_stop_str_in_output=include)
    texts = asyncio.run(stream_texts(engine, params))
    cut = text.index(stop) + (len(stop) if include else 0)
    assert texts[-1] == text[:cut]
    for partial in texts[:-1]:
        assert texts[-1].startswith(partial)  # nothing shown is ever taken back
        assert stop not in partial
