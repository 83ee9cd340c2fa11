"""AsyncLLMEngine: the one engine interface; one asyncio step loop serving many streams."""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from asyncengine.config import EngineArgs, EngineConfig
from asyncengine.core.request import FinishReason
from asyncengine.engine.llm_engine import EngineStats, LLMEngine
from asyncengine.engine.request_stream import RequestStream
from asyncengine.engine.validator import RequestValidator, ValidatedRequest
from asyncengine.errors import (
    DuplicateRequestError,
    EngineDeadError,
    InvalidRequestError,
    RequestFailedError,
)
from asyncengine.logging import get_logger
from asyncengine.outputs import CompletionOutput, RequestOutput
from asyncengine.sampling_params import RequestOutputKind, SamplingParams

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
    """Receives the loop's measurements (metrics). Every call runs on the loop: keep them cheap."""

    def on_step(self, stats: StepStats) -> None: ...

    def on_request_done(self, request_id: str, output: RequestOutput | None) -> None:
        """Once per request: its final output, or None when the engine died under it."""

    def on_structured_request(self, kind: str, compile_s: float | None) -> None:
        """Once per constrained request queued: its constraint's kind ("json", "regex", ...)
        and the seconds its grammar took to compile (None: it came from the cache)."""


class EngineFront(Protocol):
    """What the front door needs of the engine: its config, tokenizer and validator.

    `LLMEngine` is one; a step loop in another process leaves a copy here (process_engine).
    """

    config: EngineConfig
    tokenizer: Any
    validator: RequestValidator
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    def tokenize(self, text: str) -> list[int]: ...


