"""n > 1: samples share the prompt's blocks (fork + copy-on-write) and equal separate requests."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from asyncengine import LLM, AsyncLLMEngine, SamplingParams
from asyncengine.core.scheduler import SchedulerOutput
from asyncengine.sampling_params import RequestOutputKind

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "Once upon a time, in a land far away, there lived a curious fox " * 4
SEED = 1234


def make_llm(model_dir, **overrides) -> LLM:
    args = {"device": "cpu", "dtype": "float32", "max_num_seqs": 16, "block_size": 16}
    return LLM(model=str(model_dir("llama")), **{**args, **overrides})


def run_counting_blocks(llm: LLM, prompts, params) -> tuple[list, int]:
    """Generate, stepping by hand; return the outputs and the most device blocks in use."""
    engine = llm.llm_engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    finished, peak = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        stats = engine.get_stats()
        peak = max(peak, stats.num_gpu_blocks - stats.num_free_gpu_blocks)
    return [finished[f"r{i}"] for i in range(len(prompts))], peak


def test_n_samples_equal_separate_requests_with_derived_seeds_and_use_fewer_blocks(model_dir):
    n, max_tokens = 4, 40
    grouped = SamplingParams(n=n, temperature=1.0, seed=SEED, max_tokens=max_tokens)
    # prefix caching off, so the separate requests cannot share blocks through the cache
    llm = make_llm(model_dir, enable_prefix_caching=False)
    [out], peak_grouped = run_counting_blocks(llm, [PROMPT], [grouped])
    separate = [
        SamplingParams(temperature=1.0, seed=SEED + i, max_tokens=max_tokens) for i in range(n)
    ]
    outs, peak_separate = run_counting_blocks(llm, [PROMPT] * n, separate)

    assert [c.index for c in out.outputs] == list(range(n))
    assert [c.token_ids for c in out.outputs] == [o.outputs[0].token_ids for o in outs]
    assert [c.text for c in out.outputs] == [o.outputs[0].text for o in outs]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # the seeds really differ
    print(
        f"\npeak device blocks: n={n} in one request {peak_grouped}, "
        f"{n} separate requests {peak_separate}"
    )
    assert peak_grouped < peak_separate
    stats = llm.get_stats()
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
    llm.llm_engine.block_manager.check_invariants()


@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
def test_greedy_samples_all_match_hf_even_under_preemption(model_dir, hf_greedy, preemption_mode):
    path = model_dir("llama")
    llm = make_llm(
        model_dir,
        num_gpu_blocks_override=24,
        num_cpu_blocks_override=64,
        preemption_mode=preemption_mode,
    )
    prompts = [PROMPT, "양자역학 설명해줄래?", "hi"]
    params = SamplingParams(n=3, temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out in outs:
        expected = hf_greedy(path, out.prompt_token_ids, 32)
        assert [c.token_ids for c in out.outputs] == [expected] * 3
    stats = llm.get_stats()
    assert stats.num_preemptions_swap + stats.num_preemptions_recompute > 0
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
    assert stats.num_free_cpu_blocks == stats.num_cpu_blocks


def test_sampled_groups_swapped_out_under_pressure_generate_what_they_would_unpressed(model_dir):
    # the samples part ways, so each one's private blocks and the blocks they share must all
    # survive being swapped out and back in as a group, on the real KV cache
    prompts = [PROMPT, "양자역학 설명해줄래?"]
    params = SamplingParams(n=4, temperature=1.0, seed=SEED, max_tokens=48, ignore_eos=True)
    roomy = make_llm(model_dir).generate(prompts, params, use_tqdm=False)

    pressed = make_llm(
        model_dir,
        num_gpu_blocks_override=16,
        num_cpu_blocks_override=64,
        preemption_mode="swap",
        enable_prefix_caching=False,
    )
    scheduler, bm = pressed.llm_engine.scheduler, pressed.llm_engine.block_manager
    schedule = scheduler.schedule
    group_swaps = []  # (blocks copied, block-table entries moved) of each step swapping a group

    def schedule_and_record() -> SchedulerOutput:
        plan = schedule()
        if max(Counter(r.group_id for r in plan.preempted).values(), default=0) > 1:
            num_entries = sum(len(bm.cpu_block_tables[r.request_id]) for r in plan.preempted)
            group_swaps.append((len(plan.blocks_to_swap_out), num_entries))
        return plan

    scheduler.schedule = schedule_and_record  # type: ignore[method-assign]
    outs = pressed.generate(prompts, params, use_tqdm=False)

    assert group_swaps, "no group of samples was swapped out together"
    copied, entries = (sum(column) for column in zip(*group_swaps))
    print(
        f"\n{len(group_swaps)} group swap-outs copied {copied} blocks for {entries} table entries"
    )
    # the blocks the samples share were copied once each
    assert all(num_copied < num_entries for num_copied, num_entries in group_swaps)
    for out, expected in zip(outs, roomy):
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in expected.outputs]
    stats = pressed.get_stats()
    assert stats.num_preemptions_recompute == 0
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
    assert stats.num_free_cpu_blocks == stats.num_cpu_blocks


def test_aborting_a_parallel_request_frees_every_sample(model_dir):
    engine = AsyncLLMEngine(make_llm(model_dir).llm_engine)
    params = SamplingParams(n=4, temperature=1.0, seed=SEED, max_tokens=200, ignore_eos=True)

    async def main() -> None:
        stream = engine.generate(PROMPT, params, request_id="group")
        out = await stream.__anext__()
        while len(out.outputs) < 4:
            out = await stream.__anext__()
        assert engine.get_stats().num_running == 4
        await stream.aclose()  # the caller leaves: every sample is aborted
        stats = engine.get_stats()
        assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (0, 0, 0)
        assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
        await engine.shutdown()

    asyncio.run(main())


def test_a_one_token_prompt_forks_at_admission(model_dir):
    # all but the last prompt token is computed already (none): the samples fork on admission
    llm = make_llm(model_dir)
    grouped = SamplingParams(n=3, temperature=1.0, seed=SEED, max_tokens=12)
    separate = [SamplingParams(temperature=1.0, seed=SEED + i, max_tokens=12) for i in range(3)]
    [out] = llm.generate([[5]], grouped, use_tqdm=False)
    outs = llm.generate([[5]] * 3, separate, use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [o.outputs[0].token_ids for o in outs]
    llm.llm_engine.block_manager.check_invariants()


def test_delta_outputs_carry_each_samples_finish_once(model_dir):
    """A sample that stops before the others is not sent again with every later output (the
    HTTP stream repeated its finish_reason chunk), and the deltas add up to the final."""
    llm = make_llm(model_dir)
    engine = llm.llm_engine
    stops = list(range(3, llm.get_tokenizer().vocab_size, 8))  # each sample meets one soon
    params = dict(n=4, temperature=1.0, seed=SEED, max_tokens=40, stop_token_ids=stops)
    [final] = llm.generate([PROMPT], SamplingParams(**params), use_tqdm=False)
    engine.add_request("d", PROMPT, SamplingParams(**params, output_kind=RequestOutputKind.DELTA))
    finishes: Counter[int] = Counter()
    finished_at: dict[int, int] = {}
    tokens: dict[int, list[int]] = {i: [] for i in range(4)}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            for completion in out.outputs:
                assert completion.index not in finished_at, "a finished sample sent again"
                tokens[completion.index] += completion.token_ids
                if completion.finish is not None:
                    finishes[completion.index] += 1
                    finished_at[completion.index] = step
    assert finishes == {i: 1 for i in range(4)}
    assert len(set(finished_at.values())) > 1  # the samples did stop at different steps
    assert [tokens[i] for i in range(4)] == [c.token_ids for c in final.outputs]


def test_sample_seeds_past_the_largest_seed_wrap_around(model_dir):
    """Sample i is seeded seed + i, taken modulo 2**63 (the seeds a request may give): a seed
    near the top no longer fails the fork inside the step loop, which killed the engine."""
    llm = make_llm(model_dir)
    top = 2**63 - 1
    grouped = SamplingParams(n=3, temperature=1.0, seed=top, max_tokens=8)
    [out] = llm.generate([PROMPT], grouped, use_tqdm=False)
    separate = [SamplingParams(temperature=1.0, seed=s, max_tokens=8) for s in (top, 0, 1)]
    outs = llm.generate([PROMPT] * 3, separate, use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [o.outputs[0].token_ids for o in outs]
    llm.llm_engine.block_manager.check_invariants()
