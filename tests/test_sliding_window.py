"""Sliding-window models: exact tokens past the window, and memory bounded by the window."""

from __future__ import annotations

import pytest

from asyncengine import LLM, SamplingParams
from asyncengine.core.block_manager import live

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW, BLOCK_SIZE, MAX_TOKENS = 32, 8, 48


@pytest.mark.parametrize("preemption_mode", [None, "swap", "recompute"])
def test_mistral_window_matches_hf_and_releases_blocks(model_dir, hf_greedy, preemption_mode):
    path = model_dir("mistral", sliding_window=WINDOW)
    overrides = {}
    if preemption_mode:
        overrides = {
            "num_gpu_blocks_override": 16,
            "num_cpu_blocks_override": 64,
            "preemption_mode": preemption_mode,
        }
    llm = LLM(
        model=str(path),
        device="cpu",
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_num_seqs=8,
        **overrides,
    )
    engine = llm.llm_engine
    assert engine.block_manager.sliding_window == WINDOW
    assert not engine.block_manager.enable_caching  # prefix caching is off for windows
    prompts = [list(range(10, 10 + n)) for n in (100, 70, 45, 5)]  # all but one past the window
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    finished, most_live_blocks = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        for req in engine.scheduler.running:
            # blocks are released when the next step is planned: look from the second token
            if req.num_output_tokens >= 2:
                table = engine.block_manager.get_block_table(req)
                most_live_blocks = max(most_live_blocks, len(live(table)))
    for i, prompt in enumerate(prompts):
        expected = hf_greedy(path, prompt, MAX_TOKENS)
        assert finished[str(i)].outputs[0].token_ids == expected, f"prompt {i}"
    # while decoding, a sequence holds the window's blocks plus the ones being written
    assert most_live_blocks <= WINDOW // BLOCK_SIZE + 2
    stats = llm.get_stats()
    if preemption_mode:
        assert getattr(stats, f"num_preemptions_{preemption_mode}") > 0
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
    engine.block_manager.check_invariants()