class AsyncLLMEngine:
    """The one engine interface every front end uses (gRPC, HTTP, `async for` in-process).

    One loop batches every request and streams each its outputs. Scheduler state lives on
    the event loop's thread; the forward (and the block moves before it) runs in one worker
    thread and tokenizing in another, so the loop keeps streaming meanwhile. Front ends call
    the public methods here and never reach into `LLMEngine`, the scheduler or the cache.
    """

    def __init__(
        self,
        engine: LLMEngine,
        step_timeout_s: float = 300.0,
        observer: EngineObserver | None = None,
    ) -> None:
        self.engine = engine  # for tests and benchmarks; front ends use the methods below
        self._init_front(engine, step_timeout_s, observer)

    def _init_front(
        self, front: EngineFront, step_timeout_s: float, observer: EngineObserver | None
    ) -> None:
        """What every AsyncLLMEngine has, wherever its steps run."""
        self._front = front
        self.step_timeout_s = step_timeout_s
        self.observer = observer
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncengine-step")
        self._tokenizer_pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="asyncengine-tokenize"
        )
        # structured-outputs grammars compile here: a slow one holds up no prompt's tokenizing
        self._grammar_pool = ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="asyncengine-grammar"
        )
        # by the caller's id, from the moment a request is accepted until its final output
        self._streams: dict[str, RequestStream] = {}
        self._has_work: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._dead: EngineDeadError | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLMEngine:
        return cls(LLMEngine.from_engine_args(args))

    # -- what the engine is ------------------------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        return self._front.config

    @property
    def vocab_size(self) -> int:
        return self._front.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._front.eos_token_ids

    @property
    def max_model_len(self) -> int:
        return self._front.config.model_config.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self._front.config.scheduler_config.max_num_seqs

    @property
    def capacity_tokens(self) -> int:
        """Tokens the KV cache holds at once, all requests together."""
        return self._front.validator.cache_capacity

    def get_tokenizer(self) -> Any:
        """The Hugging Face tokenizer; `tokenize`/`detokenize` run it off the event loop."""
        return self._front.tokenizer

    # -- state -------------------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    @property
    def errored(self) -> bool:
        self._check_model()
        return self._dead is not None

    def check_health(self) -> None:
        """Raise `EngineDeadError` if the engine can no longer serve."""
        self._check_model()
        if self._dead is not None:
            raise self._dead

    def _check_model(self) -> None:
        """A tensor-parallel rank can fail while the loop is idle: the engine is dead then too."""
        if self._dead is None:
            try:
                self.engine.check_health()
            except Exception as exc:
                self._die(exc)

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    @property
    def num_requests(self) -> int:
        """Requests taken and not finished: being tokenized, waiting, running or swapped.

        What admission counts: a finished request whose caller has not read it is not work.
        """
        return len(self._streams)

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self._streams

    def request_phase(self, request_id: str) -> str | None:
        """ "queued", "prefill", "decode" or "preempted"; None when not in flight."""
        if request_id in self._streams and not self.engine.is_in_flight(request_id):
            return "queued"  # still being tokenized
        return self.engine.request_phase(request_id)

    # -- requests ----------------------------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        tenant: str | None = None,
        strict_max_tokens: bool = False,
    ) -> RequestStream:
        """Validate, tokenize (off the loop) and queue a request; returns its output stream.

        Bad input raises `InvalidRequestError` naming the field before anything is queued; an
        id in flight raises `DuplicateRequestError`. `tenant` keeps the caller's prefix cache
        apart from other tenants'; `strict_max_tokens` refuses a max_tokens past the context
        instead of capping it (`RequestValidator.check_tokens`). A caller that stops reading
        before the final output must `abort` the request.
        """
        self.check_health()
        self._start()
        if request_id in self._streams:
            raise DuplicateRequestError(request_id)
        validator = self._front.validator
        validator.check_inputs(request_id, prompt, sampling_params, cache_salt)
        stream = RequestStream(
            request_id,
            is_delta=sampling_params.output_kind is RequestOutputKind.DELTA,
            num_samples=sampling_params.n,
        )
        self._streams[request_id] = stream
        try:
            if isinstance(prompt, str):
                token_ids = await self._off_loop(self._front.tokenize, prompt)
            else:
                token_ids = list(prompt)
            if self._streams.get(request_id) is not stream:  # aborted while tokenizing
                return _aborted(stream, prompt, token_ids, sampling_params)
            validated = validator.check_tokens(
                request_id,
                prompt,
                token_ids,
                sampling_params,
                priority,
                cache_salt,
                tenant,
                strict_max_tokens,
            )
            stream.prompt, stream.prompt_token_ids = validated.prompt, validated.prompt_token_ids
            if not await self._queue(validated, stream):  # aborted while compiling
                return _aborted(stream, prompt, token_ids, sampling_params)
        except BaseException:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            raise
        return stream

    async def _queue(self, validated: ValidatedRequest, stream: RequestStream) -> bool:
        """Hand a validated request to the scheduler; False if it was aborted meanwhile.

        A constrained request waits here, off the loop and out of the scheduler, until its
        grammar is compiled; an invalid one raises InvalidRequestError naming it.
        """
        params, constraint = validated.sampling_params, None
        if params.structured_outputs is not None:
            constraint = await asyncio.get_running_loop().run_in_executor(
                self._grammar_pool, self.engine.validator.check_structured_outputs, params
            )
            if self._streams.get(validated.request_id) is not stream:
                return False
        self.check_health()
        self.engine.add_validated_request(validated, constraint=constraint)
        assert self._has_work is not None
        self._has_work.set()
        if constraint is not None and self.observer is not None:
            self.observer.on_structured_request(constraint.kind, constraint.compile_s)
        return True

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs, the last with `finished=True`: cumulative, or only
        what is new with `sampling_params.output_kind=DELTA`, or the final one alone.

        Bad input raises `InvalidRequestError` before anything is queued. Leaving the loop
        early (break, cancellation, `aclose()`) aborts the request and frees its blocks.
        """
        stream = await self.add_request(request_id, prompt, sampling_params, priority, cache_salt)
        try:
            while True:
                out = await stream.get()
                assert out is not None
                yield out
                if out.finished:
                    return
        finally:
            if not stream.is_finished:
                self._abort_now([request_id])

    async def abort(self, request_id: str | Iterable[str]) -> list[str]:
        """Abort requests wherever they are; unknown or finished ids are ignored.

        Returns the ids that were in flight. Their blocks are free on return (a step already
        running finishes without them) and each stream gets its final output.
        """
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        return self._abort_now(ids)

    def _abort_now(self, request_ids: list[str]) -> list[str]:
        aborted = []
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is None:
                continue
            aborted.append(request_id)
            for final in self.engine.abort_request(request_id):
                self._put(stream, final)
                if self.observer is not None:
                    self.observer.on_request_done(request_id, final)
        return aborted

    async def tokenize(self, text: str, **kwargs: Any) -> Any:
        """The tokenizer's encoding of `text` (transformers' `__call__`), off the event loop.

        A text over max_prompt_bytes raises `InvalidRequestError` (field "text") untouched.
        """
        self._front.validator.check_text_size("text", text)
        tokenizer = self._front.tokenizer
        return await self._off_loop(lambda: tokenizer(text, **kwargs))

    async def detokenize(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of `token_ids`, off the event loop; an id outside the vocabulary raises
        `InvalidRequestError` (field "token_ids")."""
        self._front.validator.check_token_ids("token_ids", token_ids)
        tokenizer = self._front.tokenizer
        text = await self._off_loop(
            lambda: tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        )
        return str(text)

    async def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        """The vocabulary's token strings of `token_ids`, off the event loop."""
        tokenizer = self._front.tokenizer
        return list(await self._off_loop(tokenizer.convert_ids_to_tokens, token_ids))

    async def _off_loop(self, fn: Callable[..., R], *args: Any) -> R:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    # -- the loop ----------------------------------------------------------------------------

    def _start(self) -> None:
        if self.is_running:
            return
        self._has_work = asyncio.Event()
        # an empty context: the loop must not carry its first caller's log context for good
        loop, context = asyncio.get_running_loop(), contextvars.Context()
        task = loop.create_task(self._run(), name="step-loop", context=context)
        task.add_done_callback(self._on_loop_done, context=context)
        self._loop_task = task

    async def _run(self) -> None:
        assert self._has_work is not None
        loop = asyncio.get_running_loop()
        while True:
            if not self.engine.has_unfinished_requests():
                self.engine.check_every_block_came_back()
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

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            self._put(stream, out)
            if out.finished:
                del self._streams[out.request_id]
                if self.observer is not None:
                    self.observer.on_request_done(out.request_id, out)

    def _put(self, stream: RequestStream, out: RequestOutput) -> None:
        """Hand an output to its stream; a request that failed gets its error instead."""
        if out.finished and out.error is not None:
            finish = out.outputs[0].finish if out.outputs else None
            if finish is FinishReason.REJECTED:
                stream.fail(InvalidRequestError("prompt", out.error))
            else:
                stream.fail(RequestFailedError(out.error))
            return
        stream.put(out)

    def _on_loop_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            if self._dead is None:
                # the event loop ended under the engine (asyncio.run returned): no failure.
                # What was in flight is aborted; a later event loop may use the engine again.
                self._abort_now(list(self._streams))
                self._loop_task = None
                logger.debug("step_loop_stopped", reason="its event loop ended")
            return
        cause = task.exception()
        if isinstance(cause, asyncio.TimeoutError):
            cause = TimeoutError(f"a step took longer than {self.step_timeout_s} s")
        self._die(cause)

    def _die(self, cause: BaseException | None) -> None:
        """The engine is dead: every open stream is told, and nothing new is admitted."""
        if self._dead is not None:  # already dead (or shut down): its streams were told
            return
        # the same words for every stream: the cause may hold one request's values
        dead = EngineDeadError("the engine stopped on an internal error (see the server log)")
        dead.__cause__ = cause
        self._dead = dead
        logger.error(
            "engine_dead", cause=repr(cause), open_streams=len(self._streams), exc_info=cause
        )
        for request_id, stream in self._streams.items():
            stream.fail(dead)
            if self.observer is not None:
                self.observer.on_request_done(request_id, None)
        self._streams.clear()

    async def shutdown(self) -> None:
        """Abort every request, end every stream, and stop the loop and the worker threads."""
        self._abort_now(list(self._streams))
        if self._dead is None:
            self._dead = EngineDeadError("the engine was shut down")
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        # tensor-parallel workers stop here (after the step in flight, if any, or it fails)
        await asyncio.to_thread(self.engine.shutdown)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)


def _aborted(
    stream: RequestStream, prompt: str | list[int], token_ids: list[int], params: SamplingParams
) -> RequestStream:
    """The stream of a request aborted before the engine queued it: its final output, now."""
    if stream.is_finished:  # its final output is there already
        return stream
    stream.prompt = prompt if isinstance(prompt, str) else None
    stream.prompt_token_ids = token_ids
    samples = [CompletionOutput(i, "", [], finish=FinishReason.ABORTED) for i in range(params.n)]
    stream.put(RequestOutput(stream.request_id, stream.prompt, token_ids, samples, finished=True))
    return stream


def _timed(fn: Callable[[A], R], arg: A) -> tuple[R, float]:
    started = time.perf_counter()
    result = fn(arg)
    return result, time.perf_counter() - started
