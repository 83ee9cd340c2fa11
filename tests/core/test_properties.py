"""Random workloads: invariants after every step, every request ends, no token lost to preemption.

Each example draws a small cache and budget, a preemption mode, and requests that arrive over
several steps with random prompt lengths, max_tokens, priorities, numbers of samples (n) and
aborts (before a step or while it runs). Every step also runs on a shadow KV cache that checks
each request reads its own tokens' K/V through its block table (see `run_step`).
`max_model_len` never exceeds the cache, as an engine must ensure: an admitted
request can always fit again once it has the cache to itself.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from asyncengine.core.block_manager import RELEASED
from asyncengine.core.request import Request, RequestStatus
from asyncengine.core.scheduler import Scheduler

from .utils import (
    DEFAULTS,
    assert_nothing_left,
    create_scheduler,
    expected_num_output_tokens,
    make_request,
    run_step,
)

FINISHED_ABORTED = RequestStatus.FINISHED_ABORTED
FINISHED_IGNORED = RequestStatus.FINISHED_IGNORED

PROPERTY_SETTINGS = settings(
    max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@dataclass(frozen=True)
class RequestSpec:
    """A request of a workload: when it arrives and, maybe, when it is aborted."""

    request_id: str
    arrival_step: int
    prompt_len: int
    max_tokens: int | None
    priority: int
    n: int
    abort_step: int | None
    is_abort_mid_step: bool

    def make(self) -> Request:
        return make_request(
            self.request_id, self.prompt_len, self.max_tokens, priority=self.priority, n=self.n
        )

    def samples(self, requests: dict[str, Request]) -> list[Request]:
        """Its samples forked so far, by index (sample 0 is the request itself)."""
        group = [r for r in requests.values() if r.group_id == self.request_id]
        return sorted(group, key=lambda r: r.sample_index)


@st.composite
def scheduler_settings(draw: st.DrawFn) -> dict[str, Any]:
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    max_model_len = draw(st.integers(1, 64))
    # from just one longest request's worth of blocks to a few: tight enough to preempt often
    min_num_gpu_blocks = -(-max_model_len // block_size)
    num_gpu_blocks = draw(st.integers(min_num_gpu_blocks, 2 * min_num_gpu_blocks + 1))
    max_num_seqs = draw(st.integers(1, 8))
    return {
        "block_size": block_size,
        "num_gpu_blocks": num_gpu_blocks,
        "num_cpu_blocks": draw(st.integers(0, 2 * num_gpu_blocks)),
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": draw(st.integers(max_num_seqs, 48)),
        "max_model_len": max_model_len,
        "preemption_mode": draw(st.sampled_from(["auto", "swap", "recompute"])),
        "watermark": draw(st.sampled_from([0.0, 0.1, 0.25])),
        # the test prompts share their prefixes, so caching finds real hits; a sliding window
        # (never with caching) releases the blocks it has moved past
        **draw(
            st.fixed_dictionaries({"enable_caching": st.booleans(), "sliding_window": st.none()})
            | st.fixed_dictionaries(
                {"enable_caching": st.just(False), "sliding_window": st.integers(1, 24)}
            )
        ),
    }


@st.composite
def workloads(draw: st.DrawFn, max_model_len: int, with_aborts: bool) -> list[RequestSpec]:
    num_requests = draw(st.integers(1, 10))
    specs = []
    for i in range(num_requests):
        abort_step = draw(st.none() | st.integers(0, 60)) if with_aborts else None
        specs.append(
            RequestSpec(
                request_id=f"req-{i}",
                arrival_step=draw(st.integers(0, 6)),
                # now and then longer than max_model_len: such a request must be rejected
                prompt_len=max_model_len + 1
                if draw(st.integers(0, 15)) == 0
                else draw(
                    st.integers(1, max(1, max_model_len // 2)) | st.integers(1, max_model_len)
                ),
                max_tokens=draw(st.none() | st.integers(1, 32)),
                priority=draw(st.integers(0, 2)),
                # samples share the prompt's blocks (fork, copy-on-write) and are preempted,
                # swapped and resumed as a group
                n=draw(st.sampled_from([1, 1, 2, 3])),
                abort_step=abort_step,
                is_abort_mid_step=draw(st.booleans()),
            )
        )
    return specs


def max_steps_for(specs: list[RequestSpec], max_model_len: int) -> int:
    # generous: even re-prefilling after every preemption, each token costs a few steps
    num_tokens = sum(min(s.prompt_len, max_model_len) + max_model_len for s in specs)
    return max(s.arrival_step for s in specs) + 100 + 10 * num_tokens


def simulate(scheduler: Scheduler, specs: list[RequestSpec]) -> dict[str, Request]:
    """Feed `specs` to `scheduler` step by step until every request has ended.

    Returns every sample of every request by its scheduler id (forks get ids of their own).
    """
    max_model_len = scheduler.config.max_model_len
    max_steps = max_steps_for(specs, max_model_len)
    pending = sorted(specs, key=lambda s: s.arrival_step)
    requests: dict[str, Request] = {}
    step = 0
    while pending or scheduler.has_unfinished_requests():
        assert step < max_steps, f"not done after {max_steps} steps: {scheduler.requests}"
        while pending and pending[0].arrival_step <= step:
            req = pending.pop(0).make()
            scheduler.add_request(req)
        requests.update(scheduler.requests)
        mid_step_aborts = []
        for spec in specs:
            if spec.abort_step != step or spec.request_id not in requests:
                continue
            # like the engine: aborting a request aborts every sample it has
            for req in spec.samples(requests):
                sample_id = req.request_id
                was_finished = req.is_finished
                if not was_finished:
                    state = "during a step" if spec.is_abort_mid_step else req.status.name
                    event(f"aborted {state}")
                if spec.is_abort_mid_step:
                    mid_step_aborts.append(sample_id)
                    continue
                assert (scheduler.abort_request(sample_id) is None) == was_finished
                assert req.status is RequestStatus.FINISHED_ABORTED or was_finished
        out = run_step(scheduler, abort_during_step=mid_step_aborts)
        swapped_groups = Counter(
            r.group_id for r in out.preempted if r.status is RequestStatus.SWAPPED
        )
        if any(count > 1 for count in swapped_groups.values()):
            event("samples swapped out together")
        if any(RELEASED in table for table in scheduler.block_manager.block_tables.values()):
            event("blocks released outside the sliding window")
        requests.update(scheduler.requests)  # samples forked this step
        step += 1
    return requests


def check_outcomes(
    scheduler: Scheduler, specs: list[RequestSpec], requests: dict[str, Request]
) -> None:
    """Aborted, rejected, or every sample with exactly as many tokens as its limits allow."""
    assert_nothing_left(scheduler)
    bm, config = scheduler.block_manager, scheduler.config
    for spec in specs:
        parent = requests[spec.request_id]
        # a new prompt must leave the watermark free; a resumed request need not
        is_too_big = bm.num_blocks_for(spec.prompt_len) > bm.num_gpu_blocks - bm.watermark_blocks
        never_fits = (
            spec.prompt_len > config.max_model_len or is_too_big or spec.n > config.max_num_seqs
        )
        samples = spec.samples(requests)
        if len(samples) < spec.n:  # not forked: the request ended before its prompt was computed
            assert parent.status in (FINISHED_ABORTED, FINISHED_IGNORED), parent
        for req in samples:
            if req.status is FINISHED_ABORTED:
                assert spec.abort_step is not None, req
            elif never_fits:
                assert req.status is FINISHED_IGNORED and req.error, req
                assert req.num_output_tokens == 0
            else:
                assert req.status is RequestStatus.FINISHED_LENGTH, (req, req.error)
                expected = expected_num_output_tokens(req, config.max_model_len)
                assert req.num_output_tokens == expected, req


def describe_run(
    config: dict[str, Any], scheduler: Scheduler, requests: dict[str, Request]
) -> None:
    """Label the example for `--hypothesis-show-statistics`: which paths did it take?"""
    for kind in scheduler.num_preemptions:
        event(f"{config['preemption_mode']} mode preempted by {kind}")
    for status in {req.status for req in requests.values()}:
        event(status.name)


@st.composite
def scenarios(draw: st.DrawFn, with_aborts: bool) -> tuple[dict[str, Any], list[RequestSpec]]:
    config = draw(scheduler_settings())
    return config, draw(workloads(config["max_model_len"], with_aborts))


@PROPERTY_SETTINGS
@given(scenarios(with_aborts=True))
def test_every_request_ends_with_every_token_its_limits_allow(scenario):
    config, specs = scenario
    scheduler = create_scheduler(**config)
    requests = simulate(scheduler, specs)
    check_outcomes(scheduler, specs, requests)
    describe_run(config, scheduler, requests)


def _spec(request_id: str, prompt_len: int, priority: int = 0, n: int = 1) -> RequestSpec:
    return RequestSpec(request_id, 0, prompt_len, None, priority, n, None, False)


# found by hypothesis: a sliding-window group swapped back in released a block it had just
# swapped in, and another request's swap-in of the same step was given that block too
SWAP_IN_THEN_RELEASE = (
    {
        **DEFAULTS,
        "block_size": 1,
        "num_gpu_blocks": 4,
        "num_cpu_blocks": 3,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 4,
        "max_model_len": 4,
        "watermark": 0.0,
        "sliding_window": 1,
    },
    [
        *(_spec(f"req-{i}", 5) for i in (0, 1)),
        _spec("req-2", 1, priority=1, n=2),
        *(_spec(f"req-{i}", 5) for i in (3, 4, 5)),
        _spec("req-6", 1),
        _spec("req-7", 1, priority=1),
    ],
)


@PROPERTY_SETTINGS
@given(scenarios(with_aborts=False))
@example(SWAP_IN_THEN_RELEASE)
def test_preemption_never_changes_what_a_request_generates(scenario):
    config, specs = scenario
    pressed = create_scheduler(**config)
    pressed_requests = simulate(pressed, specs)
    check_outcomes(pressed, specs, pressed_requests)
    describe_run(config, pressed, pressed_requests)

    # the same workload with room for everything at once: nothing is ever preempted
    max_model_len, num_seqs = config["max_model_len"], sum(s.n for s in specs)
    roomy = create_scheduler(
        **{
            **config,
            "num_gpu_blocks": num_seqs * (max_model_len + 1),
            "block_size": 1,
            "max_num_seqs": num_seqs,
            "max_num_batched_tokens": num_seqs * (max_model_len + 2),
            "watermark": 0.0,
        }
    )
    roomy_requests = simulate(roomy, specs)
    assert not roomy.num_preemptions
    # forks take fresh engine ids: a sample is (its request, its index) in both runs
    roomy_samples = {(r.group_id, r.sample_index): r for r in roomy_requests.values()}
    for req in pressed_requests.values():
        sample = (req.group_id, req.sample_index)
        assert sample in roomy_samples, sample
        if req.status is RequestStatus.FINISHED_LENGTH:  # not rejected under pressure
            assert req.token_ids == roomy_samples[sample].token_ids, sample
