"""LLMEngine / LLM behaviour beyond greedy parity: sampling, stops, text, bad input."""

from __future__ import annotations

import gc
import itertools
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from asyncengine import LLM, EngineArgs, LLMEngine, SamplingParams
from asyncengine.engine import llm_engine
from asyncengine.errors import InvalidRequestError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["Explain AI simply", "양자역학 설명해줄래?", "봄에 관한 시를 써줄래? 🌸🌷", "hi"]


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model=str(model_dir("llama")), dtype="float32", device="cpu", seed=0)


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
    assert stats.num_free_cpu_blocks == stats.num_cpu_blocks
    assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (0, 0, 0)
    llm.llm_engine.block_manager.check_invariants()


def test_seeded_sampling_is_independent_of_batch_mates(llm: LLM) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24)
    alone = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=30), params, SamplingParams(max_tokens=5)]
    batched = llm.generate(PROMPTS[:3], others, use_tqdm=False)[1].outputs[0].token_ids
    assert batched == alone
    different_seed = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=4321, max_tokens=24)
    assert llm.generate(PROMPTS[1], different_seed, use_tqdm=False)[0].outputs[0].token_ids != alone
    assert_all_blocks_free(llm)


def test_seeded_sampling_survives_preemption(model_dir) -> None:
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40) for i in range(len(PROMPTS))]
    roomy = LLM(model=str(model_dir("llama")), device="cpu", dtype="float32")
    tight = LLM(
        model=str(model_dir("llama")),
        device="cpu",
        dtype="float32",
        num_gpu_blocks_override=8,
        num_cpu_blocks_override=64,
        preemption_mode="swap",
    )
    expected = [o.outputs[0].token_ids for o in roomy.generate(PROMPTS, params, use_tqdm=False)]
    with capture_logs() as logs:
        got = [o.outputs[0].token_ids for o in tight.generate(PROMPTS, params, use_tqdm=False)]
    assert got == expected
    stats = tight.get_stats()
    assert stats.num_preemptions_swap > 1
    assert_all_blocks_free(tight)
    # the operator hears of it, not at every preemption but every 10 s at most (the first at
    # once), each time with the count since the last
    warnings = [e for e in logs if e["event"] == "requests_preempted"]
    assert 1 <= len(warnings) < stats.num_preemptions_swap
    assert all(w["log_level"] == "warning" and "max_num_seqs" in w["advice"] for w in warnings)
    assert warnings[0]["num_preempted"] >= 1 and warnings[0]["request_ids"]


def test_preemption_warnings_count_every_preempted_request(model_dir, monkeypatch) -> None:
    monkeypatch.setattr(llm_engine, "PREEMPTION_WARNING_INTERVAL_S", 0.0)  # one per step
    tight = LLM(
        model=str(model_dir("llama")),
        device="cpu",
        dtype="float32",
        num_gpu_blocks_override=8,
        preemption_mode="recompute",
    )
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with capture_logs() as logs:
        tight.generate(PROMPTS, params, use_tqdm=False)
    warnings = [e for e in logs if e["event"] == "requests_preempted"]
    stats = tight.get_stats()
    assert sum(w["num_preempted"] for w in warnings) == stats.num_preemptions_recompute > 0


def test_max_tokens_and_finish_reason_length(llm: LLM) -> None:
    out = llm.generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False
    )[0]
    assert out.finished
    assert len(out.outputs[0].token_ids) == 7
    assert out.outputs[0].finish_reason == "length"


def test_stop_token_id_ends_the_request_and_is_reported(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    tokens = llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0].outputs[0].token_ids
    stop_id = tokens[5]
    first = tokens.index(stop_id)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id])
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)


def test_min_tokens_suppresses_eos(llm: LLM) -> None:
    eos = llm.llm_engine.eos_token_ids[0]
    params = SamplingParams(temperature=0, min_tokens=12, max_tokens=12, stop_token_ids=[eos])
    out = llm.generate(PROMPTS, params, use_tqdm=False)
    for o in out:
        assert len(o.outputs[0].token_ids) == 12
        assert eos not in o.outputs[0].token_ids


