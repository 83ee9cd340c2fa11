"""Scheduler: admission order, chunked prefill, preemption, rejection, aborts and stopping.

Every test steps through `run_step`, which checks the plan and every invariant after each step.
Unless a test says otherwise the cache is 16 blocks of 4 tokens, the step budget 32 tokens and
8 sequences, and max_model_len 64 (see `utils.DEFAULTS`).
"""

from __future__ import annotations

import pytest

from asyncengine.core.block_manager import AllocStatus
from asyncengine.core.request import FinishReason, Request, RequestStatus
from asyncengine.core.scheduler import Scheduler, SchedulerOutput

from .utils import (
    EOS,
    add_requests,
    assert_nothing_left,
    create_scheduler,
    fake_model,
    make_request,
    make_requests,
    run_step,
    run_until_done,
)


def ids(requests: list[Request]) -> list[str]:
    return [req.request_id for req in requests]


def samples(requests: list[Request]) -> list[tuple[str, int]]:
    """(group, sample index) of each request: forked samples have engine ids of their own."""
    return [(req.group_id, req.sample_index) for req in requests]


def scripted(script: dict[str, list[int]]):
    """A sampler that emits `script[request_id]` in order, then falls back to the fake model."""

    def sample(req: Request) -> int:
        tokens = script.get(req.request_id, [])
        if req.num_output_tokens < len(tokens):
            return tokens[req.num_output_tokens]
        return fake_model(req)

    return sample


def step_until_preempted(scheduler: Scheduler, max_steps: int = 100) -> SchedulerOutput:
    for _ in range(max_steps):
        out = run_step(scheduler)
        if out.preempted:
            return out
    raise AssertionError(f"no preemption in {max_steps} steps")


# -- admission ------------------------------------------------------------------------------------


def test_requests_are_admitted_first_come_first_served():
    scheduler = create_scheduler(max_num_seqs=2)
    requests = add_requests(scheduler, make_requests(3, prompt_len=4, max_tokens=2))

    out = run_step(scheduler)
    assert ids(out.scheduled) == ["req-0", "req-1"]
    assert out.num_scheduled_tokens == {"req-0": 4, "req-1": 4}
    assert ids(scheduler.waiting) == ["req-2"]

    run_step(scheduler)  # both finish with 2 tokens
    assert ids(run_step(scheduler).scheduled) == ["req-2"]
    run_until_done(scheduler)
    assert [r.num_output_tokens for r in requests] == [2, 2, 2]
    assert_nothing_left(scheduler)


def test_a_request_that_does_not_fit_yet_is_not_overtaken_by_a_smaller_one():
    scheduler = create_scheduler(num_gpu_blocks=4, max_model_len=16)
    add_requests(scheduler, [make_request("big", prompt_len=8, max_tokens=3)])
    run_step(scheduler)
    later = add_requests(
        scheduler, [make_request("next", prompt_len=12), make_request("small", prompt_len=4)]
    )

    out = run_step(scheduler)  # "big" now holds 3 blocks: "small" would fit, "next" would not
    assert ids(out.scheduled) == ["big"]
    assert scheduler.block_manager.get_num_free_gpu_blocks() == 1
    assert ids(scheduler.waiting) == ["next", "small"]
    run_until_done(scheduler)
    assert [r.status for r in later] == [RequestStatus.FINISHED_LENGTH] * 2
    assert_nothing_left(scheduler)


def test_lower_priority_value_runs_first_and_ties_go_to_the_earlier_arrival():
    scheduler = create_scheduler(max_num_seqs=1)
    add_requests(
        scheduler,
        [
            make_request("low", priority=5, max_tokens=1),
            make_request("high", priority=0, max_tokens=1),
            make_request("mid-early", priority=1, max_tokens=1),
            make_request("mid-late", priority=1, max_tokens=1),
        ],
    )
    order = [req.request_id for out in run_until_done(scheduler) for req in out.scheduled]
    assert order == ["high", "mid-early", "mid-late", "low"]
    assert_nothing_left(scheduler)


