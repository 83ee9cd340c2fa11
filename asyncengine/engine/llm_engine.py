"""LLMEngine: the synchronous step (schedule, execute, update) over one model and its KV cache."""

from __future__ import annotations

import atexit
import gc
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from asyncengine.config import EngineArgs, EngineConfig
from asyncengine.core.block_manager import BlockSpaceManager
from asyncengine.core.kv_events import KvEvent
from asyncengine.core.request import FinishReason, Request, RequestStatus, new_request_id
from asyncengine.core.scheduler import Scheduler, SchedulerOutput
from asyncengine.engine.detokenizer import make_decode, make_detokenizer
from asyncengine.engine.grammar_compiles import GrammarCompiles
from asyncengine.engine.output_processor import RequestState, TokenTexts
from asyncengine.engine.structured_output import CompiledConstraint, StructuredOutputManager
from asyncengine.engine.validator import RequestValidator, ValidatedRequest
from asyncengine.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    LoRAInUseError,
    LoRANotFoundError,
)
from asyncengine.logging import get_logger
from asyncengine.lora.registry import LoRARegistry
from asyncengine.lora.request import LoRARequest
from asyncengine.outputs import RawLogprobs, RequestOutput
from asyncengine.sampling_params import SamplingParams
from asyncengine.worker import kv_sizing
from asyncengine.worker.model_runner import ModelRunner, ModelRunnerOutput
from asyncengine.worker.sampler import Grammars

logger = get_logger(__name__)

# preemptions are logged at the first, then at most this often (with the count in between)
PREEMPTION_WARNING_INTERVAL_S = 10.0
# an empty step while adapters are read waits this long at most for one to end
LORA_READ_WAIT_S = 0.05


class ModelRunnerLike(Protocol):
    def determine_num_blocks(self) -> tuple[int, int]: ...

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None: ...

    def execute_model(
        self, plan: SchedulerOutput, grammars: Grammars | None = None
    ) -> ModelRunnerOutput: ...


@dataclass
class EngineStats:
    """A snapshot of load and cache figures (what operators watch)."""

    num_running: int
    num_waiting: int
    num_swapped: int
    gpu_block_usage: float
    cpu_block_usage: float
    num_gpu_blocks: int
    num_cpu_blocks: int
    num_free_gpu_blocks: int
    num_free_cpu_blocks: int
    num_preemptions_swap: int
    num_preemptions_recompute: int
    num_prefix_cache_queries: int  # prompt tokens looked up
    num_prefix_cache_hits: int  # of those, found cached
    # structured outputs: the compiled-grammar cache, and the compile pool's counters
    num_cached_grammars: int = 0
    grammar_cache_bytes: int = 0
    grammar_compile_busy_s: float = 0.0  # every compile's time, whether its caller stayed
    num_grammar_compiles_dropped: int = 0  # the caller left before it started
    num_grammar_compile_timeouts: int = 0  # the caller was told it ran past the limit
    num_waiting_prompt_tokens: int = 0  # tokens of waiting requests still to compute
    # LoRA: adapters in device slots and in host memory, slot loads and evictions so far,
    # and the running and waiting requests of each adapter, by name
    num_active_loras: int = 0
    num_cached_loras: int = 0
    num_lora_loads: int = 0
    num_lora_evictions: int = 0
    num_lora_host_evictions: int = 0  # host copies dropped past max_cpu_loras
    num_lora_disk_reads: int = 0  # adapters read from disk: registrations and re-reads
    lora_running: dict[str, int] = field(default_factory=dict)
    lora_requests_total: dict[str, int] = field(default_factory=dict)  # admitted, by name
    lora_waiting: dict[str, int] = field(default_factory=dict)
    # speculative decoding (vLLM's spec_decode counters), when it is on: the proposer, draft
    # runs, draft tokens, accepted ones, and accepted ones by position in their run
    spec_method: str | None = None
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_spec_accepted_per_position: list[int] = field(default_factory=list)


