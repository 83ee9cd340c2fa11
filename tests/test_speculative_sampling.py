"""Speculative sampling keeps the target's distribution (issue 29): for a fixed prompt, the
first tokens of 3,000 seeded samples with and without n-gram drafts are within a total
variation bound, under temperature, top-k, top-p, min-p and penalties.

tests/ has no sampler distribution test to take a bound from, so it is set here from the
sampling noise: two 3,000-sample histograms of the same distribution, with different seeds,
differ by 0.04 in total variation at temperature 0.7, top-p 0.5 (19 outcomes seen); the
settings keep the outcomes few (a flatter one, 555 outcomes, differs by 0.21 from itself).
"""

from __future__ import annotations

from collections import Counter

import pytest

from asyncengine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUM_SAMPLES = 3000
TV_BOUND = 0.1
SEED_PROMPT = [5, 6, 7, 8, 9, 10, 11, 12] * 3
SETTINGS = [
    {"temperature": 1.0, "top_k": 3, "max_tokens": 4},
    {"temperature": 0.7, "top_p": 0.5, "max_tokens": 4},
    {"temperature": 1.5, "top_k": 5, "top_p": 0.95, "min_p": 0.05, "max_tokens": 3},
    # (on output tokens only: a repetition penalty would keep the prompt's tokens, the ones
    # prompt lookup proposes, from ever being sampled)
    {
        "temperature": 1.0,
        "top_k": 3,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "max_tokens": 4,
    },
]


def make_llm(model_dir, speculative_config=None) -> LLM:
    return LLM(
        model=str(model_dir("llama")), device="cpu", dtype="float32", max_num_seqs=256,
        speculative_config=speculative_config,
    )  # fmt: skip


def histogram(llm: LLM, prompt: list[int], fields: dict) -> Counter[tuple[int, ...]]:
    params = [SamplingParams(seed=i, ignore_eos=True, **fields) for i in range(NUM_SAMPLES)]
    outs = llm.generate([prompt] * NUM_SAMPLES, params, use_tqdm=False)
    return Counter(tuple(out.outputs[0].token_ids) for out in outs)


def total_variation(a: Counter[tuple[int, ...]], b: Counter[tuple[int, ...]]) -> float:
    return 0.5 * sum(abs(a[k] - b[k]) for k in a.keys() | b.keys()) / NUM_SAMPLES


@pytest.fixture(scope="module")
def engines(model_dir) -> tuple[LLM, LLM, list[int]]:
    """(plain, speculating, a prompt): the prompt is the model's own greedy text, which it
    tends to go on repeating, so that prompt lookup's drafts are often accepted."""
    # every draft slot of the step is allowed: speculation must run at this batch size
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
             "prompt_lookup_min": 1, "disable_by_batch_size": 1024,
             "min_acceptance_rate": 0.0}  # fmt: skip
    plain = make_llm(model_dir)
    greedy = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    [out] = plain.generate([SEED_PROMPT], greedy, use_tqdm=False)
    return plain, make_llm(model_dir, ngram), SEED_PROMPT + out.outputs[0].token_ids


@pytest.mark.parametrize(
    "fields", SETTINGS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items())
)
def test_first_tokens_are_distributed_as_without_speculation(engines, fields) -> None:
    plain, spec, prompt = engines
    policy = spec.llm_engine.scheduler.spec
    assert policy is not None
    before = (policy.stats.num_draft_tokens, policy.stats.num_accepted_tokens)
    tv = total_variation(histogram(plain, prompt, fields), histogram(spec, prompt, fields))
    num_drafts = policy.stats.num_draft_tokens - before[0]
    num_accepted = policy.stats.num_accepted_tokens - before[1]
    print(f"\n{fields}: TV {tv:.4f}, {num_accepted}/{num_drafts} drafts accepted")
    assert num_accepted > NUM_SAMPLES // 20 and num_drafts > num_accepted  # both paths ran
    assert tv < TV_BOUND