def test_a_full_running_queue_holds_back_admissions():
    scheduler = create_scheduler(max_num_seqs=2)
    add_requests(scheduler, make_requests(2, prompt_len=4, max_tokens=5))
    run_step(scheduler)
    add_requests(scheduler, [make_request("late", prompt_len=4)])
    for _ in range(4):
        out = run_step(scheduler)
        assert ids(out.scheduled) == ["req-0", "req-1"]
    assert ids(run_step(scheduler).scheduled) == ["late"]


# -- chunked prefill ----------------------------------------------------------------------------


def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks_and_sampled_at_the_end():
    scheduler = create_scheduler(max_num_batched_tokens=16)
    (req,) = add_requests(scheduler, [make_request("long", prompt_len=40, max_tokens=2)])

    chunks = []
    while req.num_output_tokens == 0:
        out = run_step(scheduler)
        chunks.append(out.num_scheduled_tokens["long"])
        assert req.num_computed_tokens == sum(chunks)
    assert chunks == [16, 16, 8]
    assert req.num_computed_tokens == 40 and req.num_tokens == 41

    assert run_step(scheduler).num_scheduled_tokens == {"long": 1}
    assert req.status is RequestStatus.FINISHED_LENGTH and req.num_output_tokens == 2
    assert_nothing_left(scheduler)


@pytest.mark.parametrize("long_priority", [0, -1], ids=["newer-long", "higher-priority-long"])
def test_running_decodes_get_a_token_every_step_while_a_long_prompt_is_chunked(long_priority):
    scheduler = create_scheduler(max_num_batched_tokens=16)
    decodes = add_requests(scheduler, make_requests(2, prompt_len=4, max_tokens=20))
    run_step(scheduler)
    (long,) = add_requests(
        scheduler, [make_request("long", prompt_len=48, max_tokens=1, priority=long_priority)]
    )

    chunks = []
    while long.num_output_tokens == 0:
        out = run_step(scheduler)
        assert [out.num_scheduled_tokens[r.request_id] for r in decodes] == [1, 1]
        chunks.append(out.num_scheduled_tokens["long"])
    assert chunks == [14, 14, 14, 6]
    run_until_done(scheduler)
    assert [r.num_output_tokens for r in decodes] == [20, 20]
    assert_nothing_left(scheduler)


# -- preemption ---------------------------------------------------------------------------------


def _two_growing_requests(**overrides) -> tuple[Scheduler, Request, Request]:
    """Two requests that fit the 8-block cache at first and outgrow it together."""
    scheduler = create_scheduler(num_gpu_blocks=8, max_model_len=32, **overrides)
    old, new = add_requests(scheduler, make_requests(2, prompt_len=12, max_tokens=12))
    return scheduler, old, new


def test_swap_preemption_swaps_out_the_newest_request_and_brings_it_back():
    scheduler, old, new = _two_growing_requests(preemption_mode="swap")
    run_step(scheduler)
    run_step(scheduler)  # the cache is now full
    (waiting,) = add_requests(scheduler, [make_request("waiting", prompt_len=4)])
    running_before = set(ids(scheduler.running))

    out = step_until_preempted(scheduler)
    assert out.preempted == [new] and new.status is RequestStatus.SWAPPED
    assert ids(scheduler.swapped) == [new.request_id]
    assert [cpu for _, cpu in out.blocks_to_swap_out] == (
        scheduler.block_manager.cpu_block_tables[new.request_id]
    )
    assert set(ids(out.scheduled)) <= running_before, "admitted a request in a preempting step"
    assert waiting.status is RequestStatus.WAITING  # although it would fit now:
    assert scheduler.block_manager.get_num_free_gpu_blocks() >= 1
    assert scheduler.num_preemptions == {"swap": 1} and new.num_preemptions == 1
    assert new.num_computed_tokens > 0
    swap_out = out.blocks_to_swap_out

    outputs = run_until_done(scheduler)
    swapped_in = next(o for o in outputs if new in o.scheduled)
    assert [cpu for cpu, _ in swapped_in.blocks_to_swap_in] == [cpu for _, cpu in swap_out]
    assert old.num_output_tokens == new.num_output_tokens == 12
    assert new.status is RequestStatus.FINISHED_LENGTH
    assert waiting.status is RequestStatus.FINISHED_LENGTH
    assert_nothing_left(scheduler)


