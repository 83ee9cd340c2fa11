"""Helpers that let the core tests read like the spec: build a scheduler, feed it, step, check.

`run_step` plays the engine and the worker: it schedules, checks the plan, applies it to a
`ShadowCache` (which token's K/V each slot holds) and reads every scheduled request's context
back through its block table, "samples" a token for every request whose computed tokens reach
its end, updates the scheduler and then checks every invariant of the scheduler and the block
manager. Tests call it after every step.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from asyncengine.config import SchedulerConfig
from asyncengine.core.block_manager import RELEASED, BlockSpaceManager
from asyncengine.core.request import Request, RequestStatus
from asyncengine.core.scheduler import Scheduler, SchedulerOutput
from asyncengine.sampling_params import SamplingParams

EOS = 1
VOCAB_SIZE = 1000
FIRST_ORDINARY_TOKEN = 10  # ids below this are special: the fake model never samples them

DEFAULTS: dict[str, Any] = {
    "block_size": 4,
    "num_gpu_blocks": 16,
    "num_cpu_blocks": 16,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 32,
    "max_model_len": 64,
    "preemption_mode": "auto",
    "watermark": 0.01,  # BlockSpaceManager's default: 0 blocks for pools under 100
    "enable_caching": False,
    "sliding_window": None,
}

Sampler = Callable[[Request], int]

_arrival_times = itertools.count()


def create_scheduler(**overrides: Any) -> Scheduler:
    """A scheduler over a fresh block manager with the small `DEFAULTS`, `overrides` applied."""
    unknown = overrides.keys() - DEFAULTS.keys()
    assert not unknown, f"unknown scheduler settings: {sorted(unknown)}"
    c = {**DEFAULTS, **overrides}
    block_manager = BlockSpaceManager(
        c["block_size"],
        c["num_gpu_blocks"],
        c["num_cpu_blocks"],
        sliding_window=c["sliding_window"],
        watermark=c["watermark"],
        enable_caching=c["enable_caching"],
    )
    config = SchedulerConfig(
        max_num_seqs=c["max_num_seqs"],
        max_num_batched_tokens=c["max_num_batched_tokens"],
        max_model_len=c["max_model_len"],
        preemption_mode=c["preemption_mode"],
    )
    return Scheduler(config, block_manager)


def make_request(
    request_id: str,
    prompt_len: int = 8,
    max_tokens: int | None = 16,
    *,
    priority: int = 0,
    **sampling: Any,
) -> Request:
    """A request with an ordinary-token prompt; `sampling` goes to `SamplingParams`.

    Arrival times are strictly increasing in creation order, so FCFS order is creation order.
    """
    prompt = [FIRST_ORDINARY_TOKEN + (i * 7) % 50 for i in range(prompt_len)]
    return Request(
        request_id,
        prompt,
        SamplingParams(max_tokens=max_tokens, **sampling),
        eos_token_ids=(EOS,),
        priority=priority,
        arrival_time=float(next(_arrival_times)),
    )


def make_requests(
    n: int, prompt_len: int = 8, max_tokens: int | None = 16, *, prefix: str = "req", **kwargs: Any
) -> list[Request]:
    """`n` alike requests named `{prefix}-0` ... `{prefix}-{n-1}`, in arrival order."""
    return [make_request(f"{prefix}-{i}", prompt_len, max_tokens, **kwargs) for i in range(n)]


def add_requests(scheduler: Scheduler, requests: Iterable[Request]) -> list[Request]:
    requests = list(requests)
    for req in requests:
        scheduler.add_request(req)
    return requests


def fake_model(req: Request) -> int:
    """A deterministic "model": the next token depends only on the tokens so far and the sample
    index (so the samples of one request part ways), never EOS."""
    key = hash((req.sample_index, *req.token_ids))
    return FIRST_ORDINARY_TOKEN + key % (VOCAB_SIZE - FIRST_ORDINARY_TOKEN)


class ShadowCache:
    """What the worker's KV cache holds, one token id per slot in place of K/V.

    `run_plan` does what the worker does with a plan: swap out, swap in, copy, then write the K/V
    of every scheduled token into its slot. It then reads each scheduled request's context back
    through its block table, as attention would (all of it, or with a sliding window what its
    first query sees): a block shared that should not be, a missed copy-on-write, a lost swap, a
    prefix-cache hit on other content or a block released too early reads a wrong token.
    """

    def __init__(self, block_manager: BlockSpaceManager) -> None:
        size = block_manager.block_size
        self.block_size = size
        self.sliding_window = block_manager.sliding_window
        self.gpu: list[list[int | None]] = [
            [None] * size for _ in range(block_manager.num_gpu_blocks)
        ]
        self.cpu: list[list[int | None]] = [
            [None] * size for _ in range(block_manager.num_cpu_blocks)
        ]

    def run_plan(self, out: SchedulerOutput) -> None:
        for gpu, cpu in out.blocks_to_swap_out:
            self.cpu[cpu] = list(self.gpu[gpu])
        for cpu, gpu in out.blocks_to_swap_in:
            self.gpu[gpu] = list(self.cpu[cpu])
        sources = {src: list(self.gpu[src]) for src, _ in out.blocks_to_copy}  # one launch
        for src, dst in out.blocks_to_copy:
            self.gpu[dst] = list(sources[src])
        for req in out.scheduled:
            table = out.block_tables[req.request_id]
            start = req.num_computed_tokens
            for pos in range(start, start + out.num_scheduled_tokens[req.request_id]):
                block = table[pos // self.block_size]
                assert block != RELEASED, f"{req} writes slot {pos} of a released block"
                self.gpu[block][pos % self.block_size] = req.token_ids[pos]
        for req in out.scheduled:
            table = out.block_tables[req.request_id]
            start = req.num_computed_tokens
            end = start + out.num_scheduled_tokens[req.request_id]
            first = 0 if self.sliding_window is None else max(0, start - self.sliding_window + 1)
            context = [self._read(table, pos) for pos in range(first, end)]
            assert context == req.token_ids[first:end], (
                f"{req} reads K/V of other tokens: table {table}"
            )

    def _read(self, table: list[int], pos: int) -> int | None:
        block = table[pos // self.block_size]
        return None if block == RELEASED else self.gpu[block][pos % self.block_size]


_shadow_caches: weakref.WeakKeyDictionary[Scheduler, ShadowCache] = weakref.WeakKeyDictionary()


def shadow_cache(scheduler: Scheduler) -> ShadowCache:
    """The shadow of `scheduler`'s KV cache, made on first use."""
    if scheduler not in _shadow_caches:
        _shadow_caches[scheduler] = ShadowCache(scheduler.block_manager)
    return _shadow_caches[scheduler]


