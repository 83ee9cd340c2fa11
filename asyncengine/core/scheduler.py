"""Continuous batching over waiting, running and swapped queues with swap/recompute preemption."""

from __future__ import annotations

import bisect
import itertools
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncengine.config import SchedulerConfig, SpeculativeConfig
from asyncengine.core.block_manager import AllocStatus, BlockSpaceManager
from asyncengine.core.request import FinishReason, Request, RequestStatus
from asyncengine.core.spec_decode import SpecDecodePolicy, SpecResult


@dataclass
class SchedulerOutput:
    """The plan for one step: who runs, how many tokens each, and the block moves to apply first.

    `scheduled` is in batch order; the worker computes tokens
    `[req.num_computed_tokens, req.num_computed_tokens + num_scheduled_tokens[id])` of each.
    A decode in `num_spec_tokens` also has that many slots (and budget tokens) for drafts
    after its token, for the target to check in the same forward: those in `spec_drafts`
    (prompt lookup's, found while planning), or the runner's proposer's.
    """

    scheduled: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) on the GPU
    preempted: list[Request] = field(default_factory=list)
    # finished before they ran: can never fit, or their adapter could not be loaded
    rejected: list[Request] = field(default_factory=list)
    # LoRA: the device slot of each adapter the batch uses, and the adapters (host weights,
    # by slot) to copy into their slots before the forward; set by the engine after planning
    lora_slots: dict[int, int] = field(default_factory=dict)
    lora_loads: dict[int, Any] = field(default_factory=dict)
    num_spec_tokens: dict[str, int] = field(default_factory=dict)  # draft slots per request
    spec_drafts: dict[str, list[int]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.blocks_to_swap_out

    def add(self, req: Request, num_tokens: int, block_table: list[int]) -> None:
        self.scheduled.append(req)
        self.num_scheduled_tokens[req.request_id] = num_tokens
        self.block_tables[req.request_id] = block_table


class LoRAAdmission(Protocol):
    """What the scheduler asks of the engine's adapters before a request may run."""

    max_loras: int  # distinct adapters the running requests may use at once

    def is_ready(self, lora_int_id: int) -> bool:
        """Whether the adapter is in host memory (if not, its load starts, off the step)."""
        ...

    def take_unreadable(self) -> set[int]:
        """The adapters whose load failed since the last call."""
        ...


class _Queue(list[Request]):
    """Requests kept in priority order: lower priority value first, then earlier arrival."""

    def insert_sorted(self, req: Request) -> None:
        bisect.insort(self, req, key=lambda r: r.sort_key)


class Scheduler:
    """Decides each step which requests run and for how many tokens (chunked prefill included).

    Order of a step: running requests first (preempting the newest, lowest-priority one when a
    request cannot grow), then swapped requests back in, then new requests; nothing new is
    admitted in a step that preempted.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockSpaceManager,
        loras: LoRAAdmission | None = None,
        speculative_config: SpeculativeConfig | None = None,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        # with LoRA: the running requests use at most `max_loras` adapters, all loaded
        self.loras = loras
        self.waiting = _Queue()
        self.running = _Queue()
        self.swapped = _Queue()
        self.requests: dict[str, Request] = {}
        # during a step's admissions: running sequences, with the samples still to be forked
        self._num_promised_seqs = 0
        # preempted requests, by mode: "swap" | "recompute"
        self.num_preemptions: Counter[str] = Counter()
        # a sequence stops at max_model_len, or when it fills the whole cache: it could
        # never grow further, and preempting it would not help (a sliding window frees
        # blocks as it moves, so there the cache is no limit)
        self.max_seq_len = config.max_model_len
        if block_manager.sliding_window is None:
            capacity = block_manager.num_gpu_blocks * block_manager.block_size
            self.max_seq_len = min(self.max_seq_len, capacity)
        self.spec = (
            None
            if speculative_config is None
            else SpecDecodePolicy(speculative_config, self.max_seq_len)
        )

    # -- requests in and out -----------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        assert req.request_id not in self.requests, f"duplicate request id {req.request_id!r}"
        self.requests[req.request_id] = req
        self.waiting.insert_sorted(req)

    def finish_request(self, req: Request, reason: FinishReason) -> None:
        """End `req` for `reason` wherever it is and free its blocks (the reason is final)."""
        if req.is_finished:
            return
        for queue in (self.running, self.waiting, self.swapped):
            if req in queue:
                queue.remove(req)
                break
        req.status = reason.status
        req.finish_reason = reason
        req.finished_time = time.monotonic()
        self.block_manager.free(req)
        self.requests.pop(req.request_id, None)

    def finish_group(self, group_id: str, reason: FinishReason) -> list[Request]:
        """End every unfinished sample of request group `group_id`; returns them."""
        group = [req for req in self.requests.values() if req.group_id == group_id]
        for req in group:
            self.finish_request(req, reason)
        return group

    def abort_request(self, request_id: str) -> Request | None:
        """Abort in any state; unknown or finished ids are a no-op (returns None)."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.finish_request(req, FinishReason.ABORTED)
        return req

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- one step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = _Budget(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        spec = self.spec
        if spec is not None and not spec.is_on_for(sum(map(_is_decode, self.running))):
            spec = None
        if self.loras is not None:
            self._end_unreadable_adapters(out)
        self._schedule_running(out, budget, spec)
        # what admissions may add to, up to max_num_seqs: a parent still prefilling runs alone,
        # and the samples it forks once its prompt is in need slots of their own
        self._num_promised_seqs = sum(1 + req.num_pending_samples for req in self.running)
        if not out.preempted:
            self._schedule_swapped(out, budget)
        # swapped requests are older than any new one: let them back in first
        if not out.preempted and not self.swapped:
            self._schedule_waiting(out, budget)
        now = time.monotonic()
        for req in out.scheduled:
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        return out

    def _schedule_running(
        self, out: SchedulerOutput, budget: _Budget, spec: SpecDecodePolicy | None
    ) -> None:
        queue = deque(self.running)
        while queue and budget.has_room:
            req = queue[0]
            if spec is not None and _is_lone_decode(req, queue):
                num_spec, drafts = spec.propose(req, budget.num_tokens - len(queue))
                if num_spec and self.block_manager.can_append_slot(req, num_lookahead=num_spec):
                    queue.popleft()
                    self._add_decode(out, budget, req, num_spec, drafts)
                    continue
            if _is_lone_decode(req, queue):  # most of every step: one token, one sample
                copies = self.block_manager.append_decode_slot(req)
                if copies is not None:
                    queue.popleft()
                    out.blocks_to_copy += copies
                    budget.num_tokens -= 1
                    budget.num_seqs -= 1
                    out.add(req, 1, self.block_manager.block_tables[req.request_id])
                    continue
            # the samples of one request grow together or are preempted together
            group = _pop_group(queue, 0)
            group_spec = self._group_spec_tokens(group, budget, len(queue), spec)
            while not self.block_manager.can_append_slot(*group):
                victims = _pop_group(queue, -1) if queue else group
                self._preempt(victims, out)
                if victims is group:
                    break
            else:
                # leave one token per later running request so decodes never stall behind a
                # long chunked prefill
                reserve = len(queue) + len(group)
                for req in group:
                    reserve -= 1
                    num_spec, drafts = group_spec.get(req.request_id, (0, None))
                    if num_spec:
                        self._add_decode(out, budget, req, num_spec, drafts)
                        continue
                    num_tokens = budget.take(req, reserve)
                    if num_tokens == 0:
                        continue
                    out.blocks_to_copy += self.block_manager.append_slot(req)
                    out.add(req, num_tokens, self.block_manager.get_block_table(req))

    def _add_decode(
        self,
        out: SchedulerOutput,
        budget: _Budget,
        req: Request,
        num_spec: int,
        drafts: list[int] | None,
    ) -> None:
        """Schedule `req`'s one token with `num_spec` draft slots after it (room checked),
        and the drafts for them if they are known now."""
        out.blocks_to_copy += self.block_manager.append_slot(req, num_lookahead=num_spec)
        budget.num_tokens -= 1 + num_spec
        budget.num_seqs -= 1
        out.add(req, 1, self.block_manager.get_block_table(req))
        out.num_spec_tokens[req.request_id] = num_spec
        if drafts is not None:
            out.spec_drafts[req.request_id] = drafts

    def _group_spec_tokens(
        self, group: list[Request], budget: _Budget, num_later: int, spec: SpecDecodePolicy | None
    ) -> dict[str, tuple[int, list[int] | None]]:
        """Draft slots (and drafts, if known now) for each decoding sample of `group` (n > 1),
        if they all fit now."""
        if spec is None:
            return {}
        num_left = budget.num_tokens - num_later - len(group)
        num_spec = {}
        for req in group:
            if _is_decode(req) and num_left > 0:
                k, drafts = spec.propose(req, num_left)
                num_spec[req.request_id] = (k, drafts)
                num_left -= k
        lookahead = max((k for k, _ in num_spec.values()), default=0)
        if not lookahead or budget.num_seqs < len(group):
            return {}
        if not self.block_manager.can_append_slot(*group, num_lookahead=lookahead):
            return {}
        return num_spec

    def _schedule_swapped(self, out: SchedulerOutput, budget: _Budget) -> None:
        active = self.running_loras()
        while self.swapped:
            group = _head_group(self.swapped)
            if not self._has_room(budget, group) or not self._lora_fits(group[0], active):
                break
            if self.block_manager.can_swap_in(*group) is not AllocStatus.OK:
                if self.running:
                    break
                # nothing runs that could ever free blocks: recompute so we make progress
                for req in group:
                    self.swapped.remove(req)
                    self._recompute(req)
                continue
            out.blocks_to_swap_in += self.block_manager.swap_in(*group)
            active.add(group[0].lora_int_id)
            self._num_promised_seqs += _num_seqs(group)
            for req in group:
                self.swapped.remove(req)
                out.blocks_to_copy += self.block_manager.append_slot(req)
                req.status = RequestStatus.RUNNING
                self.running.insert_sorted(req)
                num_tokens = budget.take(req, reserve=0)
                if num_tokens:
                    out.add(req, num_tokens, self.block_manager.get_block_table(req))

    def _schedule_waiting(self, out: SchedulerOutput, budget: _Budget) -> None:
        active = self.running_loras()
        num_skipped = 0  # requests whose adapter has no slot (or is loading) wait in place
        # an older request waits for an adapter slot: newer adapter requests wait behind it
        # (admitted, they would keep their adapters in the slots for good); base-model ones
        # take no slot and go on
        is_slot_wanted = False
        while len(self.waiting) > num_skipped and budget.has_room:
            req = self.waiting[num_skipped]
            if not self._lora_fits(req, active):
                assert self.loras is not None
                is_slot_wanted |= len(active - {0}) >= self.loras.max_loras
                num_skipped += 1
                continue
            if is_slot_wanted and req.lora_int_id:
                num_skipped += 1
                continue
            status = self._can_admit(req)
            if status is AllocStatus.NEVER:
                self.waiting.pop(num_skipped)
                req.error = self._why_never(req)
                self.finish_request(req, FinishReason.REJECTED)
                out.rejected.append(req)
                continue
            if status is AllocStatus.LATER or not self._has_room(budget, [req]):
                break
            self.waiting.pop(num_skipped)
            active.add(req.lora_int_id)
            self._num_promised_seqs += _num_seqs([req])
            num_cached = self.block_manager.allocate(req, _uses_cache(req)).num_cached_tokens
            req.num_computed_tokens = num_cached
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.insert_sorted(req)
            if req.is_ready_to_fork:  # a one-token prompt, or all but its last token cached
                # every sample starts next step, through the running pass that gives each
                # its own copy of the shared last block before it writes there
                self._fork_samples(req)
                continue
            num_tokens = budget.take(req, reserve=0)
            out.add(req, num_tokens, self.block_manager.get_block_table(req))

    def _end_unreadable_adapters(self, out: SchedulerOutput) -> None:
        """End with an error the waiting and swapped requests whose adapter failed to load
        (its directory changed since it was registered): they would wait for it for good."""
        assert self.loras is not None
        unreadable = self.loras.take_unreadable()
        if not unreadable:
            return
        for req in [r for r in (*self.waiting, *self.swapped) if r.lora_int_id in unreadable]:
            req.error = "its LoRA adapter could not be read from disk again (see the server log)"
            self.finish_request(req, FinishReason.ERROR)
            out.rejected.append(req)

    def running_loras(self) -> set[int]:
        """The adapters the running requests use (0, the base model, among them if any)."""
        return {req.lora_int_id for req in self.running}

    def _lora_fits(self, req: Request, active: set[int]) -> bool:
        """Whether `req` may join the running requests, which use the adapters `active`."""
        lora_int_id = req.lora_int_id
        if not lora_int_id or lora_int_id in active:
            return True
        assert self.loras is not None, "a request with an adapter, and LoRA is off"
        num_active = len(active) - (0 in active)
        return num_active < self.loras.max_loras and self.loras.is_ready(lora_int_id)

    def _has_room(self, budget: _Budget, group: list[Request]) -> bool:
        num_seqs = self._num_promised_seqs + _num_seqs(group)
        return budget.has_room and num_seqs <= self.config.max_num_seqs

    def _fork_samples(self, parent: Request) -> None:
        """Start samples 1..n-1 of `parent`, sharing its blocks (copy-on-write)."""
        for index in range(1, parent.sampling_params.n):
            child = parent.fork_sample(index)
            self.block_manager.fork(parent, child)
            child.status = RequestStatus.RUNNING
            self.requests[child.request_id] = child
            self.running.insert_sorted(child)
        parent.num_pending_samples = 0

    def _can_admit(self, req: Request) -> AllocStatus:
        if req.num_tokens > self.config.max_model_len:
            return AllocStatus.NEVER
        if 1 + req.num_pending_samples > self.config.max_num_seqs:
            return AllocStatus.NEVER  # its samples could never run at once
        return self.block_manager.can_allocate(
            req, is_resumed=req.num_preemptions > 0, use_cache=_uses_cache(req)
        )

    def _why_never(self, req: Request) -> str:
        num_seqs = 1 + req.num_pending_samples
        if num_seqs > self.config.max_num_seqs:
            return f"n ({num_seqs}) exceeds max_num_seqs ({self.config.max_num_seqs})"
        bm = self.block_manager
        return (
            f"request needs {req.num_tokens} tokens of KV cache, but the cache holds "
            f"{bm.num_gpu_blocks * bm.block_size} tokens "
            f"and max_model_len is {self.config.max_model_len}"
        )

    # -- preemption --------------------------------------------------------------------------

    def _preempt(self, victims: list[Request], out: SchedulerOutput) -> None:
        """Swap out or recompute `victims`: one request, or the running samples of one."""
        mode = "swap" if self._should_swap(victims) else "recompute"
        if mode == "swap":
            out.blocks_to_swap_out += self.block_manager.swap_out(*victims)
        for victim in victims:
            self.running.remove(victim)
            victim.num_preemptions += 1
            out.preempted.append(victim)
            if mode == "swap":
                victim.status = RequestStatus.SWAPPED
                self.swapped.insert_sorted(victim)
            else:
                self._recompute(victim)
        self.num_preemptions[mode] += len(victims)

    def _should_swap(self, victims: list[Request]) -> bool:
        if not self.block_manager.can_swap_out(*victims):
            return False
        # a recomputed request re-prefills every token at once: a sliding-window sequence that
        # has grown past the whole cache could never come back, so it is swapped in any mode
        bm = self.block_manager
        if any(bm.num_blocks_for(v.num_tokens) > bm.num_gpu_blocks for v in victims):
            return True
        mode = self.config.preemption_mode
        # auto: samples sharing blocks would lose the sharing if recomputed; a lone request
        # with less than a block computed has nothing worth moving
        return mode == "swap" or (
            mode == "auto" and (len(victims) > 1 or victims[0].num_computed_tokens >= bm.block_size)
        )

    def _recompute(self, req: Request) -> None:
        """Drop `req`'s K/V; it re-prefills prompt and outputs so far when readmitted."""
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.insert_sorted(req)

    # -- after the forward -------------------------------------------------------------------

    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled_token_ids: dict[str, int],
        spec_results: dict[str, SpecResult] | None = None,
    ) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish stopped requests.

        A request in `spec_results` first takes its accepted drafts (their K/V was computed
        in this forward), each checked for stops like a sampled token; its draft slots past
        the new last token are given back.
        Returns the requests that got a new token (finished ones included), in batch order.
        """
        updated = []
        now = time.monotonic()
        num_scheduled_tokens = out.num_scheduled_tokens
        mark_computed = self.block_manager.mark_computed
        for req in out.scheduled:
            if req.is_finished:  # aborted while the step ran
                continue
            if req.request_id in out.num_spec_tokens:
                self._update_speculated(req, sampled_token_ids, spec_results or {}, now)
                updated.append(req)
                continue
            req.num_computed_tokens += num_scheduled_tokens[req.request_id]
            mark_computed(req, req.num_computed_tokens)
            if req.num_pending_samples and req.is_ready_to_fork:
                self._fork_samples(req)
            token_id = sampled_token_ids.get(req.request_id)
            if token_id is None:  # a prefill chunk that did not reach the end of the prompt
                continue
            req.append_token(token_id)
            if req.first_token_time is None:
                req.first_token_time = now
            reason = self._check_stop(req, token_id)
            if reason is not None:
                self.finish_request(req, reason)
            updated.append(req)
        return updated

    def _update_speculated(
        self,
        req: Request,
        sampled_token_ids: dict[str, int],
        spec_results: dict[str, SpecResult],
        now: float,
    ) -> None:
        """A decode with draft slots: its token, accepted drafts and the token after them."""
        result = spec_results.get(req.request_id)
        accepted = result.accepted_token_ids if result is not None else []
        if result is not None and self.spec is not None:
            self.spec.observe(req, result)
        req.num_computed_tokens += 1 + len(accepted)
        # only tokens already in the sequence are hashed; the accepted ones are next step
        self.block_manager.mark_computed(req, min(req.num_computed_tokens, req.num_tokens))
        if req.first_token_time is None:
            req.first_token_time = now
        sampled = sampled_token_ids.get(req.request_id)
        if sampled is None:  # its sampling failed: the engine has ended it
            return
        for token_id in (*accepted, sampled):
            req.append_token(token_id)
            reason = self._check_stop(req, token_id)
            if reason is not None:
                self.finish_request(req, reason)
                return
        self.block_manager.trim(req)

    def _check_stop(self, req: Request, token_id: int) -> FinishReason | None:
        params = req.sampling_params
        num_tokens = len(req.token_ids)
        num_output_tokens = num_tokens - req.num_prompt_tokens
        if num_output_tokens >= params.min_tokens:
            if token_id in req.eos_token_ids and not params.ignore_eos:
                return FinishReason.EOS
            if token_id in params.stop_token_ids:
                req.stop_reason = token_id
                return FinishReason.STOP_TOKEN
        if params.max_tokens is not None and num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        if num_tokens >= self.config.max_model_len:
            return FinishReason.CONTEXT_LIMIT
        if num_tokens >= self.max_seq_len:
            return FinishReason.CACHE_LIMIT
        return None


def _is_decode(req: Request) -> bool:
    return req.num_computed_tokens + 1 == len(req.token_ids)


def _head_group(queue: list[Request]) -> list[Request]:
    """The first request of `queue` and its sibling samples right after it."""
    group_id = queue[0].group_id
    return list(itertools.takewhile(lambda req: req.group_id == group_id, queue))


def _is_lone_decode(req: Request, queue: deque[Request]) -> bool:
    """Whether `req`, at the head of `queue`, computes one token and has no sibling samples
    (siblings sit right after it)."""
    return (
        req.num_computed_tokens + 1 == len(req.token_ids)
        and not req.num_pending_samples
        and (len(queue) == 1 or queue[1].group_id != req.group_id)
    )


def _pop_group(queue: deque[Request], index: int) -> list[Request]:
    """Pop the request at `index` (0 or -1) of `queue` with its sibling samples next to it
    (siblings share a sort key, so they sit together), in queue order."""
    pop = queue.popleft if index == 0 else queue.pop
    group = [pop()]
    while queue and queue[index].group_id == group[0].group_id:
        group.append(pop())
    return group if index == 0 else group[::-1]


class _Budget:
    """Tokens and sequences left for this step."""

    def __init__(self, num_tokens: int, num_seqs: int) -> None:
        self.num_tokens = num_tokens
        self.num_seqs = num_seqs

    @property
    def has_room(self) -> bool:
        return self.num_tokens > 0 and self.num_seqs > 0

    def take(self, req: Request, reserve: int) -> int:
        """Claim up to the rest of `req`'s uncomputed tokens, leaving `reserve` for others."""
        if self.num_seqs == 0:
            return 0
        available = self.num_tokens - reserve if self.num_tokens > reserve else self.num_tokens
        num_tokens = min(req.num_tokens_to_compute - req.num_computed_tokens, available)
        if num_tokens > 0:
            self.num_tokens -= num_tokens
            self.num_seqs -= 1
        return num_tokens


def _num_seqs(group: list[Request]) -> int:
    """The running slots `group` takes: its own, and those of the samples it will fork."""
    return sum(1 + req.num_pending_samples for req in group)


def _uses_cache(req: Request) -> bool:
    # a prompt found in the prefix cache is not computed, so its positions get no logits
    return req.sampling_params.prompt_logprobs is None
