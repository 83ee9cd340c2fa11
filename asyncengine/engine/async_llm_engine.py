"""AsyncLLMEngine: the one engine interface; one asyncio step loop serving many streams."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Protocol, TypeVar

from asyncengine.config import EngineArgs, EngineConfig, ModelConfig
from asyncengine.core.kv_events import KvEvent
from asyncengine.core.request import FinishReason
from asyncengine.engine.core_client import EngineCoreClient, EngineFront, InprocClient
from asyncengine.engine.kv_events import KvEventHub, KvEventSubscription
from asyncengine.engine.llm_engine import EngineStats, LLMEngine
from asyncengine.engine.load import LoadReport, ThroughputMeter, load_report
from asyncengine.engine.messages import StepStats
from asyncengine.engine.request_stream import RequestStream
from asyncengine.errors import (
    DuplicateRequestError,
    EngineDeadError,
    EngineProcessLostError,
    InvalidRequestError,
    RequestFailedError,
)
from asyncengine.inputs import PromptType, parse_prompt
from asyncengine.logging import get_logger
from asyncengine.lora.request import LoRARequest
from asyncengine.outputs import RequestOutput
from asyncengine.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["AsyncLLMEngine", "EngineFront", "EngineObserver", "RequestStream", "StepStats"]

logger = get_logger(__name__)
R = TypeVar("R")

# how long shutdown waits for the core to answer its last aborts
SHUTDOWN_ABORT_S = 10.0


class EngineObserver(Protocol):
    """Receives the loop's measurements (metrics). Every call runs on the loop: keep them cheap."""

    def on_steps(self, steps: Sequence[StepStats]) -> None:
        """The figures of one step or more (never none), in order."""

    def on_request_done(self, request_id: str, output: RequestOutput | None) -> None:
        """Once per request: its final output, or None when the engine died under it."""

    def on_structured_request(self, kind: str, compile_s: float | None) -> None:
        """Once per constrained request queued: its constraint's kind ("json", "regex", ...)
        and the seconds its grammar took to compile (None: it came from the cache)."""


