"""Prefix caching end to end: shared prefixes are computed once, and tokens stay exact."""

from __future__ import annotations

import pytest

from asyncengine import LLM, SamplingParams
from asyncengine.testing import HF_PROMPTS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SYSTEM = max(HF_PROMPTS, key=len)[:600]  # a long shared "system prompt" (~280 tokens)
QUESTIONS = ["Explain AI simply", "양자역학 설명해줄래?", "봄에 관한 시를 써줄래? 🌸", "hi"]


def make_llm(model_dir, **overrides) -> LLM:
    args = {"dtype": "float32", "device": "cpu", "max_num_seqs": 16, "block_size": 16}
    return LLM(model=str(model_dir), enable_prefix_caching=True, **{**args, **overrides})


def expected_tokens(llm: LLM, hf_greedy, model_dir, prompts: list[str]) -> list[list[int]]:
    encoded = [llm.llm_engine.tokenize(p) for p in prompts]
    return [hf_greedy(model_dir, ids, GREEDY.max_tokens) for ids in encoded]


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
    assert stats.num_free_cpu_blocks == stats.num_cpu_blocks
    llm.llm_engine.block_manager.check_invariants()


@pytest.mark.parametrize("preemption", [None, "swap", "recompute"])
def test_shared_prefixes_hit_the_cache_and_match_hf(model_dir, hf_greedy, preemption) -> None:
    path = model_dir("llama")
    overrides = {}
    if preemption:
        overrides = {
            "num_gpu_blocks_override": 64,
            "num_cpu_blocks_override": 256,
            "preemption_mode": preemption,
            # the whole wave prefilled in one step, so its decodes outgrow the 64 blocks
            "max_num_batched_tokens": 2048,
        }
    llm = make_llm(path, **overrides)
    prompts = [SYSTEM + q for q in QUESTIONS]
    expected = expected_tokens(llm, hf_greedy, path, prompts)

    # first wave: the same prefix arrives together (the first to run fills the cache)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    # second wave, after the first finished: its blocks were freed but are still cached
    hits_before = llm.get_stats().num_prefix_cache_hits
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    prefix_len = len(llm.llm_engine.tokenize(SYSTEM))
    assert all(o.metrics and o.metrics.num_cached_tokens >= prefix_len - 16 for o in outs)
    assert llm.get_stats().num_prefix_cache_hits - hits_before >= len(prompts) * (prefix_len - 16)
    if preemption:
        stats = llm.get_stats()
        assert stats.num_preemptions_swap + stats.num_preemptions_recompute > 0
    assert_all_blocks_free(llm)


def test_tenants_with_different_salts_share_nothing(model_dir) -> None:
    llm = make_llm(model_dir("llama"))
    engine = llm.llm_engine
    prompt = SYSTEM + QUESTIONS[0]
    for request_id, salt in (("a", "tenant-a"), ("b", "tenant-b"), ("c", "tenant-a")):
        engine.add_request(request_id, prompt, GREEDY, cache_salt=salt)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += [o for o in engine.step() if o.finished]
        cached = outputs[0].metrics.num_cached_tokens
        assert (cached > 0) == (request_id == "c"), (request_id, cached)
    assert_all_blocks_free(llm)
