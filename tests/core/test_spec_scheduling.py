"""Speculation in the scheduler (issue 29): draft slots come out of the step's token budget,
and speculation turns itself off where it does not pay (a large batch, a low acceptance rate).

`speculate` plays the engine: it takes the draft slots each request got, "verifies" them with
the acceptance rate the test asks for, and updates the scheduler with what was accepted.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from asyncengine.config import SpeculativeConfig
from asyncengine.core.request import Request
from asyncengine.core.scheduler import Scheduler, SchedulerOutput
from asyncengine.core.spec_decode import SpecDecodePolicy, SpecResult

from .utils import (
    FIRST_ORDINARY_TOKEN,
    add_requests,
    check_invariants,
    create_scheduler,
    make_requests,
    run_step,
    shadow_cache,
)

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, disable_by_batch_size=8)


class EveryStepDrafts:
    """Proposes all `k` drafts every time: the budget and policy tests below ask what the
    scheduler gives when drafts exist, whatever the tokens repeat."""

    def propose(self, req: Request, k: int) -> list[int]:
        return [FIRST_ORDINARY_TOKEN + 2] * k


def speculating_scheduler(
    config: SpeculativeConfig = NGRAM, lookup: bool = False, **overrides
) -> Scheduler:
    """A scheduler that speculates: by prompt lookup if `lookup`, else with drafts always."""
    scheduler = create_scheduler(**overrides)
    scheduler.spec = SpecDecodePolicy(config, scheduler.max_seq_len)
    if not lookup:
        scheduler.spec.proposer = EveryStepDrafts()
    return scheduler


def prefill_all(scheduler: Scheduler) -> None:
    """Step until every request has its prompt computed and a first token (all decoding)."""
    for _ in range(20):
        if all(r.num_computed_tokens == r.num_tokens - 1 for r in scheduler.running) and not (
            scheduler.waiting
        ):
            return
        run_step(scheduler)
    raise AssertionError("the prompts were never all computed")


def check_spec_plan(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """The budget holds with the drafts counted, each table has room for its drafts, and
    every slot has its draft."""
    bm = scheduler.block_manager
    num_drafts = sum(out.num_spec_tokens.values())
    assert out.total_num_scheduled_tokens + num_drafts <= scheduler.config.max_num_batched_tokens
    assert out.spec_drafts.keys() == out.num_spec_tokens.keys()
    for req in out.scheduled:
        k = out.num_spec_tokens.get(req.request_id, 0)
        assert k == len(out.spec_drafts.get(req.request_id, []))
        assert k == 0 or out.num_scheduled_tokens[req.request_id] == 1  # drafts follow a decode
        table = out.block_tables[req.request_id]
        assert len(table) == bm.num_blocks_for(req.num_tokens + k), f"{req}: table {table}"


def speculate(scheduler: Scheduler, num_accepted: int | None = None) -> SchedulerOutput:
    """One step in which every request with draft slots has `num_accepted` of its drafts
    accepted (all of them when None), and one more token sampled after them."""
    out = scheduler.schedule()
    check_spec_plan(scheduler, out)
    shadow_cache(scheduler).run_plan(out)
    sampled, results, starts = {}, {}, {}
    for req in out.scheduled:
        starts[req.request_id] = req.num_computed_tokens + 1  # where its drafts' K/V goes
        if req.num_computed_tokens + out.num_scheduled_tokens[req.request_id] != req.num_tokens:
            continue
        sampled[req.request_id] = FIRST_ORDINARY_TOKEN + 1
        num_drafts = out.num_spec_tokens.get(req.request_id, 0)
        if num_drafts:
            k = num_drafts if num_accepted is None else min(num_accepted, num_drafts)
            results[req.request_id] = SpecResult(num_drafts, [FIRST_ORDINARY_TOKEN + 2] * k)
    scheduler.update_from_output(out, sampled, results)
    # the forward wrote the accepted drafts' K/V into their slots, as it did the decode's
    cache = shadow_cache(scheduler)
    for req in out.scheduled:
        result = results.get(req.request_id)
        if result is None or req.is_finished:
            continue
        table, start = out.block_tables[req.request_id], starts[req.request_id]
        for pos in range(start, start + len(result.accepted_token_ids)):
            cache.gpu[table[pos // cache.block_size]][pos % cache.block_size] = req.token_ids[pos]
    check_invariants(scheduler)
    return out


def test_draft_slots_are_counted_in_the_step_token_budget() -> None:
    # 3 decodes and a budget of 12 tokens: each takes 1 + 4 drafts while the budget lasts,
    # and the last one what is left (5 + 5 + 2: nobody is left without their own token)
    scheduler = speculating_scheduler(max_num_batched_tokens=12, num_gpu_blocks=64)
    add_requests(scheduler, make_requests(3, prompt_len=4, max_tokens=40))
    prefill_all(scheduler)
    out = speculate(scheduler)
    drafts = [out.num_spec_tokens.get(r.request_id, 0) for r in out.scheduled]
    assert drafts == [4, 4, 1]
    assert sum(out.num_scheduled_tokens.values()) + sum(drafts) <= 12
    assert len(out.scheduled) == 3  # drafts never crowd out a request's own token


def test_a_draft_run_is_cut_to_max_tokens_and_accepted_drafts_count_as_output() -> None:
    scheduler = speculating_scheduler(num_gpu_blocks=64)
    (req,) = add_requests(scheduler, make_requests(1, prompt_len=4, max_tokens=4))
    prefill_all(scheduler)  # one output token
    out = speculate(scheduler)
    # 3 tokens to go: one of its own, so at most 2 drafts
    assert out.num_spec_tokens[req.request_id] == 2
    assert req.is_finished and req.num_output_tokens == 4
    assert scheduler.block_manager.get_num_free_gpu_blocks() == 64


@pytest.mark.parametrize("num_decodes", [8, 9])
def test_speculation_is_off_in_a_step_with_more_decodes_than_disable_by_batch_size(
    num_decodes,
) -> None:
    scheduler = speculating_scheduler(
        max_num_batched_tokens=256, max_num_seqs=16, num_gpu_blocks=128
    )
    add_requests(scheduler, make_requests(num_decodes, prompt_len=4, max_tokens=40))
    prefill_all(scheduler)
    out = speculate(scheduler)
    assert len(out.scheduled) == num_decodes
    if num_decodes <= NGRAM.disable_by_batch_size:
        assert set(out.num_spec_tokens.values()) == {4}
    else:
        assert not out.num_spec_tokens


def test_a_request_whose_drafts_are_rejected_stops_speculating_and_tries_again_later() -> None:
    config = replace(NGRAM, min_acceptance_rate=0.5)
    scheduler = speculating_scheduler(config, num_gpu_blocks=64, max_model_len=200)
    (req,) = add_requests(scheduler, make_requests(1, prompt_len=4, max_tokens=150))
    prefill_all(scheduler)
    speculated = []
    for _ in range(40):
        out = speculate(scheduler, num_accepted=0)
        speculated.append(req.request_id in out.num_spec_tokens)
    # the moving rate starts at 1 and falls below 0.5 after two rejected runs; then one step
    # in 16 tries again (and is rejected again)
    first_off = speculated.index(False)
    assert first_off == 2
    retries = [i for i, on in enumerate(speculated) if on and i > first_off]
    assert retries and all(b - a == 16 for a, b in itertools.pairwise(retries))
    assert all(not on for on in speculated[first_off : retries[0]])
    stats = scheduler.spec.stats
    assert stats.num_accepted_tokens == 0
    assert stats.num_drafts == 2 + len(retries)


def test_a_request_whose_drafts_are_accepted_keeps_speculating() -> None:
    scheduler = speculating_scheduler(num_gpu_blocks=64, max_model_len=200)
    (req,) = add_requests(scheduler, make_requests(1, prompt_len=4, max_tokens=150))
    prefill_all(scheduler)
    drafts_per_step = []
    while not req.is_finished:
        out = speculate(scheduler, num_accepted=3)  # 3 of 4 accepted: a rate of 0.75
        drafts_per_step.append(out.num_spec_tokens.get(req.request_id, 0))
    # 149 tokens after the first, 4 a step (3 drafts + 1): 37 steps, then one token is left,
    # with no room for a draft
    assert drafts_per_step == [4] * 37 + [0]
    assert req.num_output_tokens == 150
    assert scheduler.spec.stats.num_accepted_per_position == [37] * 3


def test_prompt_lookup_takes_slots_only_for_the_drafts_it_finds() -> None:
    lookup = SpeculativeConfig(
        method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=3
    )
    scheduler = speculating_scheduler(lookup, lookup=True, num_gpu_blocks=64)
    prompts = {
        "a": [20, 11, 30, 31, 20],  # then 11: [20, 11] occurs before, 4 tokens follow it
        "b": [21, 22, 23, 24],  # then 11: nothing repeats
        "c": [40, 11, 41, 40],  # then 11: [40, 11] occurs before, 3 tokens follow it
    }
    reqs = make_requests(3, max_tokens=40)
    for req, prompt in zip(reqs, prompts.values()):
        req.prompt_token_ids, req.token_ids = list(prompt), list(prompt)
        req.num_prompt_tokens = len(prompt)
    a, b, c = add_requests(scheduler, reqs)
    prefill_all(scheduler)
    for req in reqs:
        req.token_ids[-1] = 11  # as if each had sampled 11 (its K/V is not computed yet)
    out = speculate(scheduler, num_accepted=0)
    assert out.spec_drafts == {a.request_id: [30, 31, 20, 11], c.request_id: [41, 40, 11]}
    assert out.num_spec_tokens == {a.request_id: 4, c.request_id: 3}
    # b is a plain decode: its one token, and (check_spec_plan) no slot past it
    assert out.num_scheduled_tokens[b.request_id] == 1
