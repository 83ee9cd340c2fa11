"""AsyncLLMEngine: one asyncio step loop serving many concurrent `async for` streams."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, TypeVar

from asyncengine.config import EngineArgs
from asyncengine.engine.llm_engine import EngineStats, LLMEngine
from asyncengine.errors import DuplicateRequestError, EngineDeadError, InvalidRequestError
from asyncengine.logging import get_logger
from asyncengine.outputs import RequestOutput
from asyncengine.sampling_params import SamplingParams

logger = get_logger(__name__)
A = TypeVar("A")
R = TypeVar("R")


@dataclass
class StepStats:
    """What one step took and moved, for an `EngineObserver`."""

    schedule_s: float
    execute_s: float  # block moves, forward and sampling, timed in the worker thread
    update_s: float  # token appends, stop checks, detokenization
    num_generated_tokens: int
    num_blocks_swapped_out: int
    num_blocks_swapped_in: int


class EngineObserver(Protocol):
    """Receives the loop's measurements (metrics). Both calls run on the loop: keep them cheap."""

    def on_step(self, stats: StepStats) -> None: ...

    def on_request_done(self, request_id: str, output: RequestOutput | None) -> None:
        """Once per request: its final output, or None when the engine died under it."""


class RequestOutputCollector:
    """The one pending output of a request, for its caller to take.

    Outputs are cumulative, so a newer one carries every token of an older one: when the caller
    is slow, a new output replaces the pending one instead of queueing behind it. The step loop
    never waits for a caller, and memory per stream stays bounded.
    """

    def __init__(self) -> None:
        self._pending: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if not isinstance(self._pending, BaseException):  # an error is never overwritten
            self._pending = item
        self._ready.set()

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        item, self._pending = self._pending, None
        self._ready.clear()
        if isinstance(item, BaseException):
            raise item
        assert item is not None
        return item