def run_step(
    scheduler: Scheduler,
    sample: Sampler = fake_model,
    abort_during_step: Iterable[str] = (),
) -> SchedulerOutput:
    """One engine step: schedule, check the plan, run it on the shadow cache, sample, update,
    check every invariant.

    `abort_during_step` ids are aborted between `schedule` and `update_from_output`, as a
    client disconnecting while the forward runs would.
    """
    out = scheduler.schedule()
    check_plan(scheduler, out)
    shadow_cache(scheduler).run_plan(out)
    sampled = {
        req.request_id: sample(req)
        for req in out.scheduled
        if req.num_computed_tokens + out.num_scheduled_tokens[req.request_id] == req.num_tokens
    }
    for request_id in abort_during_step:
        scheduler.abort_request(request_id)
    updated = scheduler.update_from_output(out, sampled)
    assert {r.request_id for r in updated} <= sampled.keys()
    check_invariants(scheduler)
    return out


def run_until_done(
    scheduler: Scheduler, max_steps: int = 1000, sample: Sampler = fake_model
) -> list[SchedulerOutput]:
    """Step until nothing is left; fail if that takes more than `max_steps` steps."""
    outputs = []
    while scheduler.has_unfinished_requests():
        assert len(outputs) < max_steps, f"not done after {max_steps} steps: {scheduler.requests}"
        outputs.append(run_step(scheduler, sample))
    return outputs