def test_the_victim_is_the_newest_running_request_not_the_next_in_line():
    scheduler = create_scheduler(num_gpu_blocks=12, max_model_len=48, preemption_mode="swap")
    requests = add_requests(scheduler, make_requests(3, prompt_len=12, max_tokens=12))
    assert step_until_preempted(scheduler).preempted == [requests[-1]]
    run_until_done(scheduler)
    assert [r.num_output_tokens for r in requests] == [12, 12, 12]
    assert_nothing_left(scheduler)


def test_the_victim_is_the_lowest_priority_request_even_when_it_is_older():
    scheduler = create_scheduler(num_gpu_blocks=8, max_model_len=32, preemption_mode="swap")
    low, high = add_requests(
        scheduler,
        [
            make_request("low", prompt_len=12, max_tokens=12, priority=1),
            make_request("high", prompt_len=12, max_tokens=12, priority=0),
        ],
    )
    assert step_until_preempted(scheduler).preempted == [low]
    run_until_done(scheduler)
    assert low.num_output_tokens == high.num_output_tokens == 12
    assert_nothing_left(scheduler)


def test_recompute_preemption_drops_the_victims_blocks_and_reprefills_it():
    scheduler, old, new = _two_growing_requests(preemption_mode="recompute")
    out = step_until_preempted(scheduler)
    assert out.preempted == [new] and not out.blocks_to_swap_out
    assert new.status is RequestStatus.WAITING and new.num_computed_tokens == 0
    assert not scheduler.block_manager.has_blocks(new)
    assert scheduler.num_preemptions == {"recompute": 1}
    num_tokens = new.num_tokens

    outputs = run_until_done(scheduler)
    readmitted = next(o for o in outputs if new in o.scheduled)
    assert readmitted.num_scheduled_tokens[new.request_id] == num_tokens  # prompt + outputs
    assert old.num_output_tokens == new.num_output_tokens == 12
    assert_nothing_left(scheduler)


def test_swap_without_a_cpu_pool_falls_back_to_recompute():
    scheduler, old, new = _two_growing_requests(preemption_mode="swap", num_cpu_blocks=0)
    out = step_until_preempted(scheduler)
    assert out.preempted == [new] and new.status is RequestStatus.WAITING
    assert not out.blocks_to_swap_out and scheduler.num_preemptions == {"recompute": 1}
    run_until_done(scheduler)
    assert old.num_output_tokens == new.num_output_tokens == 12
    assert_nothing_left(scheduler)


def test_auto_mode_swaps_a_victim_with_a_computed_block():
    scheduler, _, new = _two_growing_requests(preemption_mode="auto")
    step_until_preempted(scheduler)
    assert new.status is RequestStatus.SWAPPED and scheduler.num_preemptions == {"swap": 1}
    run_until_done(scheduler)
    assert_nothing_left(scheduler)


def test_auto_mode_recomputes_a_victim_with_less_than_a_block_computed():
    scheduler = create_scheduler(num_gpu_blocks=4, max_model_len=16, preemption_mode="auto")
    big, tiny = add_requests(
        scheduler,
        [
            make_request("big", prompt_len=12, max_tokens=4),
            make_request("tiny", prompt_len=2, max_tokens=4),
        ],
    )
    run_step(scheduler)  # all 4 blocks are taken; "big" needs a fifth for its next token
    out = run_step(scheduler)
    assert out.preempted == [tiny] and tiny.status is RequestStatus.WAITING
    assert scheduler.num_preemptions == {"recompute": 1}
    run_until_done(scheduler)
    assert big.num_output_tokens == tiny.num_output_tokens == 4
    assert_nothing_left(scheduler)


