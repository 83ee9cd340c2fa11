"""LLMEngine: the synchronous step (schedule, execute, update) over one model and its KV cache."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from asyncengine.config import EngineArgs, EngineConfig
from asyncengine.core.block_manager import BlockSpaceManager
from asyncengine.core.request import Request, RequestStatus, sample_request_id
from asyncengine.core.scheduler import Scheduler, SchedulerOutput
from asyncengine.engine.detokenizer import make_decode
from asyncengine.engine.output_processor import RequestState
from asyncengine.errors import DuplicateRequestError, InvalidRequestError
from asyncengine.logging import get_logger
from asyncengine.outputs import RequestOutput
from asyncengine.sampling_params import SamplingParams
from asyncengine.worker import kv_sizing
from asyncengine.worker.model_runner import ModelRunner, ModelRunnerOutput

logger = get_logger(__name__)

# preemptions are logged at the first, then at most this often (with the count in between)
PREEMPTION_WARNING_INTERVAL_S = 10.0


class ModelRunnerLike(Protocol):
    def determine_num_blocks(self) -> tuple[int, int]: ...

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None: ...

    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput: ...


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


class LLMEngine:
    """Adds requests, steps them and returns their outputs. Not thread-safe; one caller."""

    def __init__(self, config: EngineConfig, model_runner: ModelRunnerLike | None = None) -> None:
        """`model_runner` replaces the real one (tests and overhead benchmarks use a fake)."""
        from transformers import AutoTokenizer

        self.config = config
        model_config = config.model_config
        self.tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer)
        self._decode = make_decode(self.tokenizer)
        self.eos_token_ids = _eos_token_ids(self.tokenizer, model_config.hf_config)
        self.vocab_size = int(model_config.hf_config.vocab_size)
        for warning in kv_sizing.practice_warnings(config):
            logger.warning("config_warning", **warning)
        self.model_runner = model_runner or ModelRunner(config)
        num_gpu_blocks, num_cpu_blocks = self.model_runner.determine_num_blocks()
        self.model_runner.initialize_cache(num_gpu_blocks, num_cpu_blocks)
        cache = config.cache_config
        self.block_manager = BlockSpaceManager(
            cache.block_size,
            num_gpu_blocks,
            num_cpu_blocks,
            sliding_window=cache.sliding_window,
            enable_caching=cache.enable_prefix_caching,
        )
        self.scheduler = Scheduler(config.scheduler_config, self.block_manager)
        self._states: dict[str, RequestState] = {}
        self._last_preemption_warning = -math.inf
        self._num_preempted_unreported = 0
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
    ) -> Request:
        """Validate and queue a request; bad input raises `InvalidRequestError` naming the field."""
        if request_id in self._states:
            raise DuplicateRequestError(f"request_id {request_id!r} is already in flight")
        prompt_token_ids = self.tokenize(prompt)
        max_len = self.config.model_config.max_model_len
        if len(prompt_token_ids) > max_len:
            raise InvalidRequestError(
                f"prompt is {len(prompt_token_ids)} tokens, longer than max_model_len ({max_len})"
            )
        max_num_seqs = self.config.scheduler_config.max_num_seqs
        if sampling_params.n > max_num_seqs:
            raise InvalidRequestError(
                f"n ({sampling_params.n}) exceeds max_num_seqs ({max_num_seqs}): the samples "
                "run at once, one sequence each"
            )
        req = Request(
            request_id,
            prompt_token_ids,
            sampling_params,
            self.eos_token_ids,
            priority,
            arrival_time,
            cache_salt,
        )
        self.scheduler.add_request(req)
        self._states[request_id] = RequestState(
            req, prompt if isinstance(prompt, str) else None, self._decode
        )
        return req

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            # checked before encoding: a tokenizer that adds BOS never returns nothing
            token_ids = list(self.tokenizer.encode(prompt)) if prompt else []
        else:
            token_ids = list(prompt)
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}"
                )
        if not token_ids:
            raise InvalidRequestError("prompt is empty")
        return token_ids

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Abort requests (every sample) in any state; idempotent; returns their final outputs."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for request_id in ids:
            state = self._states.pop(request_id, None)
            if state is None:
                continue
            for index in range(state.parent.sampling_params.n):
                self.scheduler.abort_request(sample_request_id(request_id, index))
            outputs.append(state.make_output())
        return outputs

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self._states

    def request_phase(self, request_id: str) -> str | None:
        """ "queued", "prefill", "decode" or "preempted"; None when not in flight."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return None
        if req.status is RequestStatus.SWAPPED or (
            req.status is RequestStatus.WAITING and req.num_preemptions
        ):
            return "preempted"
        if req.status is RequestStatus.WAITING:
            return "queued"
        return "prefill" if req.num_computed_tokens < req.num_prompt_tokens else "decode"

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, execute, update."""
        plan = self.schedule()
        return self.update(plan, self.execute(plan))

    def schedule(self) -> SchedulerOutput:
        plan = self.scheduler.schedule()
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
        return self.model_runner.execute_model(plan)

    def update(self, plan: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestOutput]:
        """Apply sampled tokens, detokenize, check stops; return outputs of changed requests."""
        changed: dict[str, RequestState] = {}
        for req in plan.rejected:
            changed[req.group_id] = self._states[req.group_id]
        for req in self.scheduler.update_from_output(plan, result.sampled_token_ids):
            state = self._states[req.group_id]
            state.on_token(req, result.logprobs.get(req.request_id), self.scheduler.finish_request)
            changed[req.group_id] = state
        outputs = []
        for request_id, state in changed.items():
            outputs.append(state.make_output())
            if state.is_finished:
                del self._states[request_id]
        return outputs

    # -- introspection -----------------------------------------------------------------------

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
        )


def _eos_token_ids(tokenizer: Any, hf_config: Any) -> tuple[int, ...]:
    """Every id that ends generation: the tokenizer's eos and the config's (one or a list)."""
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(hf_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(int(i) for i in source)
    return tuple(sorted(ids))