def check_plan(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """What the worker relies on: tables cover the tokens, block moves are sane, budgets hold."""
    bm, config = scheduler.block_manager, scheduler.config
    ids = [req.request_id for req in out.scheduled]
    assert len(ids) == len(set(ids)), f"a request is scheduled twice: {ids}"
    assert out.num_scheduled_tokens.keys() == set(ids) == out.block_tables.keys()
    assert len(ids) <= config.max_num_seqs
    assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens
    for req in out.scheduled:
        num_tokens = out.num_scheduled_tokens[req.request_id]
        assert req.status is RequestStatus.RUNNING and req in scheduler.running
        assert 0 < num_tokens <= req.num_tokens - req.num_computed_tokens, req
        table = out.block_tables[req.request_id]
        assert table == bm.block_tables[req.request_id]
        assert len(table) == bm.num_blocks_for(req.num_tokens), f"{req}: table {table}"
        assert all(0 <= b < bm.num_gpu_blocks or b == RELEASED for b in table)
    assert not {r.request_id for r in out.preempted} & set(ids), "a preempted request runs"
    for req in out.rejected:
        assert req.status is RequestStatus.FINISHED_IGNORED and req.error
    _check_pairs(out.blocks_to_swap_out, bm.num_gpu_blocks, bm.num_cpu_blocks)
    _check_pairs(out.blocks_to_swap_in, bm.num_cpu_blocks, bm.num_gpu_blocks)
    _check_pairs(out.blocks_to_copy, bm.num_gpu_blocks, bm.num_gpu_blocks)
    # the copies run in one launch: a block both read and written there would be a race
    sources = {src for src, _ in out.blocks_to_copy}
    assert not sources & {dst for _, dst in out.blocks_to_copy}, out.blocks_to_copy
    if out.preempted:
        assert not out.blocks_to_swap_in, "swapped in during a step that preempted"


def _check_pairs(pairs: list[tuple[int, int]], num_src: int, num_dst: int) -> None:
    assert all(0 <= src < num_src and 0 <= dst < num_dst for src, dst in pairs), pairs
    dsts = [dst for _, dst in pairs]
    assert len(dsts) == len(set(dsts)), f"two copies into one block: {pairs}"


def check_invariants(scheduler: Scheduler) -> None:
    """Each live request sits in exactly the queue its status names and holds the right blocks;
    the running ones, with the samples they will fork, fit max_num_seqs."""
    bm = scheduler.block_manager
    bm.check_invariants()
    queues = {
        RequestStatus.WAITING: scheduler.waiting,
        RequestStatus.RUNNING: scheduler.running,
        RequestStatus.SWAPPED: scheduler.swapped,
    }
    queued = [req for queue in queues.values() for req in queue]
    assert len(queued) == len({id(r) for r in queued}), "a request is in two queues"
    assert {r.request_id for r in queued} == scheduler.requests.keys()
    for status, queue in queues.items():
        assert [r.sort_key for r in queue] == sorted(r.sort_key for r in queue), status
        for req in queue:
            assert req.status is status, req
            assert scheduler.requests[req.request_id] is req
            assert (req.request_id in bm.block_tables) == (status is RequestStatus.RUNNING), req
            assert (req.request_id in bm.cpu_block_tables) == (status is RequestStatus.SWAPPED)
            assert 0 <= req.num_computed_tokens < req.num_tokens, req
            if status is RequestStatus.WAITING:
                assert req.num_computed_tokens == 0, req
    tables = [*bm.block_tables, *bm.cpu_block_tables]
    assert set(tables) <= scheduler.requests.keys(), "a finished request still holds blocks"
    # a parent still prefilling (n > 1) runs alone, and its samples are promised their slots
    promised = sum(1 + req.num_pending_samples for req in scheduler.running)
    assert promised <= scheduler.config.max_num_seqs, f"{promised} sequences promised"


def assert_nothing_left(scheduler: Scheduler) -> None:
    """No request, no queue entry and no block (GPU or CPU) is left behind."""
    bm = scheduler.block_manager
    assert not scheduler.has_unfinished_requests()
    assert not scheduler.waiting and not scheduler.running and not scheduler.swapped
    assert not bm.block_tables and not bm.cpu_block_tables
    assert bm.get_num_free_gpu_blocks() == bm.num_gpu_blocks
    assert bm.get_num_free_cpu_blocks() == bm.num_cpu_blocks
    bm.check_invariants()


def expected_num_output_tokens(req: Request, max_model_len: int) -> int:
    """How many tokens a request that never meets a stop token generates."""
    limit = max_model_len - req.num_prompt_tokens
    if req.sampling_params.max_tokens is not None:
        limit = min(limit, req.sampling_params.max_tokens)
    return max(1, limit)  # the first token is always sampled, even at max_model_len
