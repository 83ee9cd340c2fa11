"""An output's text is its own tokens' text: `decode(output.token_ids)`, whatever the prompt
(text or ids, ending inside a character or not), streamed or not, n > 1, with stop strings,
for byte-level BPE and SentencePiece (byte-fallback) tokenizers."""

from __future__ import annotations

import asyncio
import copy
import random

import pytest
from tokenizers import decoders
from transformers import AutoTokenizer

from asyncengine import LLM, AsyncLLMEngine, EngineArgs, SamplingParams
from asyncengine.sampling_params import RequestOutputKind

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUM_PROMPTS = 200
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def random_prompts(tokenizer, num_prompts: int, seed: int = 0) -> list[str | list[int]]:
    """vLLM's benchmark prompts: random token ids, half sent as ids, half decoded to text
    (which the engine encodes again)."""
    rng = random.Random(seed)
    prompts: list[str | list[int]] = []
    for i in range(num_prompts):
        ids = [rng.randrange(3, len(tokenizer)) for _ in range(rng.randrange(4, 40))]
        prompts.append(ids if i % 2 else tokenizer.decode(ids))
    return prompts


def decode(tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model=str(model_dir("llama")), dtype="float32", device="cpu", max_num_seqs=64)


def test_the_text_of_200_random_token_prompts_is_their_outputs_decode(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    prompts = random_prompts(tokenizer, NUM_PROMPTS)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    # the case that leaked: a prompt ending inside a character the output's bytes complete
    num_unfinished = sum(decode(tokenizer, out.prompt_token_ids).endswith("\ufffd") for out in outs)
    assert num_unfinished > NUM_PROMPTS // 10
    wrong = [
        (out.outputs[0].text, decode(tokenizer, out.outputs[0].token_ids))
        for out in outs
        if out.outputs[0].text != decode(tokenizer, out.outputs[0].token_ids)
    ]
    assert not wrong, f"{len(wrong)} of {NUM_PROMPTS} differ, e.g. {wrong[:2]}"


def test_every_sample_of_n_is_its_own_tokens_text(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(max_tokens=16, n=3, temperature=1.0, seed=7, ignore_eos=True)
    outs = llm.generate(random_prompts(tokenizer, 24, seed=1), params, use_tqdm=False)
    samples = [c for out in outs for c in out.outputs]
    assert len(samples) == 72
    assert all(c.text == decode(tokenizer, c.token_ids) for c in samples)


def test_a_stop_string_cuts_the_outputs_own_text(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    prompts = random_prompts(tokenizer, 24, seed=2)
    free = llm.generate(prompts, GREEDY, use_tqdm=False)
    # a stop string from the middle of each output's own text
    stops = [decode(tokenizer, out.outputs[0].token_ids)[4:6] or "zz" for out in free]
    params = [
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[s]) for s in stops
    ]
    for out, stop in zip(llm.generate(prompts, params, use_tqdm=False), stops, strict=True):
        full = decode(tokenizer, out.outputs[0].token_ids)
        if stop in full:
            assert out.outputs[0].text == full[: full.index(stop)]
            assert out.outputs[0].finish_reason == "stop"
        else:
            assert out.outputs[0].text == full


async def stream(engine: AsyncLLMEngine, prompts, params: SamplingParams):
    """Each request's deltas per sample, and its token ids per sample."""

    async def one(i: int, prompt) -> tuple[dict[int, str], dict[int, list[int]]]:
        texts: dict[int, str] = {}
        ids: dict[int, list[int]] = {}
        async for out in engine.generate(prompt, params, request_id=f"r{i}"):
            for c in out.outputs:
                texts[c.index] = texts.get(c.index, "") + c.text
                ids[c.index] = ids.get(c.index, []) + c.token_ids
        return texts, ids

    try:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    finally:
        await engine.shutdown()


def test_streamed_deltas_join_to_the_outputs_decode(model_dir) -> None:
    path = str(model_dir("llama"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=path, dtype="float32", device="cpu"))
    params = SamplingParams(
        max_tokens=16,
        n=2,
        temperature=1.0,
        seed=3,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )
    results = asyncio.run(stream(engine, random_prompts(tokenizer, 16, seed=3), params))
    for texts, ids in results:
        assert sorted(texts) == [0, 1]
        for index, text in texts.items():
            assert text == decode(tokenizer, ids[index])


def test_sentencepiece_text_is_the_decode_with_the_leading_space_kept(model_dir) -> None:
    """A SentencePiece decoder strips the first token's space ("▁door" alone is "door"); the
    output keeps it, as vLLM's does, so that prompt + text reads " door" after "Close the"."""
    path = str(model_dir("llama", tokenizer_kind="sentencepiece"))
    llm = LLM(model=path, dtype="float32", device="cpu", max_num_seqs=64)
    tokenizer = llm.get_tokenizer()
    pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode("양", add_special_tokens=False))
    assert pieces[-3:] == ["<0xEC>", "<0x96>", "<0x91>"]  # byte fallback
    unstripped = copy.deepcopy(tokenizer.backend_tokenizer)
    unstripped.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    params = SamplingParams(max_tokens=16, n=2, temperature=1.0, seed=5, ignore_eos=True)
    outs = llm.generate(random_prompts(tokenizer, 100, seed=4), params, use_tqdm=False)
    num_spaced = 0
    for c in (c for out in outs for c in out.outputs):
        expected = unstripped.decode(c.token_ids, skip_special_tokens=True)
        assert c.text == expected
        num_spaced += expected.startswith(" ")
        assert decode(tokenizer, c.token_ids) == (
            expected[1:] if expected.startswith(" ") else expected
        )
    assert num_spaced > 0