def _older_request_and_a_group(**overrides) -> tuple[Scheduler, Request, list[tuple[str, int]]]:
    """An older request and a newer one with 3 samples, outgrowing a 10-block cache together."""
    scheduler = create_scheduler(num_gpu_blocks=10, max_model_len=32, **overrides)
    old, _ = add_requests(
        scheduler,
        [
            make_request("old", prompt_len=12, max_tokens=12),
            make_request("group", prompt_len=10, max_tokens=12, n=3),
        ],
    )
    return scheduler, old, [("group", 0), ("group", 1), ("group", 2)]


def test_the_samples_of_a_request_are_swapped_out_and_back_in_together():
    scheduler, old, group_samples = _older_request_and_a_group(preemption_mode="auto")
    bm = scheduler.block_manager
    out = step_until_preempted(scheduler)
    assert samples(out.preempted) == group_samples
    group = out.preempted
    group_ids = ids(group)
    assert all(req.status is RequestStatus.SWAPPED for req in group)
    # the prompt's full blocks are shared: moved once, and shared on the CPU too
    cpu_tables = [bm.cpu_block_tables[i] for i in group_ids]
    assert cpu_tables[0][:2] == cpu_tables[1][:2] == cpu_tables[2][:2]
    assert len(out.blocks_to_swap_out) == len({b for t in cpu_tables for b in t})
    assert len(out.blocks_to_swap_out) < sum(len(t) for t in cpu_tables)
    assert scheduler.num_preemptions == {"swap": 3}

    outputs = run_until_done(scheduler)
    swapped_in = next(o for o in outputs if o.blocks_to_swap_in)
    assert set(group_ids) <= set(ids(swapped_in.scheduled))
    assert len(swapped_in.blocks_to_swap_in) == len(out.blocks_to_swap_out)
    assert [req.num_output_tokens for req in [old, *group]] == [12] * 4
    assert len({tuple(req.output_token_ids) for req in group}) == 3  # they did part ways
    assert_nothing_left(scheduler)


def test_the_samples_of_a_request_are_recomputed_together_when_the_cpu_pool_is_too_small():
    scheduler, old, group_samples = _older_request_and_a_group(
        preemption_mode="swap", num_cpu_blocks=2
    )
    out = step_until_preempted(scheduler)
    assert samples(out.preempted) == group_samples and not out.blocks_to_swap_out
    assert all(req.status is RequestStatus.WAITING for req in out.preempted)
    run_until_done(scheduler)
    assert [req.num_output_tokens for req in [old, *out.preempted]] == [12] * 4
    assert_nothing_left(scheduler)


def test_a_request_with_more_samples_than_max_num_seqs_is_rejected_without_blocking_others():
    scheduler = create_scheduler(max_num_seqs=2)
    wide, narrow = add_requests(
        scheduler, [make_request("wide", n=3), make_request("narrow", max_tokens=2)]
    )
    out = run_step(scheduler)
    assert out.rejected == [wide] and wide.status is RequestStatus.FINISHED_IGNORED
    assert "max_num_seqs" in (wide.error or "")
    run_until_done(scheduler)
    assert narrow.num_output_tokens == 2
    assert_nothing_left(scheduler)


def test_samples_a_parent_will_fork_count_against_max_num_seqs_for_later_admissions():
    """Three requests of 3 samples each under max_num_seqs 6: the first two take the six
    sequences, and the third waits for room although each parent runs alone while it
    prefills. Before, the forks of parents admitted earlier in the step were not counted:
    all three were admitted and 9 sequences ran."""
    scheduler = create_scheduler(max_num_seqs=6)
    requests = add_requests(
        scheduler, [make_request(f"r{i}", prompt_len=6, max_tokens=4, n=3) for i in range(3)]
    )
    outputs = run_until_done(scheduler)  # each step checks the sequences promised fit
    first_step_of = {
        req_id: next(i for i, out in enumerate(outputs) if req_id in ids(out.scheduled))
        for req_id in ("r0", "r1", "r2")
    }
    assert first_step_of["r0"] == first_step_of["r1"] == 0 < first_step_of["r2"]
    assert all(req.num_output_tokens == 4 for req in requests)
    assert_nothing_left(scheduler)