class AsyncLLMEngine:
    """The one engine interface every front end uses (gRPC, HTTP, `async for` in-process).

    It keeps the front door (validation, tokenizing off the event loop, each caller's stream)
    and hands validated requests to a core client (engine/core_client.py) that steps them:
    on this event loop, or in a process of its own (`engine_process=True`, as `serve` runs).
    Front ends call the public methods here and never reach into the core.
    """

    def __init__(
        self,
        core: EngineCoreClient | LLMEngine,
        step_timeout_s: float = 300.0,
        observer: EngineObserver | None = None,
    ) -> None:
        """`core`: a core client, or an `LLMEngine` to step on this event loop."""
        if isinstance(core, LLMEngine):
            core = InprocClient(core, step_timeout_s)
        self.core: EngineCoreClient = core
        self._front: EngineFront = core.front
        self.observer = observer
        self._tokenizer_pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="asyncengine-tokenize"
        )
        # by the caller's id, from the moment a request is accepted until its final output
        # (or its abort): what admission counts
        self._streams: dict[str, RequestStream] = {}
        # by the core's id, from the moment the core has a request until it says it is done
        # with the id (its final output, or the answer to its abort)
        self._core_streams: dict[str, RequestStream] = {}
        self._core_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: EngineDeadError | None = None
        self._throughput = ThroughputMeter()
        self._kv_events = KvEventHub() if self.config.cache_config.enable_kv_events else None
        # the adapters registered through this engine, by name (every add and remove is here)
        self._loras: dict[str, LoRARequest] = {}
        # a filtered debug call still costs ~7 us through the logger's proxy: once per step
        self._is_step_logged = logger.bind().is_enabled_for(logging.DEBUG)

    @classmethod
    def from_engine_args(
        cls,
        args: EngineArgs,
        engine_process: bool = False,
        observer: EngineObserver | None = None,
        **process_options: Any,
    ) -> AsyncLLMEngine:
        """The engine of `args`, stepping here or (`engine_process`) in a child process;
        `process_options` go to `MPClient` (factory, torch_threads, heartbeat_timeout_s...)."""
        if not engine_process:
            return cls(LLMEngine.from_engine_args(args), observer=observer)
        from asyncengine.engine.mp_client import MPClient

        return cls(MPClient(args, **process_options), observer=observer)

    @property
    def engine(self) -> LLMEngine:
        """The in-process core's `LLMEngine` (tests and benchmarks); an engine process's is
        out of reach."""
        if not isinstance(self.core, InprocClient):
            raise AttributeError("the LLMEngine steps in the engine process, out of reach")
        return self.core.engine

    # -- what the engine is ------------------------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        return self._front.config

    async def get_model_config(self) -> ModelConfig:
        """The model's config (vLLM's `EngineClient.get_model_config`)."""
        return self.config.model_config

    def is_tracing_enabled(self) -> bool:
        """False: this engine exports no OpenTelemetry traces (vLLM's `is_tracing_enabled`)."""
        return False

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
        return self._loop is not None and self._dead is None

    @property
    def errored(self) -> bool:
        self._check_core()
        return self._dead is not None

    def check_health(self) -> None:
        """Raise `EngineDeadError` if the engine can no longer serve."""
        self._check_core()
        if self._dead is not None:
            raise self._dead

    def _check_core(self) -> None:
        """The core can fail while nothing steps (a dead process, a tensor-parallel rank)."""
        if self._dead is None:
            try:
                self.core.check_health()
            except EngineDeadError as exc:  # the core's own cause is the one to log and tell
                self._die(exc.__cause__ or exc)
            except Exception as exc:
                self._die(exc)

    def get_stats(self) -> EngineStats:
        return self.core.get_stats()

    def get_load(self) -> LoadReport:
        """The load routers read: queues, KV tokens in use, generation rate, cache hit rate."""
        config = self.config
        return load_report(
            self.get_stats(),
            config.cache_config.block_size,
            config.scheduler_config.max_num_seqs,
            self._throughput.rate(),
        )

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
        stream = self._streams.get(request_id)
        if stream is None:
            return None
        if stream.core_id is None:  # still being tokenized
            return "queued"
        return self.core.request_phase(stream.core_id) or "queued"

    # -- requests ----------------------------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        sampling_params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        tenant: str | None = None,
        strict_max_tokens: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Validate, tokenize (off the loop) and queue a request; returns its output stream.

        `prompt` is text, token ids, or vLLM's `TextPrompt` / `TokensPrompt` dict.

        Bad input raises `InvalidRequestError` naming the field before anything is queued; an
        id in flight raises `DuplicateRequestError`. `tenant` keeps the caller's prefix cache
        apart from other tenants'; `strict_max_tokens` refuses a max_tokens past the context
        instead of capping it (`RequestValidator.check_tokens`). `lora_request` runs it with
        that adapter, registered first (`add_lora`) if it is not yet. A caller that stops
        reading before the final output must `abort` the request.
        """
        self.check_health()
        self._start()
        if request_id in self._streams:
            raise DuplicateRequestError(request_id)
        if lora_request is not None and self._loras.get(lora_request.lora_name) != lora_request:
            await self.add_lora(lora_request)
        parsed = parse_prompt(prompt, cache_salt)
        text_or_ids, cache_salt = parsed.prompt, parsed.cache_salt
        validator = self._front.validator
        validator.check_inputs(request_id, text_or_ids, sampling_params, cache_salt, priority)
        stream = RequestStream(
            request_id,
            is_delta=sampling_params.output_kind is RequestOutputKind.DELTA,
            num_samples=sampling_params.n,
        )
        # in num_requests from here, before the first await: admission hands its slot over
        # on that (Call._open)
        self._streams[request_id] = stream
        try:
            if isinstance(text_or_ids, str):
                token_ids = await self._off_loop(self._front.tokenize, text_or_ids)
            else:
                token_ids = list(text_or_ids)
            if self._streams.get(request_id) is not stream:  # aborted while tokenizing
                return self._aborted(stream, text_or_ids, token_ids)
            validated = validator.check_tokens(
                request_id,
                text_or_ids,
                token_ids,
                sampling_params,
                priority,
                cache_salt,
                tenant,
                strict_max_tokens,
            )
            stream.prompt, stream.prompt_token_ids = validated.prompt, validated.prompt_token_ids
            if parsed.text is not None:
                stream.prompt = parsed.text
            self.check_health()
            # the core needs no prompt text: the stream has it, and puts it on each output
            core_id = self._new_core_id(request_id)
            stream.core_id, self._core_streams[core_id] = core_id, stream
            queued = await self.core.add_request(
                replace(validated, request_id=core_id, prompt=None, lora_request=lora_request)
            )
        except BaseException as exc:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if stream.core_id is not None and not stream.is_finished:
                if isinstance(exc, asyncio.CancelledError):
                    # the caller left while its grammar compiled: the core must drop it too
                    self._release_when_aborted([stream], self.core.abort([stream.core_id]))
                else:  # refused by the core (a grammar that does not compile), or it died
                    self._core_streams.pop(stream.core_id, None)
            raise
        if queued is None:  # aborted while its grammar compiled: its final is there
            return self._aborted(stream, text_or_ids, token_ids)
        if queued.constraint_kind is not None and self.observer is not None:
            self.observer.on_structured_request(queued.constraint_kind, queued.compile_s)
        return stream

    def _new_core_id(self, request_id: str) -> str:
        """The caller's id while the core has no request by it; else one made unique."""
        core_id = request_id
        while core_id in self._core_streams:
            core_id = f"{request_id}#{next(self._core_ids)}"
        return core_id

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs, the last with `finished=True`: cumulative, or only
        what is new with `sampling_params.output_kind=DELTA`, or the final one alone.

        Bad input raises `InvalidRequestError` before anything is queued. Leaving the loop
        early (break, cancellation, `aclose()`) aborts the request and frees its blocks.
        """
        stream = await self.add_request(
            request_id, prompt, sampling_params, priority, cache_salt, lora_request=lora_request
        )
        try:
            while True:
                out = await stream.get()
                assert out is not None
                yield out
                if out.finished:
                    return
        finally:
            if not stream.is_finished and self._streams.get(request_id) is stream:
                self._abort_streams([request_id])

    async def abort(self, request_id: str | Iterable[str]) -> list[str]:
        """Abort requests wherever they are; unknown or finished ids are ignored.

        Returns the ids it aborted (a request that finished in the step the abort raced is not
        among them). Their blocks are free on return and each stream gets its final output.
        """
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        taken, core_aborted = self._abort_streams(ids)
        if core_aborted is None:
            return [stream.request_id for stream in taken]
        # shielded: a caller cancelled meanwhile leaves the abort to finish (it is sent)
        in_core = set(await asyncio.shield(core_aborted))
        return [s.request_id for s in taken if s.core_id is None or s.core_id in in_core]

    def _abort_streams(
        self, request_ids: list[str]
    ) -> tuple[list[RequestStream], asyncio.Future[list[str]] | None]:
        """Take the streams out of flight at once; the core's abort answers in the future."""
        # one not yet in the core is being tokenized: add_request gives it its final
        taken = [s for rid in request_ids if (s := self._streams.pop(rid, None)) is not None]
        in_core = [s for s in taken if s.core_id is not None and s.core_id in self._core_streams]
        if not in_core or self._dead is not None:
            return taken, None
        core_aborted = self.core.abort([s.core_id for s in in_core if s.core_id is not None])
        self._release_when_aborted(in_core, core_aborted)
        return taken, core_aborted

    def _release_when_aborted(
        self, streams: list[RequestStream], core_aborted: asyncio.Future[list[str]]
    ) -> None:
        """Once the core answered an abort it holds none of those ids: they may be reused.
        (A stream it aborted got its final before the answer; one it had not yet queued, or
        that finished first, gets its final here.)"""

        def release(_: asyncio.Future[list[str]]) -> None:
            for stream in streams:
                assert stream.core_id is not None
                if self._core_streams.get(stream.core_id) is stream:
                    del self._core_streams[stream.core_id]
                if not stream.is_finished:
                    self._end(stream, _aborted_output(stream))

        core_aborted.add_done_callback(release)

    # -- LoRA adapters -----------------------------------------------------------------------

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter (read from disk off the step loop); False if it already is.
        A bad adapter (or LoRA not enabled) raises `InvalidRequestError` naming
        `lora_request...`."""
        self.check_health()
        self._start()
        is_added = await self.core.add_lora(lora_request)
        self._loras[lora_request.lora_name] = lora_request
        return is_added

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; `LoRANotFoundError` if none has the id, `LoRAInUseError` while
        requests use it (they are never broken: retry once they finish)."""
        self.check_health()
        self._start()
        is_removed = await self.core.remove_lora(lora_int_id)
        self._loras = {n: r for n, r in self._loras.items() if r.lora_int_id != lora_int_id}
        return is_removed

    async def list_loras(self) -> set[int]:
        """The ids of the registered adapters."""
        self.check_health()
        self._start()
        return await self.core.list_loras()

    def lora_requests(self) -> dict[str, LoRARequest]:
        """The registered adapters by name (what /v1/models lists)."""
        return dict(self._loras)

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

    # -- outputs (the core client's sink) ----------------------------------------------------

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None and self._loop.is_running():
            # the core hands outputs to one loop: taking it over would strand that loop's
            # requests (aborted) and this one's (never answered)
            raise RuntimeError(
                "the engine serves another event loop, still running (one AsyncLLMEngine "
                "per event loop; from other threads, submit to that loop with "
                "asyncio.run_coroutine_threadsafe)"
            )
        previous, self._loop = self._loop, loop
        self.core.start(self)
        if previous is not None:  # an earlier event loop ended under the engine
            self._abort_streams(list(self._streams))

    def on_outputs(self, outputs: list[RequestOutput], steps: Sequence[StepStats]) -> None:
        """The core's outputs, each to its stream (found by the core's id)."""
        streams = self._core_streams
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:
                continue
            out.request_id = stream.request_id
            out.prompt, out.prompt_token_ids = stream.prompt, stream.prompt_token_ids
            if not out.finished:
                stream.put(out)
                continue
            assert stream.core_id is not None
            del streams[stream.core_id]
            if self._streams.get(stream.request_id) is stream:
                del self._streams[stream.request_id]
            self._end(stream, out)
        if not steps:
            return
        self._throughput.add(sum(step.num_generated_tokens for step in steps))
        if self.observer is not None:
            self.observer.on_steps(steps)
        if self._is_step_logged:
            for step in steps:
                logger.debug("step", num_outputs=len(outputs), **vars(step))

    def _end(self, stream: RequestStream, final: RequestOutput) -> None:
        """Give a stream its final output (a failed request its error instead), once."""
        if stream.is_finished:
            return
        if final.error is not None:
            finish = final.outputs[0].finish if final.outputs else None
            if finish is FinishReason.REJECTED:
                stream.fail(InvalidRequestError("prompt", final.error))
            else:
                stream.fail(RequestFailedError(final.error))
        else:
            stream.put(final)
        if self.observer is not None:
            self.observer.on_request_done(stream.request_id, final)

    def _aborted(
        self, stream: RequestStream, prompt: str | list[int], token_ids: list[int]
    ) -> RequestStream:
        """The stream of a request aborted before the core queued it: its final, now."""
        if not stream.is_finished:  # (else its final output is there already)
            stream.prompt = prompt if isinstance(prompt, str) else None
            stream.prompt_token_ids = token_ids
            self._end(stream, _aborted_output(stream))
        return stream

    def on_dead(self, cause: BaseException) -> None:
        self._die(cause)

    def on_kv_events(self, events: list[KvEvent]) -> None:
        if self._kv_events is not None:
            self._kv_events.publish(events)

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (a CLEARED KV event), if no request holds a KV block;
        whether it did (vLLM's `reset_prefix_cache`). Raises `EngineDeadError` when dead."""
        if self._dead is not None:
            raise self._dead
        self._start()
        return await self.core.reset_prefix_cache()

    def kv_events(self, start_sequence_number: int = 0) -> KvEventSubscription:
        """The prefix cache's events (`--enable-kv-events`), as numbered batches: those after
        `start_sequence_number` if still kept, else (and for 0) a snapshot first (CLEARED, then
        every cached block). A subscriber that falls behind gets a snapshot again. Iterate it
        with `async for`; close it (or `async with`) when done."""
        if self._kv_events is None:
            raise RuntimeError("KV events are off: start the engine with enable_kv_events")
        return self._kv_events.subscribe(start_sequence_number)

    def _die(self, cause: BaseException | None) -> None:
        """The engine is dead: every open stream is told, and nothing new is admitted."""
        if self._dead is not None:  # already dead (or shut down): its streams were told
            return
        # the same words for every stream: a step's error may hold one request's values, so
        # only a lost process is quoted
        if isinstance(cause, EngineProcessLostError):
            dead = EngineDeadError(f"the engine stopped: {cause}")
        else:
            dead = EngineDeadError("the engine stopped on an internal error (see the server log)")
        dead.__cause__ = cause
        self._dead = dead
        open_streams = {id(s): s for s in (*self._streams.values(), *self._core_streams.values())}
        logger.error(
            "engine_dead", cause=repr(cause), open_streams=len(open_streams), exc_info=cause
        )
        self._fail_all(dead, open_streams.values())

    def _fail_all(self, error: EngineDeadError, streams: Iterable[RequestStream]) -> None:
        if self._kv_events is not None:
            self._kv_events.close()
        for stream in streams:
            if stream.is_finished:
                continue
            stream.fail(error)
            if self.observer is not None:
                self.observer.on_request_done(stream.request_id, None)
        self._streams.clear()
        self._core_streams.clear()

    async def shutdown(self) -> None:
        """Abort every request, end every stream, and stop the core and the worker threads."""
        if self._dead is None:
            self._start()  # the core answers on this event loop
        _, core_aborted = self._abort_streams(list(self._streams))
        if core_aborted is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(core_aborted), SHUTDOWN_ABORT_S)
        if self._dead is None:
            self._dead = EngineDeadError("the engine was shut down")
        await self.core.shutdown()
        self._fail_all(self._dead, list(self._core_streams.values()))
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)


def _aborted_output(stream: RequestStream) -> RequestOutput:
    """The final output of a request aborted before the core had it (or after it was gone)."""
    return RequestOutput.aborted(
        stream.request_id, stream.num_samples, stream.prompt, stream.prompt_token_ids
    )