def test_stop_string_truncates_text(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    text = llm.generate(PROMPTS[2], greedy, use_tqdm=False)[0].outputs[0].text
    stop = next(text[i : i + 2] for i in range(4, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    cut = text.index(stop)
    for include, expected in ((False, text[:cut]), (True, text[: cut + len(stop)])):
        params = SamplingParams(
            temperature=0,
            max_tokens=24,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=include,
        )
        out = llm.generate(PROMPTS[2], params, use_tqdm=False)[0].outputs[0]
        assert out.text == expected
        assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_streamed_text_never_splits_a_character(llm: LLM) -> None:
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(
            f"stream-{i}", prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        )
    texts: dict[str, list[str]] = {}
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts.setdefault(out.request_id, []).append(out.outputs[0].text)
            if out.finished:
                finals[out.request_id] = out
    for request_id, seen in texts.items():
        final = finals[request_id]
        full = engine.tokenizer.decode(final.outputs[0].token_ids, skip_special_tokens=True)
        assert seen[-1] == full
        for before, after in itertools.pairwise(seen):
            assert after.startswith(before)  # cumulative text only grows
        for partial in seen[:-1]:
            if partial and "\ufffd" not in full:
                assert not partial.endswith("\ufffd")
    assert_all_blocks_free(llm)


def test_logprobs_hold_the_sampled_token_and_top_n(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True)
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    for token_id, entry in zip(out.token_ids, out.logprobs):
        assert token_id in entry
        assert entry[token_id].logprob == max(lp.logprob for lp in entry.values())  # greedy
        assert entry[token_id].rank == 1
        assert 3 <= len(entry) <= 4
        assert all(lp.logprob <= 0.0 for lp in entry.values())


def test_prompt_longer_than_max_model_len_fails_alone(model_dir) -> None:
    llm = LLM(model=str(model_dir("llama")), device="cpu", dtype="float32", max_model_len=64)
    too_long = list(range(3, 3 + 80))
    outs = llm.generate(
        [PROMPTS[0], too_long, PROMPTS[1]],
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    assert outs[1].finished and outs[1].outputs[0].finish_reason == "error"
    assert "max_model_len" in (outs[1].error or "")
    assert [len(outs[i].outputs[0].token_ids) for i in (0, 2)] == [8, 8]
    assert outs[0].error is None and outs[2].error is None
    with pytest.raises(ValueError, match="max_model_len"):
        llm.llm_engine.add_request("x", too_long, SamplingParams())
    assert_all_blocks_free(llm)


def test_output_stops_at_max_model_len(model_dir) -> None:
    llm = LLM(model=str(model_dir("llama")), device="cpu", dtype="float32", max_model_len=32)
    prompt = list(range(3, 3 + 20))
    out = llm.generate(prompt, SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
    assert len(prompt) + len(out.outputs[0].token_ids) == 32
    assert out.outputs[0].finish_reason == "length"


def test_request_that_can_never_fit_the_cache_is_rejected(model_dir) -> None:
    llm = LLM(
        model=str(model_dir("llama")),
        device="cpu",
        dtype="float32",
        num_gpu_blocks_override=4,
        block_size=8,
    )
    outs = llm.generate(
        [list(range(3, 3 + 40)), PROMPTS[0]],
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    assert outs[0].outputs[0].finish_reason == "error"
    assert "KV cache" in (outs[0].error or "")
    assert len(outs[1].outputs[0].token_ids) == 4
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "prompt, match", [([], "is empty"), ("", "is empty"), ([1, 10**9], "token ids must be in")]
)
def test_bad_prompts_are_rejected_by_name(llm: LLM, prompt, match) -> None:
    with pytest.raises(InvalidRequestError, match=match) as caught:
        llm.llm_engine.add_request("bad", prompt, SamplingParams())
    assert caught.value.field == "prompt"


def test_duplicate_request_id_is_rejected(llm: LLM) -> None:
    engine: LLMEngine = llm.llm_engine
    engine.add_request("dup", PROMPTS[0], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("dup", PROMPTS[1], SamplingParams(max_tokens=2))
    engine.abort_request("dup")
    engine.abort_request("dup")  # idempotent
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(llm)


def test_unsupported_architecture_lists_the_supported_ones(tmp_path: Path, model_dir) -> None:
    import json
    import shutil

    src = model_dir("llama")
    shutil.copytree(src, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLM(model=str(tmp_path / "m"), device="cpu")


def test_missing_model_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a local directory"):
        EngineArgs(model=str(tmp_path / "nowhere")).create_engine_config()


def test_abort_right_after_the_fork_ends_every_sample(llm: LLM) -> None:
    """Samples forked but not yet sampled end with their request (the engine once asserted)."""
    engine: LLMEngine = llm.llm_engine
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=1)
    engine.add_request("forked", PROMPTS[0], params)
    while len(engine.scheduler.requests) < 3:  # the step that forks samples 1 and 2
        engine.step()
    (final,) = engine.abort_request("forked")
    assert final.finished and [c.finish_reason for c in final.outputs] == ["abort"] * 3
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(llm)


def test_a_request_aborted_before_its_fork_still_ends_n_samples(llm: LLM) -> None:
    engine: LLMEngine = llm.llm_engine
    engine.add_request("early", PROMPTS[1], SamplingParams(n=3, max_tokens=8, logprobs=2))
    (final,) = engine.abort_request("early")  # before any step: nothing forked
    assert [(c.index, c.finish_reason, c.token_ids, c.logprobs) for c in final.outputs] == [
        (i, "abort", [], []) for i in range(3)
    ]


def test_start_up_freezes_the_heap_it_built_so_full_collections_skip_it(model_dir) -> None:
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(model_dir("llama")), device="cpu"))
    assert gc.get_freeze_count() > 0
    tracked = {id(obj) for obj in gc.get_objects()}  # what a full collection walks
    assert id(engine.tokenizer) not in tracked and id(engine.model_runner) not in tracked
    # what the steps allocate is still collected
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert id(outputs[-1]) in {id(obj) for obj in gc.get_objects()}