class _OneSlot:
    """LoRA admission with one adapter slot, every adapter in host memory."""

    max_loras = 1

    def is_ready(self, lora_int_id: int) -> bool:
        return True

    def take_unreadable(self) -> set[int]:
        return set()


def test_a_request_waiting_for_the_adapter_slot_is_not_starved_by_newer_ones():
    """One slot, held by adapter 2; a request for adapter 1 waits for it while requests for
    adapter 2 keep arriving. Newer adapter requests now wait behind it, so adapter 2 drains
    and adapter 1 gets the slot; before, each newcomer kept adapter 2 in it, for good."""
    scheduler = create_scheduler()
    scheduler.loras = _OneSlot()

    def lora_request(request_id: str, lora_int_id: int) -> Request:
        req = make_request(request_id, prompt_len=4, max_tokens=3)
        req.lora_int_id = lora_int_id
        return req

    add_requests(scheduler, [lora_request("first", 2), lora_request("waiting", 1)])
    started_at = None
    for step in range(30):
        add_requests(scheduler, [lora_request(f"newer-{step}", 2)])
        out = run_step(scheduler)
        assert len({req.lora_int_id for req in out.scheduled}) <= 1
        if "waiting" in ids(out.scheduled):
            started_at = step
            break
    assert started_at is not None and started_at <= 5, started_at
    run_until_done(scheduler)
    assert_nothing_left(scheduler)


def test_a_request_that_fills_the_whole_cache_finishes_by_length():
    # max_model_len above the cache (16 blocks of 4 = 64 tokens): the request can never grow
    # past the cache, so it ends by length there instead of preempting itself forever.
    scheduler = create_scheduler(max_model_len=128, preemption_mode="swap")
    (req,) = add_requests(scheduler, [make_request("a", prompt_len=60, max_tokens=None)])
    run_until_done(scheduler)
    assert req.status is RequestStatus.FINISHED_LENGTH
    assert req.num_tokens == 64 and req.num_preemptions == 0
    assert_nothing_left(scheduler)


@pytest.mark.parametrize("answer", [AllocStatus.LATER, AllocStatus.NEVER])
def test_stall_guard_recomputes_a_swapped_request_when_nothing_runs(monkeypatch, answer):
    # if the head of the swapped queue cannot come back while nothing runs (so nothing will
    # ever free blocks), it is dropped to recompute so the engine keeps making progress
    scheduler = create_scheduler(preemption_mode="swap")
    _, new = add_requests(
        scheduler,
        [
            make_request("old", prompt_len=20, max_tokens=30, priority=1),
            make_request("new", prompt_len=20, max_tokens=30, priority=2),
        ],
    )
    out = step_until_preempted(scheduler)
    assert out.preempted == [new] and new.status is RequestStatus.SWAPPED
    scheduler.abort_request("old")
    monkeypatch.setattr(scheduler.block_manager, "can_swap_in", lambda seq: answer)
    out = run_step(scheduler)
    assert new.num_computed_tokens > 0 and new in out.scheduled  # readmitted to recompute
    assert new.status is RequestStatus.RUNNING and not out.blocks_to_swap_in
    monkeypatch.undo()
    run_until_done(scheduler)
    assert new.num_output_tokens == 30
    assert_nothing_left(scheduler)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_preempted_request_that_grew_into_the_watermark_is_not_dropped(mode):
    # "a" fits the cache (its 52 tokens need 13 of 16 blocks) and has been generating; once
    # preempted it must come back and finish, not be rejected as if it could never fit (the
    # watermark only holds blocks back from new requests).
    scheduler = create_scheduler(watermark=0.25, preemption_mode=mode)  # 4 blocks held back
    (a,) = add_requests(scheduler, [make_request("a", prompt_len=40, max_tokens=12, priority=1)])
    for _ in range(3):
        run_step(scheduler)
    (b,) = add_requests(scheduler, [make_request("b", prompt_len=4, max_tokens=40, priority=0)])
    run_until_done(scheduler)

    assert a.num_preemptions == 1
    assert a.status is RequestStatus.FINISHED_LENGTH, a.error
    assert a.num_output_tokens == 12 and b.num_output_tokens == 40
    assert_nothing_left(scheduler)


