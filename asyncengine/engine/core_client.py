"""The seam under `AsyncLLMEngine`: a core client steps the engine here or in a process of its own.

`AsyncLLMEngine` (the streams, the front door) is written once over `EngineCoreClient`;
the two clients differ only in where `LLMEngine` steps:

- `InprocClient`: on this event loop, the forward in a worker thread (library users, LLM).
- `MPClient` (engine/mp_client.py): in a child process behind ZMQ sockets (`serve`).

Requests reach a core by the core's own id (`AsyncLLMEngine` makes one per request), so a
caller's id can be reused at once after an abort without the core ever seeing two of them.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from asyncengine.config import EngineConfig
from asyncengine.core.kv_events import KvEvent
from asyncengine.engine.llm_engine import EngineStats, LLMEngine
from asyncengine.engine.messages import StepStats
from asyncengine.engine.validator import RequestValidator, ValidatedRequest
from asyncengine.logging import get_logger
from asyncengine.lora.request import LoRARequest
from asyncengine.outputs import RequestOutput

logger = get_logger(__name__)
A = TypeVar("A")
R = TypeVar("R")


class EngineFront(Protocol):
    """What the front door reads of the engine: its config, tokenizer and validator."""

    config: EngineConfig
    tokenizer: Any
    validator: RequestValidator
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    def tokenize(self, text: str) -> list[int]: ...


class OutputSink(Protocol):
    """Where a core client delivers (AsyncLLMEngine); every call runs on the event loop."""

    def on_outputs(self, outputs: list[RequestOutput], steps: Sequence[StepStats]) -> None:
        """The outputs of one step or more (`steps` their figures, in order), or the finals
        of aborted requests (no steps)."""

    def on_dead(self, cause: BaseException) -> None:
        """The core can no longer step: every stream must be told."""

    def on_kv_events(self, events: list[KvEvent]) -> None:
        """A step's prefix-cache events (never empty), after that step's outputs."""


@dataclass(frozen=True)
class Queued:
    """A request the core took; for a constrained one, its grammar's kind and compile time
    (None: it came from the cache)."""

    constraint_kind: str | None = None
    compile_s: float | None = None


class EngineCoreClient(Protocol):
    """What `AsyncLLMEngine` needs of the core, wherever it steps."""

    front: EngineFront

    def start(self, sink: OutputSink) -> None:
        """Deliver to `sink` on the running event loop (again on a new loop)."""

    async def add_request(self, request: ValidatedRequest) -> Queued | None:
        """Queue `request` (its id the core's); a constrained one returns once its grammar
        compiled (`InvalidRequestError` naming the field if it does not). None: aborted
        meanwhile. Raises `EngineDeadError` when the core is gone."""

    def abort(self, request_ids: list[str]) -> asyncio.Future[list[str]]:
        """Abort by core id, at once; each one's final output reaches the sink. The future
        gives the ids the core aborted (not those that had finished first)."""

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter, read off the step; False if it already is. A bad adapter
        raises `InvalidRequestError` naming `lora_request...`."""

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter: `LoRANotFoundError`, `LoRAInUseError` if it cannot."""

    async def list_loras(self) -> set[int]: ...

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix if no request holds a block (its CLEARED event reaches
        the sink first); whether it did."""

    def get_stats(self) -> EngineStats: ...

    def request_phase(self, request_id: str) -> str | None: ...

    def check_health(self) -> None:
        """Raise if the core can no longer serve (a dead process, a failed rank)."""

    async def shutdown(self) -> None:
        """Stop stepping (after the step in flight) and release the core."""


class InprocClient:
    """Steps an `LLMEngine` on this event loop: schedule and update here, the forward (and the
    block moves before it) in one worker thread, so the loop streams meanwhile."""

    def __init__(self, engine: LLMEngine, step_timeout_s: float = 300.0) -> None:
        self.engine = engine
        self.front: EngineFront = engine
        self.step_timeout_s = step_timeout_s
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncengine-step")
        # constrained requests whose grammar compiles, by core id, and the waits on them
        self._compiling: dict[str, tuple[ValidatedRequest, asyncio.Future[Any]]] = {}
        self._sink: OutputSink | None = None
        self._has_work: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self, sink: OutputSink) -> None:
        if self._task is not None and not self._task.done():
            return
        self._sink = sink
        self._has_work = asyncio.Event()
        # an empty context: the loop must not carry its first caller's log context for good
        loop, context = asyncio.get_running_loop(), contextvars.Context()
        task = loop.create_task(self._run(), name="step-loop", context=context)
        task.add_done_callback(self._on_loop_done, context=context)
        self._task = task

    async def add_request(self, request: ValidatedRequest) -> Queued | None:
        constraint = None
        if request.sampling_params.structured_outputs is not None:
            # cancelling the wait (the caller left, or an abort) cancels the compile: dropped
            # if queued, its result discarded if running
            compile_ = self.engine.grammar_compiles.submit(request.sampling_params)
            waiting = asyncio.wrap_future(compile_)
            compiling = (request, waiting)
            self._compiling[request.request_id] = compiling
            try:
                constraint = await waiting
            except asyncio.CancelledError:
                if _is_cancelling():
                    raise
            finally:
                # by identity: once aborted, its id may be another request's already
                is_aborted = self._compiling.get(request.request_id) is not compiling
                if not is_aborted:
                    del self._compiling[request.request_id]
            if is_aborted:
                return None
        self.engine.add_validated_request(request, constraint=constraint)
        assert self._has_work is not None
        self._has_work.set()
        if constraint is None:
            return Queued()
        return Queued(constraint.kind, constraint.compile_s)

    def abort(self, request_ids: list[str]) -> asyncio.Future[list[str]]:
        finals = self.engine.abort_request(request_ids)
        for request_id in request_ids:
            compiling = self._compiling.pop(request_id, None)
            if compiling is not None:
                request, waiting = compiling
                waiting.cancel()
                finals.append(RequestOutput.aborted(request_id, request.sampling_params.n))
        if finals and self._sink is not None:
            self._sink.on_outputs(finals, ())
        done: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
        done.set_result([out.request_id for out in finals])
        return done

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        if self.engine.is_lora_registered(lora_request):
            return False
        weights = await asyncio.wrap_future(self.engine.read_lora(lora_request))
        return self.engine.add_lora(lora_request, weights)

    async def remove_lora(self, lora_int_id: int) -> bool:
        return self.engine.remove_lora(lora_int_id)

    async def list_loras(self) -> set[int]:
        return self.engine.list_loras()

    async def reset_prefix_cache(self) -> bool:
        # between steps (this runs on the loop), and only when no request holds a block
        is_reset = self.engine.reset_prefix_cache()
        if (events := self.engine.take_kv_events()) and self._sink is not None:
            self._sink.on_kv_events(events)
        return is_reset

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    def request_phase(self, request_id: str) -> str | None:
        return self.engine.request_phase(request_id)

    def check_health(self) -> None:
        self.engine.check_health()

    async def _run(self) -> None:
        engine, loop = self.engine, asyncio.get_running_loop()
        assert self._has_work is not None and self._sink is not None
        while True:
            if not engine.has_unfinished_requests():
                engine.check_every_block_came_back()
                self._has_work.clear()
                await self._has_work.wait()
                continue
            started = time.perf_counter()
            plan = engine.schedule()
            scheduled = time.perf_counter()
            # asyncio.timeout, not wait_for: a step that ends in the loop's turn that cancels
            # this task would win over the cancel in 3.11's wait_for, and shutdown would then
            # wait for a loop gone back to waiting for work
            async with asyncio.timeout(self.step_timeout_s):
                result, execute_s = await loop.run_in_executor(
                    self._executor, _timed, engine.execute, plan
                )
            executed = time.perf_counter()
            outputs = engine.update(plan, result)
            step = step_stats(plan, result, scheduled - started, execute_s, executed)
            self._sink.on_outputs(outputs, (step,))
            if events := engine.take_kv_events():
                self._sink.on_kv_events(events)
            # let the streams run before the next step; the step itself never awaits them
            await asyncio.sleep(0)

    def _on_loop_done(self, task: asyncio.Task[None]) -> None:
        assert self._sink is not None
        if task.cancelled():
            # the event loop ended under the engine (asyncio.run returned), or shutdown: no
            # failure. What was in flight is aborted; a later event loop may step again
            finals = self.engine.abort_request(self.engine.in_flight_ids())
            if finals:
                self._sink.on_outputs(finals, ())
            logger.debug("step_loop_stopped", reason="its event loop ended")
            return
        cause = task.exception()
        if isinstance(cause, asyncio.TimeoutError):
            cause = TimeoutError(f"a step took longer than {self.step_timeout_s} s")
        assert cause is not None
        self._sink.on_dead(cause)

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=False, cancel_futures=True)
        # tensor-parallel workers stop here (after the step in flight, if any, or it fails)
        await asyncio.to_thread(self.engine.shutdown)


def step_stats(
    plan: Any, result: Any, schedule_s: float, execute_s: float, executed: float
) -> StepStats:
    """The figures of one step that ran `plan` to `result` (update ending now)."""
    return StepStats(
        schedule_s=schedule_s,
        execute_s=execute_s,
        update_s=time.perf_counter() - executed,
        num_generated_tokens=len(result.sampled_token_ids)
        + sum(len(r.accepted_token_ids) for r in result.spec_results.values()),
        num_blocks_swapped_out=len(plan.blocks_to_swap_out),
        num_blocks_swapped_in=len(plan.blocks_to_swap_in),
    )


def _is_cancelling() -> bool:
    """Whether the running task itself is being cancelled (not only a future it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _timed(fn: Callable[[A], R], arg: A) -> tuple[R, float]:
    started = time.perf_counter()
    result = fn(arg)
    return result, time.perf_counter() - started
