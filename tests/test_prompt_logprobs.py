"""Prompt logprobs (`SamplingParams.prompt_logprobs`, what OpenAI's echo scores) against
Hugging Face's log_softmax over the same prompt: whole, in chunks, beside a prefix-cache hit,
with parallel samples, and after a recompute preemption."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncengine import LLM, SamplingParams
from asyncengine.outputs import RequestOutput

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [
    "The quick brown fox jumps over the lazy dog, and the dog sleeps on.",
    "양자역학 설명해줄래? 🐱",
    "Hi",
]
TOP = 3


@pytest.fixture(scope="module")
def hf_logprobs(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir("llama"), dtype=torch.float32).eval()

    def score(token_ids: list[int]) -> torch.Tensor:
        """[len - 1, vocab]: row i is the distribution of token i + 1."""
        with torch.no_grad():
            logits = model(torch.tensor([token_ids])).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)[:-1]

    return score


def check(out: RequestOutput, hf: torch.Tensor) -> None:
    scored = out.prompt_logprobs
    ids = out.prompt_token_ids
    assert scored is not None and len(scored) == len(ids) and scored[0] is None
    for position, (token_id, entry) in enumerate(zip(ids[1:], scored[1:])):
        assert entry is not None
        row = hf[position]
        assert math.isclose(entry[token_id].logprob, float(row[token_id]), abs_tol=1e-4)
        top = torch.topk(row, TOP)
        for top_id, top_lp in zip(top.indices.tolist(), top.values.tolist()):
            assert math.isclose(entry[top_id].logprob, top_lp, abs_tol=1e-4)
        assert len(entry) in (TOP, TOP + 1)  # the prompt token, when not among the top


def params(**overrides) -> SamplingParams:
    return SamplingParams(
        **{"temperature": 0, "max_tokens": 1, "prompt_logprobs": TOP, **overrides}
    )


def test_prompt_logprobs_equal_hf_log_softmax_whole_and_in_chunks(model_dir, hf_logprobs):
    for max_num_batched_tokens in (2048, 7):  # 7: every long prompt is prefilled in chunks
        llm = LLM(
            model=str(model_dir("llama")),
            dtype="float32",
            device="cpu",
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=4,
        )
        # twice: the second time the prompts' blocks are in the prefix cache, and the
        # request must compute them anyway to score them
        for _ in range(2):
            outs = llm.generate(PROMPTS, params(), use_tqdm=False)
            for out in outs:
                check(out, hf_logprobs(out.prompt_token_ids))
        assert llm.get_stats().num_prefix_cache_hits == 0
        plain = llm.generate(PROMPTS[0], SamplingParams(max_tokens=1), use_tqdm=False)[0]
        assert plain.prompt_logprobs is None
        assert llm.get_stats().num_prefix_cache_hits > 0  # blocks were cached all the same


def test_prompt_logprobs_with_parallel_samples_and_recompute(model_dir, hf_logprobs):
    llm = LLM(
        model=str(model_dir("llama")),
        dtype="float32",
        device="cpu",
        num_gpu_blocks_override=12,
        preemption_mode="recompute",
        block_size=8,
    )
    many = llm.generate(
        PROMPTS[:2],
        params(n=2, temperature=1.0, seed=3, max_tokens=40, ignore_eos=True),
        use_tqdm=False,
    )
    assert llm.get_stats().num_preemptions_recompute > 0
    for out in many:
        assert len(out.outputs) == 2
        check(out, hf_logprobs(out.prompt_token_ids))


def test_a_one_token_prompt_scores_nothing(model_dir):
    llm = LLM(model=str(model_dir("llama")), dtype="float32", device="cpu")
    out = llm.generate([[5]], params(), use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]


def test_prompt_logprobs_are_bounded():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
