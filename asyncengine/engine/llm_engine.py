"""LLMEngine: the synchronous step (schedule, execute, update) over one model and its KV cache."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncengine.config import EngineArgs, EngineConfig
from asyncengine.core.block_manager import BlockSpaceManager
from asyncengine.core.request import Request, RequestStatus
from asyncengine.core.scheduler import Scheduler, SchedulerOutput
from asyncengine.engine.detokenizer import IncrementalDetokenizer, make_decode
from asyncengine.errors import DuplicateRequestError, InvalidRequestError
from asyncengine.logging import get_logger
from asyncengine.outputs import CompletionOutput, Logprobs, RequestMetrics, RequestOutput
from asyncengine.sampling_params import SamplingParams
from asyncengine.worker.model_runner import ModelRunner, ModelRunnerOutput

logger = get_logger(__name__)


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


@dataclass
class _RequestState:
    """Engine-side state of a request beyond what the scheduler tracks: its text."""

    prompt: str | None
    detokenizer: IncrementalDetokenizer
    text: str = ""
    logprobs: list[Logprobs] = field(default_factory=list)


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
        self._states: dict[str, _RequestState] = {}
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
        self._states[request_id] = _RequestState(
            prompt=prompt if isinstance(prompt, str) else None,
            detokenizer=IncrementalDetokenizer(
                self._decode, prompt_token_ids, sampling_params.skip_special_tokens
            ),
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
        """Abort requests in any state (idempotent); returns their final outputs."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for request_id in ids:
            req = self.scheduler.abort_request(request_id)
            state = self._states.pop(request_id, None)
            if req is not None and state is not None:
                outputs.append(self._make_output(req, state))
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
        return self.scheduler.schedule()

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(plan)

    def update(self, plan: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestOutput]:
        """Apply sampled tokens, detokenize, check stops; return outputs of changed requests."""
        outputs = []
        for req in plan.rejected:
            state = self._states.pop(req.request_id)
            outputs.append(self._make_output(req, state))
        for req in self.scheduler.update_from_output(plan, result.sampled_token_ids):
            state = self._states[req.request_id]
            if req.request_id in result.logprobs:
                state.logprobs.append(result.logprobs[req.request_id])
            self._detokenize(req, state)
            outputs.append(self._make_output(req, state))
            if req.is_finished:
                del self._states[req.request_id]
        return outputs

    def _detokenize(self, req: Request, state: _RequestState) -> None:
        delta = state.detokenizer.decode_next(req.token_ids, is_final=req.is_finished)
        state.text += delta
        params = req.sampling_params
        if not params.stop or req.num_output_tokens < params.min_tokens:
            return
        longest = max(len(s) for s in params.stop)
        start = max(0, len(state.text) - len(delta) - longest + 1)
        hits = [(i, s) for s in params.stop if (i := state.text.find(s, start)) != -1]
        if not hits:
            return
        index, stop = min(hits)
        state.text = state.text[: index + (len(stop) if params.include_stop_str_in_output else 0)]
        req.stop_reason = stop
        if req.is_finished:  # a stop string wins over a finish by length in the same step
            req.status = RequestStatus.FINISHED_STOPPED
        else:
            self.scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED)

    def _make_output(self, req: Request, state: _RequestState) -> RequestOutput:
        params = req.sampling_params
        text = state.text
        if params.stop and not req.is_finished:
            # hold back what may be the start of a stop string still being completed
            hold = max(len(s) for s in params.stop) - 1
            text = text[: max(0, len(text) - hold)]
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=req.output_token_ids,
            logprobs=list(state.logprobs) if params.logprobs is not None else None,
            finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=state.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=req.is_finished,
            error=req.error,
            metrics=RequestMetrics(
                arrival_time=req.arrival_time,
                first_scheduled_time=req.first_scheduled_time,
                first_token_time=req.first_token_time,
                finished_time=req.finished_time,
                num_preemptions=req.num_preemptions,
                num_cached_tokens=req.num_cached_tokens,
            ),
        )

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