class AsyncLLMEngine:
    """Streams each request's outputs to its caller while one loop batches all of them.

    All scheduler state lives on the event loop's thread; only the forward (and the block
    moves before it) runs in a single worker thread, so the loop keeps streaming meanwhile.
    """

    def __init__(
        self,
        engine: LLMEngine,
        step_timeout_s: float = 300.0,
        observer: EngineObserver | None = None,
    ) -> None:
        self.engine = engine
        self.step_timeout_s = step_timeout_s
        self.observer = observer
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncengine-step")
        self._collectors: dict[str, RequestOutputCollector] = {}
        self._has_work: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._dead: EngineDeadError | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLMEngine:
        return cls(LLMEngine.from_engine_args(args))

    # -- state -------------------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    @property
    def errored(self) -> bool:
        return self._dead is not None

    def check_health(self) -> None:
        """Raise `EngineDeadError` if the engine can no longer serve."""
        if self._dead is not None:
            raise self._dead

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    def request_phase(self, request_id: str) -> str | None:
        """ "queued", "prefill", "decode" or "preempted"; None when not in flight."""
        return self.engine.request_phase(request_id)

    # -- requests ----------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative output after each step; the last has `finished=True`.

        Bad input raises `InvalidRequestError` here, before anything is queued. Leaving the
        loop early (break, cancellation, `aclose()`) aborts the request and frees its blocks.
        """
        self.check_health()
        self._start()
        if request_id in self._collectors:
            raise DuplicateRequestError(f"request_id {request_id!r} is already in flight")
        collector = RequestOutputCollector()
        self.engine.add_request(
            request_id, prompt, sampling_params, priority, cache_salt=cache_salt
        )
        self._collectors[request_id] = collector
        assert self._has_work is not None
        self._has_work.set()
        finished = False
        try:
            while not finished:
                out = await collector.get()
                finished = out.finished
                if out.error is not None:
                    raise InvalidRequestError(out.error)
                yield out
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request wherever it is; unknown or finished ids are a no-op.

        Its blocks are free when this returns (a step already running finishes without it).
        """
        final = self.engine.abort_request(request_id)
        collector = self._collectors.pop(request_id, None)
        if collector is not None and final:
            collector.put(final[0])
        if final and self.observer is not None:
            self.observer.on_request_done(request_id, final[0])

    # -- the loop ----------------------------------------------------------------------------

    def _start(self) -> None:
        if self.is_running:
            return
        self._has_work = asyncio.Event()
        self._loop_task = asyncio.get_running_loop().create_task(self._run(), name="step-loop")
        self._loop_task.add_done_callback(self._on_loop_done)

    async def _run(self) -> None:
        assert self._has_work is not None
        loop = asyncio.get_running_loop()
        while True:
            if not self.engine.has_unfinished_requests():
                self._check_every_block_came_back()
                self._has_work.clear()
                await self._has_work.wait()
                continue
            started = time.perf_counter()
            plan = self.engine.schedule()
            scheduled = time.perf_counter()
            result, execute_s = await asyncio.wait_for(
                loop.run_in_executor(self._executor, _timed, self.engine.execute, plan),
                self.step_timeout_s,
            )
            executed = time.perf_counter()
            outputs = self.engine.update(plan, result)
            stats = StepStats(
                schedule_s=scheduled - started,
                execute_s=execute_s,
                update_s=time.perf_counter() - executed,
                num_generated_tokens=len(result.sampled_token_ids),
                num_blocks_swapped_out=len(plan.blocks_to_swap_out),
                num_blocks_swapped_in=len(plan.blocks_to_swap_in),
            )
            self._deliver(outputs)
            if self.observer is not None:
                self.observer.on_step(stats)
            logger.debug("step", num_scheduled=len(plan.scheduled), **vars(stats))
            # let the streams run before the next step; the step itself never awaits them
            await asyncio.sleep(0)

    def _check_every_block_came_back(self) -> None:
        """With no request left, every KV block must be free (cached ones count as free).

        A block still held is a bookkeeping bug that would shrink the cache for good: say so
        loudly rather than hide it (the check is two counts, so it runs at every idle moment).
        """
        stats = self.engine.get_stats()
        held_gpu = stats.num_gpu_blocks - stats.num_free_gpu_blocks
        held_cpu = stats.num_cpu_blocks - stats.num_free_cpu_blocks
        if held_gpu or held_cpu:
            logger.error("kv_blocks_leaked", gpu_blocks=held_gpu, cpu_blocks=held_cpu)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            collector = self._collectors.get(out.request_id)
            if collector is None:
                continue
            collector.put(out)
            if out.finished:
                del self._collectors[out.request_id]
                if self.observer is not None:
                    self.observer.on_request_done(out.request_id, out)

    def _on_loop_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() and self._dead is not None:
            return
        cause = task.exception() if not task.cancelled() else None
        if isinstance(cause, asyncio.TimeoutError):
            cause = TimeoutError(f"a step took longer than {self.step_timeout_s} s")
        dead = EngineDeadError(f"the engine's step loop stopped: {cause!r}")
        dead.__cause__ = cause
        self._dead = dead
        logger.error("engine_dead", cause=repr(cause), open_streams=len(self._collectors))
        for request_id, collector in self._collectors.items():
            collector.put(dead)
            if self.observer is not None:
                self.observer.on_request_done(request_id, None)
        self._collectors.clear()

    async def shutdown(self) -> None:
        """Abort every request, end every stream, and stop the loop and the worker thread."""
        for request_id in list(self._collectors):
            self.abort(request_id)
        if self._dead is None:
            self._dead = EngineDeadError("the engine was shut down")
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self._executor.shutdown(wait=False, cancel_futures=True)


def _timed(fn: Callable[[A], R], arg: A) -> tuple[R, float]:
    started = time.perf_counter()
    result = fn(arg)
    return result, time.perf_counter() - started
