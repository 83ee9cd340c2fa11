"""vLLM's input and output types, used as vLLM's docs use them: `TextPrompt` / `TokensPrompt`
dicts (single, in lists, mixed with strings), `prompt_token_ids=`, `Logprob` objects with
ranks and decoded tokens, `cumulative_logprob`, `GuidedDecodingParams`, and the async
engine's `get_model_config()` / `is_tracing_enabled()`."""

from __future__ import annotations

import asyncio
import math
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncengine import LLM, AsyncLLMEngine, EngineArgs, InvalidRequestError, SamplingParams
from asyncengine.inputs import TextPrompt, TokensPrompt
from asyncengine.outputs import Logprob

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model=str(model_dir("llama")), dtype="float32", device="cpu")


# -- prompts --------------------------------------------------------------------------------


def test_prompt_dicts_single_or_in_lists_mixed_with_strings(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode("Close the")
    (reference,) = llm.generate("Close the", GREEDY)
    outs = llm.generate(
        [
            {"prompt_token_ids": ids},
            {"prompt": "Close the"},
            "Close the",
            TokensPrompt(prompt_token_ids=ids),
            TextPrompt(prompt="Close the"),
            ids,
        ],
        GREEDY,
    )
    (single_ids,) = llm.generate({"prompt_token_ids": ids}, GREEDY)
    (single_text,) = llm.generate({"prompt": "Close the"}, GREEDY)
    for out in [*outs, single_ids, single_text]:
        assert out.error is None
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == reference.outputs[0].token_ids
    assert [out.prompt for out in outs] == [None, "Close the", "Close the", None, "Close the", None]
    # a TokensPrompt's own text is what its output shows
    (shown,) = llm.generate({"prompt_token_ids": ids, "prompt": "Close the"}, GREEDY)
    assert shown.prompt == "Close the" and shown.prompt_token_ids == ids


def test_the_prompt_token_ids_keyword(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    texts = ["Close the", "Hello, my name is"]
    ids = [tokenizer.encode(t) for t in texts]
    by_text = llm.generate(texts, GREEDY)
    by_ids = llm.generate(prompt_token_ids=ids, sampling_params=GREEDY)
    (one,) = llm.generate(prompt_token_ids=ids[0], sampling_params=GREEDY)
    both = llm.generate(texts, GREEDY, prompt_token_ids=ids)
    for outs in (by_ids, both):
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in by_text]
    assert one.outputs[0].token_ids == by_text[0].outputs[0].token_ids
    assert [o.prompt for o in both] == texts
    with pytest.raises(ValueError, match="2 prompts for 1 prompt_token_ids"):
        llm.generate(texts, GREEDY, prompt_token_ids=[ids[0]])


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ({"prompt": "x", "multi_modal_data": {}}, "unknown key 'multi_modal_data' in a TextPrompt"),
        ({"prompt_token_ids": [1], "foo_bar": 1}, "unknown key 'foo_bar' in a TokensPrompt"),
        ({"prompt_token_ids": "1 2"}, "'prompt_token_ids' must be a list, got str"),
        ({"prompt": 12}, "'prompt' must be a str, got int"),
        ({}, "needs 'prompt' or 'prompt_token_ids'"),
        (None, "must be a str, a list of token ids, a TextPrompt or a TokensPrompt dict"),
    ],
)
def test_a_malformed_prompt_dict_is_an_error_naming_the_key(llm: LLM, prompt, message) -> None:
    with pytest.raises(InvalidRequestError, match=message) as raised:
        llm.generate([prompt], GREEDY)
    assert raised.value.field == "prompt"


def test_the_async_engine_takes_prompt_dicts_and_answers_vllms_questions(model_dir) -> None:
    args = EngineArgs(model=str(model_dir("llama")), dtype="float32", device="cpu")
    engine = AsyncLLMEngine.from_engine_args(args)

    async def final(prompt, request_id: str):
        async for out in engine.generate(prompt, GREEDY, request_id):
            last = out
        return last

    async def main() -> None:
        try:
            ids = engine.get_tokenizer().encode("Close the")
            outs = [
                await final("Close the", "a"),
                await final({"prompt": "Close the"}, "b"),
                await final(TokensPrompt(prompt_token_ids=ids, prompt="Close the"), "c"),
            ]
            assert [o.prompt_token_ids for o in outs] == [ids] * 3
            assert [o.prompt for o in outs] == ["Close the"] * 3
            assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
            with pytest.raises(InvalidRequestError, match="unknown key 'mm_processor_kwargs'"):
                await final({"prompt": "x", "mm_processor_kwargs": {}}, "d")
            model_config = await engine.get_model_config()
            assert model_config.max_model_len == engine.max_model_len
            assert model_config.model == str(model_dir("llama"))
            assert engine.is_tracing_enabled() is False
            assert engine.num_requests == 0
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_guided_decoding_params_is_vllms_older_name_for_structured_outputs_params() -> None:
    from asyncengine.sampling_params import GuidedDecodingParams, StructuredOutputsParams

    assert GuidedDecodingParams is StructuredOutputsParams
    assert SamplingParams(structured_outputs=GuidedDecodingParams(choice=["yes", "no"]))