# -- requests that can never run ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt_len", "overrides"),
    [(65, {}), (17, {"num_gpu_blocks": 4})],
    ids=["longer-than-max-model-len", "larger-than-the-cache"],
)
def test_a_request_that_can_never_fit_is_rejected_without_blocking_the_queue(prompt_len, overrides):
    scheduler = create_scheduler(**overrides)
    never, ok = add_requests(
        scheduler, [make_request("never", prompt_len=prompt_len), make_request("ok")]
    )
    out = run_step(scheduler)
    assert out.rejected == [never] and out.scheduled == [ok]
    assert never.status is RequestStatus.FINISHED_IGNORED
    assert never.finish_reason is FinishReason.REJECTED
    assert f"needs {prompt_len} tokens" in never.error
    assert never.num_output_tokens == 0
    run_until_done(scheduler)
    assert_nothing_left(scheduler)


def test_a_prompt_of_exactly_max_model_len_is_admitted_and_gets_one_token():
    scheduler = create_scheduler(max_model_len=16)
    (req,) = add_requests(scheduler, [make_request("a", prompt_len=16)])
    run_until_done(scheduler)
    assert req.status is RequestStatus.FINISHED_LENGTH and req.num_output_tokens == 1


# -- aborts -------------------------------------------------------------------------------------


def _scheduler_with_one_request_in_each_state() -> tuple[Scheduler, dict[str, Request]]:
    """A running, a swapped and a waiting request (the cache is full, so "waiting" waits)."""
    scheduler, old, new = _two_growing_requests(preemption_mode="swap")
    step_until_preempted(scheduler)
    (waiting,) = add_requests(scheduler, [make_request("waiting")])
    run_step(scheduler)
    states = {"running": old, "swapped": new, "waiting": waiting}
    assert [r.status.name for r in states.values()] == ["RUNNING", "SWAPPED", "WAITING"]
    return scheduler, states


@pytest.mark.parametrize("state", ["running", "swapped", "waiting"])
def test_abort_in_any_state_frees_every_block_and_is_idempotent(state):
    scheduler, states = _scheduler_with_one_request_in_each_state()
    req = states[state]
    assert scheduler.abort_request(req.request_id) is req
    assert req.status is RequestStatus.FINISHED_ABORTED
    assert req.finish_reason is FinishReason.ABORTED
    assert not scheduler.block_manager.has_blocks(req)
    assert scheduler.abort_request(req.request_id) is None
    run_step(scheduler)
    for other in states.values():
        scheduler.abort_request(other.request_id)
    assert_nothing_left(scheduler)


def test_abort_of_an_unknown_or_finished_request_returns_none():
    scheduler = create_scheduler()
    (req,) = add_requests(scheduler, [make_request("a", max_tokens=1)])
    assert scheduler.abort_request("nobody") is None
    run_until_done(scheduler)
    assert scheduler.abort_request("a") is None
    assert req.status is RequestStatus.FINISHED_LENGTH


def test_a_request_aborted_while_its_step_runs_gets_no_token():
    scheduler = create_scheduler()
    a, b = add_requests(scheduler, make_requests(2, max_tokens=3))
    out = run_step(scheduler, abort_during_step=["req-0"])
    assert ids(out.scheduled) == ["req-0", "req-1"]
    assert a.status is RequestStatus.FINISHED_ABORTED and a.num_output_tokens == 0
    assert b.num_output_tokens == 1
    run_until_done(scheduler)
    assert_nothing_left(scheduler)