def _num_new_tokens(request_id: str, result: ModelRunnerOutput) -> int:
    """The tokens a request got this step: its accepted drafts, then the sampled one."""
    spec = result.spec_results.get(request_id)
    return 1 if spec is None else 1 + len(spec.accepted_token_ids)


def _no_logprobs(request_id: str) -> None:
    return None


def _logprobs_of(result: ModelRunnerOutput) -> Callable[[str], list[RawLogprobs] | None]:
    """A request's logprobs this step, one per new token (accepted drafts first)."""

    def of(request_id: str) -> list[RawLogprobs] | None:
        last = result.logprobs.get(request_id)
        if last is None:
            return None
        return [*result.spec_logprobs.get(request_id, ()), last]

    return of


def freeze_heap() -> None:
    """Keep the collector's full passes off what start-up built.

    torch, transformers and the model are millions of long-lived objects; each full collection
    walked them all (~200 ms on a CPU, every few seconds under load: a stall of every stream).
    Collected once, then frozen (as vLLM does after start-up), they are never walked again;
    what the steps allocate is still collected. `gc.unfreeze()` undoes it, for a program that
    builds and drops many engines.
    """
    gc.collect()
    gc.freeze()
    # at exit the interpreter's last collection should see them again (extension modules
    # such as triton's report objects still alive then as leaks)
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)