# -- logprobs -------------------------------------------------------------------------------


def hf_logprobs(model_dir, token_ids: list[int]) -> torch.Tensor:
    """Row i: transformers' log-probabilities of the token after position i."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir("llama")), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def vocab_rank(row: torch.Tensor, token_id: int) -> int:
    return int((row > row[token_id]).sum()) + 1


def test_logprobs_are_logprob_objects_ranked_as_transformers_ranks_them(
    llm: LLM, model_dir
) -> None:
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(
        max_tokens=8, temperature=1.0, seed=11, logprobs=2, prompt_logprobs=2, ignore_eos=True
    )
    (out,) = llm.generate("The quick brown fox jumps over", params)
    sample = out.outputs[0]
    rows = hf_logprobs(model_dir, out.prompt_token_ids + sample.token_ids)
    num_prompt = len(out.prompt_token_ids)
    assert sample.logprobs is not None and len(sample.logprobs) == len(sample.token_ids)
    num_outside_top = 0
    for i, (token_id, entry) in enumerate(zip(sample.token_ids, sample.logprobs)):
        row = rows[num_prompt - 1 + i]
        lp = entry[token_id]
        assert isinstance(lp, Logprob)
        assert math.isclose(lp.logprob, float(row[token_id]), abs_tol=1e-4)
        assert lp.rank == vocab_rank(row, token_id)
        assert lp.decoded_token == tokenizer.decode([token_id])
        top = sorted(
            (t for t in entry if t != token_id or lp.rank <= 2), key=lambda t: entry[t].rank
        )
        assert [entry[t].rank for t in top] == [1, 2]
        num_outside_top += lp.rank > 2
    assert num_outside_top > 0  # sampled at temperature 1: some tokens rank past the top 2
    assert sample.cumulative_logprob == pytest.approx(
        sum(entry[t].logprob for t, entry in zip(sample.token_ids, sample.logprobs))
    )
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry is not None
        token_id = out.prompt_token_ids[position]
        assert entry[token_id].rank == vocab_rank(rows[position - 1], token_id)
        assert entry[token_id].decoded_token == tokenizer.decode([token_id])
    (plain,) = llm.generate("The quick", GREEDY)
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None


# -- vLLM's documented usage, with only the import changed ---------------------------------

# docs/models/generative_models.md ("LLM.generate", greedy with SamplingParams), the prompt
# forms of the LLM.generate docs (PromptType: a str, a TextPrompt, a TokensPrompt), and
# reading logprobs as vllm.logprobs.Logprob documents them
VLLM_EXAMPLES = """
from vllm import LLM, SamplingParams
from vllm.inputs import TextPrompt, TokensPrompt

llm = LLM(model=MODEL)
params = SamplingParams(temperature=0)
outputs = llm.generate("Hello, my name is", params)

for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")

outputs = llm.generate({"prompt": "Hello, world"})
outputs = llm.generate({"prompt_token_ids": [1, 2, 3]})
outputs = llm.generate(
    [TextPrompt(prompt="Hello, world"), TokensPrompt(prompt_token_ids=[0, 417, 267])],
    SamplingParams(max_tokens=4, logprobs=5, prompt_logprobs=1),
)
for output in outputs:
    for token_id, logprobs in zip(output.outputs[0].token_ids, output.outputs[0].logprobs):
        lp = logprobs[token_id]
        print(token_id, lp.logprob, lp.rank, lp.decoded_token)
    print(output.outputs[0].cumulative_logprob)
    for position, scores in enumerate(output.prompt_logprobs or []):
        if scores is not None:
            print(position, {t: (s.logprob, s.rank, s.decoded_token) for t, s in scores.items()})
"""


def test_vllms_documented_examples_run_with_only_the_import_changed(model_dir, capsys) -> None:
    source = textwrap.dedent(VLLM_EXAMPLES)
    source = source.replace("from vllm.inputs", "from asyncengine.inputs")
    source = source.replace("from vllm import", "from asyncengine import")
    assert "vllm" not in source
    exec(source, {"MODEL": str(model_dir("llama")), "__name__": "vllm_example"})
    printed = capsys.readouterr().out
    assert "Prompt: 'Hello, my name is', Generated text: " in printed