# -- stopping -----------------------------------------------------------------------------------


def _generate(req: Request, sample=fake_model, **overrides) -> Request:
    scheduler = create_scheduler(**overrides)
    scheduler.add_request(req)
    run_until_done(scheduler, sample=sample)
    assert_nothing_left(scheduler)
    return req


def test_eos_stops_the_request_and_is_kept_as_its_last_token():
    req = _generate(make_request("a"), scripted({"a": [20, 21, EOS, 22]}))
    assert req.status is RequestStatus.FINISHED_STOPPED and req.finish_reason is FinishReason.EOS
    assert req.output_token_ids == [20, 21, EOS] and req.stop_reason is None


def test_ignore_eos_runs_to_max_tokens():
    req = _generate(make_request("a", max_tokens=5, ignore_eos=True), scripted({"a": [EOS] * 5}))
    assert req.status is RequestStatus.FINISHED_LENGTH and req.output_token_ids == [EOS] * 5


def test_a_stop_token_id_stops_the_request_and_is_its_stop_reason():
    req = _generate(make_request("a", stop_token_ids=[42, 43]), scripted({"a": [20, 43, 42]}))
    assert req.status is RequestStatus.FINISHED_STOPPED
    assert req.output_token_ids == [20, 43] and req.stop_reason == 43


def test_max_tokens_stops_with_length():
    req = _generate(make_request("a", max_tokens=7))
    assert req.status is RequestStatus.FINISHED_LENGTH and req.finish_reason is FinishReason.LENGTH
    assert req.num_output_tokens == 7


def test_max_model_len_stops_with_length_when_max_tokens_is_unset():
    req = _generate(make_request("a", prompt_len=50, max_tokens=None), max_model_len=64)
    assert req.status is RequestStatus.FINISHED_LENGTH and req.num_tokens == 64


@pytest.mark.parametrize("stop", ["eos", "stop_token_ids"])
def test_min_tokens_suppresses_stopping_until_enough_tokens(stop):
    stop_token = EOS if stop == "eos" else 42
    req = make_request("a", max_tokens=10, min_tokens=3, stop_token_ids=[42])
    req = _generate(req, scripted({"a": [stop_token, stop_token, stop_token, stop_token]}))
    assert req.status is RequestStatus.FINISHED_STOPPED
    assert req.output_token_ids == [stop_token] * 3


def test_update_returns_the_requests_that_got_a_token_in_batch_order():
    scheduler = create_scheduler(max_num_batched_tokens=16)
    add_requests(
        scheduler, [make_request("long", prompt_len=20), make_request("short", prompt_len=4)]
    )
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"long": 16}
    updated = scheduler.update_from_output(out, {})
    assert updated == []
    out = scheduler.schedule()
    assert ids(out.scheduled) == ["long", "short"]
    updated = scheduler.update_from_output(out, {"long": 20, "short": 21})
    assert ids(updated) == ["long", "short"]
    assert SchedulerOutput().is_empty and not out.is_empty


def test_a_sliding_window_request_longer_than_the_cache_is_swapped_even_in_recompute_mode():
    # recomputing would re-prefill all its tokens at once, more than the whole cache holds
    scheduler = create_scheduler(
        num_gpu_blocks=8, max_model_len=64, sliding_window=16, preemption_mode="recompute"
    )
    (long,) = add_requests(scheduler, [make_request("long", 4, max_tokens=55, priority=1)])
    for _ in range(30):
        run_step(scheduler)
    assert long.num_tokens > 8 * 4  # past the cache, on a window's worth of blocks
    (other,) = add_requests(scheduler, [make_request("other", 8, max_tokens=40)])
    out = step_until_preempted(scheduler)
    assert out.preempted == [long] and long.status is RequestStatus.SWAPPED
    run_until_done(scheduler)
    assert (long.num_output_tokens, other.num_output_tokens) == (55, 40)
    assert scheduler.num_preemptions["recompute"] == 0
    assert_nothing_left(scheduler)