class LLMEngine:
    """Adds requests, steps them and returns their outputs. Not thread-safe; one caller."""

    def __init__(self, config: EngineConfig, model_runner: ModelRunnerLike | None = None) -> None:
        """`model_runner` replaces the real one (tests and overhead benchmarks use a fake)."""
        from transformers import AutoTokenizer

        self.config = config
        model_config = config.model_config
        self.tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer)
        self._new_detokenizer = make_detokenizer(self.tokenizer)
        self._token_texts = TokenTexts(make_decode(self.tokenizer))
        self.eos_token_ids = _eos_token_ids(self.tokenizer, model_config.hf_config)
        self.vocab_size = int(model_config.hf_config.vocab_size)
        for warning in kv_sizing.practice_warnings(config):
            logger.warning("config_warning", **warning)
        self.model_runner = model_runner or _default_runner(config)
        num_gpu_blocks, num_cpu_blocks = self.model_runner.determine_num_blocks()
        self.model_runner.initialize_cache(num_gpu_blocks, num_cpu_blocks)
        cache = config.cache_config
        self.block_manager = BlockSpaceManager(
            cache.block_size,
            num_gpu_blocks,
            num_cpu_blocks,
            sliding_window=cache.sliding_window,
            enable_caching=cache.enable_prefix_caching,
            enable_kv_events=cache.enable_kv_events,
        )
        self.loras = None if config.lora_config is None else LoRARegistry(
            config.lora_config, model_config.hf_config, _torch_dtype(model_config.dtype)
        )  # fmt: skip
        self.scheduler = Scheduler(
            config.scheduler_config, self.block_manager, self.loras, config.speculative_config
        )
        grammar_config = config.structured_outputs_config
        self.structured = StructuredOutputManager(
            self.tokenizer, self.vocab_size, self.eos_token_ids, grammar_config.max_cache_bytes
        )
        self.validator = RequestValidator(
            config, self.vocab_size, num_gpu_blocks, grammars=self.structured
        )
        # where the core clients compile each constrained request's grammar, off the step
        self.grammar_compiles = GrammarCompiles(self.validator, grammar_config)
        # one state per caller's request, found by the caller's id or by its engine group id
        self._states: dict[str, RequestState] = {}
        self._groups: dict[str, RequestState] = {}
        self._num_lora_requests: Counter[str] = Counter()  # admitted, by adapter name
        self._last_preemption_warning = -math.inf
        self._num_preempted_unreported = 0
        freeze_heap()
        logger.info(
            "engine_started",
            model=model_config.model,
            architecture=model_config.architecture,
            dtype=model_config.dtype,
            device=config.device_config.device,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks,
            block_size=cache.block_size,
            max_model_len=model_config.max_model_len,
        )

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    # -- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate, tokenize and queue a request; bad input raises `InvalidRequestError`
        naming the field. `request_id` is the caller's: a key for abort and outputs only.
        An adapter (`lora_request`) not registered yet is registered first (read from disk)."""
        if request_id in self._states:
            raise DuplicateRequestError(request_id)
        self.validator.check_inputs(request_id, prompt, sampling_params, cache_salt, priority)
        if lora_request is not None:
            self.add_lora(lora_request)
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        validated = self.validator.check_tokens(
            request_id, prompt, token_ids, sampling_params, priority, cache_salt
        )
        self.add_validated_request(replace(validated, lora_request=lora_request), arrival_time)

    def add_validated_request(
        self,
        validated: ValidatedRequest,
        arrival_time: float | None = None,
        constraint: CompiledConstraint | None = None,
    ) -> None:
        """Queue a request the validator passed (the async engine tokenizes off its loop, and
        compiles its structured-outputs constraint there: `constraint`; compiled here if not)."""
        if validated.request_id in self._states:
            raise DuplicateRequestError(validated.request_id)
        lora_int_id = self._registered_lora_id(validated.lora_request)
        if validated.lora_request is not None:
            self._num_lora_requests[validated.lora_request.lora_name] += 1
        if constraint is None:
            constraint = self.validator.check_structured_outputs(validated.sampling_params)
        req = Request(
            new_request_id(),
            validated.prompt_token_ids,
            validated.sampling_params,
            self.eos_token_ids,
            validated.priority,
            arrival_time,
            validated.cache_salt,
            lora_int_id,
        )
        if constraint is not None:
            self.structured.add(req.group_id, constraint)
        self.scheduler.add_request(req)
        state = RequestState(
            validated.request_id, req, validated.prompt, self._new_detokenizer, self._token_texts
        )
        self._states[validated.request_id] = state
        self._groups[req.group_id] = state

    def _registered_lora_id(self, lora_request: LoRARequest | None) -> int:
        if lora_request is None:
            return 0
        registered = self._lora_registry().requests.get(lora_request.lora_int_id)
        if registered != lora_request:
            raise LoRANotFoundError(lora_request.lora_name)
        return lora_request.lora_int_id

    # -- LoRA adapters -----------------------------------------------------------------------

    def _lora_registry(self) -> LoRARegistry:
        if self.loras is None:
            raise InvalidRequestError(
                "lora_request", "LoRA adapters are not enabled (start with enable_lora)"
            )
        return self.loras

    def read_lora(self, lora_request: LoRARequest) -> Future[Any]:
        """Read and check an adapter in a thread of its own (the core clients pass what it
        gives to `add_lora`, so the step never reads a disk)."""
        return self._lora_registry().read_in_background(lora_request)

    def is_lora_registered(self, lora_request: LoRARequest) -> bool:
        return self.loras is not None and self.loras.is_registered(lora_request)

    def add_lora(self, lora_request: LoRARequest, weights: Any = None) -> bool:
        """Register an adapter, reading it from disk unless `weights` (its `LoRAWeights`)
        are given; False if it is registered already. A bad adapter raises
        `InvalidRequestError` naming `lora_request...`."""
        return self._lora_registry().add(lora_request, weights)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; `LoRAInUseError` while requests use it."""
        registry = self._lora_registry()
        if lora_int_id not in registry.requests:
            raise LoRANotFoundError(lora_int_id)
        num_using = sum(
            1 for req in self.scheduler.requests.values() if req.lora_int_id == lora_int_id
        )
        if num_using:
            raise LoRAInUseError(lora_int_id, num_using)
        registry.remove(lora_int_id)
        return True

    def list_loras(self) -> set[int]:
        return set() if self.loras is None else self.loras.ids()

    def lora_requests(self) -> dict[str, LoRARequest]:
        """The registered adapters by name."""
        if self.loras is None:
            return {}
        return {req.lora_name: req for req in self.loras.requests.values()}

    def tokenize(self, text: str) -> list[int]:
        return encode_prompt(self.tokenizer, text)

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Abort requests (every sample) in any state; idempotent; returns their final outputs."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for request_id in ids:
            state = self._states.get(request_id)
            if state is None:
                continue
            self.scheduler.finish_group(state.group_id, FinishReason.ABORTED)
            state.is_ended = True  # samples forked but without a token yet end with it
            outputs.append(self._final_output(state))
        return outputs

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self._states

    def in_flight_ids(self) -> list[str]:
        """The callers' ids of every request in the engine."""
        return list(self._states)

    @property
    def num_requests(self) -> int:
        """Callers' requests in the engine: waiting, running or swapped (samples count once)."""
        return len(self._states)

    def request_phase(self, request_id: str) -> str | None:
        """ "queued", "prefill", "decode" or "preempted"; None when not in flight."""
        state = self._states.get(request_id)
        if state is None:
            return None
        req = state.parent
        if req.status is RequestStatus.SWAPPED or (
            req.status is RequestStatus.WAITING and req.num_preemptions
        ):
            return "preempted"
        if req.status is RequestStatus.WAITING:
            return "queued"
        return "prefill" if req.num_computed_tokens < req.num_prompt_tokens else "decode"

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, if no request holds a block; whether it did."""
        return self.block_manager.reset_prefix_cache()

    def take_kv_events(self) -> list[KvEvent]:
        """The prefix cache's events since the last call (see core/kv_events.py)."""
        return self.block_manager.take_kv_events()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def check_health(self) -> None:
        """Raise if the model can no longer run (a tensor-parallel rank failed)."""
        check = getattr(self.model_runner, "check_health", None)
        if check is not None:
            check()

    def shutdown(self) -> None:
        """Stop the model runner's processes (tensor-parallel workers) and drop the queued
        grammar compiles; idempotent."""
        self.grammar_compiles.shutdown()
        if self.loras is not None:
            self.loras.shutdown()
        shutdown = getattr(self.model_runner, "shutdown", None)
        if shutdown is not None:
            shutdown()

    # -- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, execute, update."""
        plan = self.schedule()
        return self.update(plan, self.execute(plan))

    def schedule(self) -> SchedulerOutput:
        plan = self.scheduler.schedule()
        if self.loras is not None:
            self.loras.assign_slots(plan, self.scheduler.running_loras())
        self.structured.prepare(plan.scheduled)
        if plan.preempted:
            self._warn_of_preemptions(plan)
        return plan

    def _warn_of_preemptions(self, plan: SchedulerOutput) -> None:
        """Say that the cache is too small for the load: at the first preemption, then at most
        every PREEMPTION_WARNING_INTERVAL_S with the count since the last warning."""
        self._num_preempted_unreported += len(plan.preempted)
        now = time.monotonic()
        if now - self._last_preemption_warning < PREEMPTION_WARNING_INTERVAL_S:
            return
        stats = self.get_stats()
        logger.warning(
            "requests_preempted",
            num_preempted=self._num_preempted_unreported,
            request_ids=[req.request_id for req in plan.preempted[:8]],
            total_swap=stats.num_preemptions_swap,
            total_recompute=stats.num_preemptions_recompute,
            gpu_block_usage=round(stats.gpu_block_usage, 3),
            advice="the KV cache is too small for this load: add replicas, lower "
            "max_num_seqs, or give the cache more memory (gpu_memory_utilization)",
        )
        self._last_preemption_warning = now
        self._num_preempted_unreported = 0

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        if plan.is_empty and self.loras is not None:
            # what waits may wait for an adapter read: wait for one, not spin on empty steps
            self.loras.wait_for_reads(LORA_READ_WAIT_S)
        structured = self.structured
        return self.model_runner.execute_model(
            plan, structured if structured.has_requests else None
        )

    def update(self, plan: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestOutput]:
        """Apply sampled tokens, detokenize, check stops; return outputs of changed requests.

        A failure that belongs to one request (its sampling, its stops, its text) ends that
        request with FinishReason.ERROR; the others go on.
        """
        # a request aborted while the step ran has no state left, and gets no output
        changed: dict[str, RequestState] = {}
        for req in plan.rejected:
            if (state := self._groups.get(req.group_id)) is not None:
                changed[req.group_id] = state
        if result.failures or result.prompt_logprobs:  # most steps have neither
            self._take_failures_and_prompt_logprobs(plan, result, changed)
        structured, finish = self.structured, self.scheduler.finish_request
        any_constrained = structured.has_requests
        logprobs_of = _logprobs_of(result) if result.logprobs else _no_logprobs
        updated = self.scheduler.update_from_output(
            plan, result.sampled_token_ids, result.spec_results
        )
        for req in updated:
            state = self._groups[req.group_id]
            changed[req.group_id] = state
            if any_constrained:
                try:
                    # a grammar that has ended ends its sample, even under min_tokens or
                    # ignore_eos
                    is_constrained = structured.is_constrained(req) and not req.is_finished
                    num_new = _num_new_tokens(req.request_id, result)
                    if is_constrained and structured.accept(req, num_new):
                        finish(req, FinishReason.EOS)
                except Exception as exc:
                    self._fail(state, "structured output", repr(exc))
                    continue
            try:
                state.on_token(req, logprobs_of(req.request_id), finish)
            except Exception as exc:
                self._fail(state, "detokenizing or stop checks", repr(exc))
        outputs = []
        for state in changed.values():
            out = state.make_output()
            if out is None:
                continue
            if out.finished:
                self._forget(state)
            outputs.append(out)
        return outputs

    def _take_failures_and_prompt_logprobs(
        self, plan: SchedulerOutput, result: ModelRunnerOutput, changed: dict[str, RequestState]
    ) -> None:
        for req in plan.scheduled:
            failure = result.failures.get(req.request_id)
            if failure is not None and (state := self._groups.get(req.group_id)) is not None:
                self._fail(state, "sampling", failure)
                changed[req.group_id] = state
            scored = result.prompt_logprobs.get(req.request_id)
            if scored is not None and (state := self._groups.get(req.group_id)) is not None:
                state.on_prompt_logprobs(*scored)

    def _fail(self, state: RequestState, stage: str, cause: str) -> None:
        """End one request with an error: the cause is logged, never sent to its caller."""
        logger.error("request_failed", request_id=state.request_id, stage=stage, cause=cause)
        state.parent.error = f"the request failed in {stage} (an engine bug; see the server log)"
        self.scheduler.finish_group(state.group_id, FinishReason.ERROR)
        state.is_ended = True

    def _final_output(self, state: RequestState) -> RequestOutput:
        """The request's last output; the engine forgets it."""
        out = state.make_output()
        assert out is not None and out.finished
        self._forget(state)
        return out

    def _forget(self, state: RequestState) -> None:
        del self._states[state.request_id]
        del self._groups[state.group_id]
        self.structured.release(state.group_id)

    # -- introspection -----------------------------------------------------------------------

    def check_every_block_came_back(self) -> None:
        """With no request left, every KV block must be free (cached ones count as free).

        A block still held is a bookkeeping bug that would shrink the cache for good: say so
        loudly rather than hide it (the check is two counts, so it runs at every idle moment).
        """
        stats = self.get_stats()
        held_gpu = stats.num_gpu_blocks - stats.num_free_gpu_blocks
        held_cpu = stats.num_cpu_blocks - stats.num_free_cpu_blocks
        if held_gpu or held_cpu:
            logger.error("kv_blocks_leaked", gpu_blocks=held_gpu, cpu_blocks=held_cpu)

    def get_stats(self) -> EngineStats:
        bm, sched = self.block_manager, self.scheduler
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_swapped=len(sched.swapped),
            gpu_block_usage=bm.usage(),
            cpu_block_usage=bm.cpu_usage(),
            num_gpu_blocks=bm.num_gpu_blocks,
            num_cpu_blocks=bm.num_cpu_blocks,
            num_free_gpu_blocks=bm.get_num_free_gpu_blocks(),
            num_free_cpu_blocks=bm.get_num_free_cpu_blocks(),
            num_preemptions_swap=sched.num_preemptions["swap"],
            num_preemptions_recompute=sched.num_preemptions["recompute"],
            num_prefix_cache_queries=bm.num_cache_queries,
            num_prefix_cache_hits=bm.num_cache_hits,
            num_cached_grammars=self.structured.num_cached,
            grammar_cache_bytes=self.structured.cache_bytes,
            grammar_compile_busy_s=self.grammar_compiles.busy_s,
            num_grammar_compiles_dropped=self.grammar_compiles.num_dropped,
            num_grammar_compile_timeouts=self.grammar_compiles.num_timed_out,
            num_waiting_prompt_tokens=sum(
                req.num_tokens - req.num_computed_tokens for req in sched.waiting
            ),
            **self._lora_stats(),
            **self._spec_stats(),
        )

    def _lora_stats(self) -> dict[str, Any]:
        loras = self.loras
        if loras is None:
            return {}
        names = {i: req.lora_name for i, req in loras.requests.items()}
        sched = self.scheduler
        return {
            "num_active_loras": loras.num_resident,
            "num_cached_loras": loras.num_cached,
            "num_lora_loads": loras.num_loads,
            "num_lora_evictions": loras.num_evictions,
            "num_lora_host_evictions": loras.num_host_evictions,
            "num_lora_disk_reads": loras.num_disk_loads,
            "lora_running": _count_by_name(sched.running, names),
            "lora_requests_total": dict(self._num_lora_requests),
            "lora_waiting": _count_by_name([*sched.waiting, *sched.swapped], names),
        }

    def _spec_stats(self) -> dict[str, Any]:
        if self.scheduler.spec is None:
            return {}
        stats = self.scheduler.spec.stats
        return {
            "spec_method": stats.method,
            "num_spec_drafts": stats.num_drafts,
            "num_spec_draft_tokens": stats.num_draft_tokens,
            "num_spec_accepted_tokens": stats.num_accepted_tokens,
            "num_spec_accepted_per_position": list(stats.num_accepted_per_position),
        }


def _default_runner(config: EngineConfig) -> ModelRunnerLike:
    """One device: the model runner itself; N ranks: the driver of N-1 worker processes."""
    if config.parallel_config.tensor_parallel_size == 1:
        return ModelRunner(config)
    from asyncengine.distributed.executor import TensorParallelExecutor

    return TensorParallelExecutor(config)


def _count_by_name(reqs: Iterable[Request], names: dict[int, str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for req in reqs:
        if req.lora_int_id in names:
            name = names[req.lora_int_id]
            counts[name] = counts.get(name, 0) + 1
    return counts


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """A prompt's token ids (with the tokenizer's special tokens, as prompts get them)."""
    # checked before encoding: a tokenizer that adds BOS never returns nothing
    return list(tokenizer.encode(text)) if text else []


def _eos_token_ids(tokenizer: Any, hf_config: Any) -> tuple[int, ...]:
    """Every id that ends generation: the tokenizer's eos and the config's (one or a list)."""
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(hf_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(int(i) for i in source)
    return tuple(sorted(ids))
