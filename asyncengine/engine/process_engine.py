"""`ProcessAsyncLLMEngine`: an AsyncLLMEngine whose step loop runs in a process of its own.

The parent's side (as vLLM's V1 `AsyncLLM` is to its engine core): it spawns the engine process
(engine/core_process.py), keeps the front door (validation, tokenizing, the callers' streams,
the observer) and turns the child's messages into the streams' outputs. In one process the
server's event loop takes turns with the steps; here they run on two cores.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import contextvars
import itertools
import multiprocessing
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from asyncengine.config import EngineArgs, EngineConfig
from asyncengine.core.request import FinishReason
from asyncengine.engine.async_llm_engine import AsyncLLMEngine, EngineObserver, StepStats
from asyncengine.engine.core_process import (
    ABORT,
    ABORTED,
    ADD,
    ADDED,
    FAILED,
    READY,
    STEP,
    STOP,
    CoreFactory,
    decode_output,
    run_engine_core,
)
from asyncengine.engine.llm_engine import EngineStats, LLMEngine, encode_prompt, freeze_heap
from asyncengine.engine.request_stream import RequestStream
from asyncengine.engine.validator import RequestValidator, ValidatedRequest
from asyncengine.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from asyncengine.logging import get_logger, logging_settings
from asyncengine.outputs import CompletionOutput, RequestOutput

logger = get_logger(__name__)

START_TIMEOUT_S = 600.0
SHUTDOWN_ABORT_S = 10.0  # how long shutdown waits for the child to take its aborts


@dataclass
class _Front:
    """The parent's copy of what the front door reads: config, tokenizer, validator."""

    config: EngineConfig
    tokenizer: Any
    validator: RequestValidator
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    def tokenize(self, text: str) -> list[int]:
        return encode_prompt(self.tokenizer, text)


class ProcessAsyncLLMEngine(AsyncLLMEngine):
    """AsyncLLMEngine whose step loop runs in a child process; the same interface.

    Differences a caller can see: an abort's final output arrives after the child took it
    (within a step), and `engine` (the `LLMEngine`) lives in the child, out of reach.
    """

    def __init__(
        self,
        args: EngineArgs,
        factory: CoreFactory = LLMEngine.from_engine_args,
        step_timeout_s: float = 300.0,
        observer: EngineObserver | None = None,
        torch_threads: int | None = None,
    ) -> None:
        from transformers import AutoTokenizer

        args.create_engine_config()  # a bad setting fails here, before a process starts
        context = multiprocessing.get_context("spawn")
        conn, child_conn = context.Pipe()
        started = time.perf_counter()
        self._process = context.Process(
            target=run_engine_core,
            args=(factory, args, child_conn, logging_settings(), torch_threads, step_timeout_s),
            name="asyncengine-core",
            # not a daemon: it starts tensor-parallel workers of its own. It stops on STOP, or
            # when this process ends (the pipe's end), and `_stop_at_exit` sees to that
            daemon=False,
        )
        self._process.start()
        atexit.register(_stop_at_exit, weakref.ref(self))
        child_conn.close()
        self._conn = conn
        ready = _wait_ready(conn, self._process)
        _, config, vocab_size, eos_token_ids, num_gpu_blocks, stats = ready
        tokenizer = AutoTokenizer.from_pretrained(config.model_config.tokenizer)
        validator = RequestValidator(config, vocab_size, num_gpu_blocks)
        self._init_front(
            _Front(config, tokenizer, validator, vocab_size, eos_token_ids),
            step_timeout_s,
            observer,
        )
        self._stats = EngineStats(*stats)
        self._phases: dict[str, str] = {}
        # streams aborted here whose final output the child has not sent yet: by id, oldest
        # first (an id may be aborted, used again and aborted again before the child answers),
        # and by the ticket of the ABORT that took them
        self._aborting: dict[str, list[RequestStream]] = {}
        self._abort_tickets: dict[int, list[tuple[str, RequestStream]]] = {}
        self._tickets = itertools.count()
        self._replies: dict[int, asyncio.Future[Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        freeze_heap()  # the tokenizer and the imports, as the child does its engine
        logger.info(
            "engine_core_started", pid=self._process.pid, start_s=time.perf_counter() - started
        )

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> ProcessAsyncLLMEngine:
        return cls(args)

    # -- state -------------------------------------------------------------------------------

    def _check_model(self) -> None:
        if self._dead is None and not self._process.is_alive():
            self._die(RuntimeError(f"the engine process exited ({self._process.exitcode})"))

    @property
    def is_running(self) -> bool:
        return self._loop is not None and self._dead is None

    def get_stats(self) -> EngineStats:
        return self._stats

    def request_phase(self, request_id: str) -> str | None:
        if request_id not in self._streams:
            return None
        return self._phases.get(request_id, "queued")

    # -- requests ----------------------------------------------------------------------------

    async def _queue(self, validated: ValidatedRequest, stream: RequestStream) -> bool:
        self.check_health()
        ticket = next(self._tickets)
        constrained = validated.sampling_params.structured_outputs is not None
        reply = None
        if constrained:
            reply = self._replies[ticket] = asyncio.get_running_loop().create_future()
        self._send((ADD, ticket, validated))
        if reply is None:
            return True
        try:
            error, kind, compile_s = await reply
        except BaseException:
            # the caller left while the child compiles: the child must drop the request too
            if self._streams.get(validated.request_id) is stream:
                self._abort_now([validated.request_id])
            raise
        if error == "aborted":
            return False
        if error is not None:
            field, reason = error
            if field is None:
                raise EngineDeadError(f"the request could not be queued: {reason}")
            raise InvalidRequestError(field, reason)
        if self.observer is not None:
            self.observer.on_structured_request(kind, compile_s)
        return True

    async def abort(self, request_id: str | Iterable[str]) -> list[str]:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        aborted, reply = self._abort_and_reply(ids)
        if reply is not None:
            with contextlib.suppress(EngineDeadError):  # then every stream was told
                # a request the child finished before it took the abort was not aborted
                aborted = await asyncio.shield(reply)
        return aborted

    def _abort_now(self, request_ids: list[str]) -> list[str]:
        return self._abort_and_reply(request_ids)[0]

    def _abort_and_reply(
        self, request_ids: list[str]
    ) -> tuple[list[str], asyncio.Future[Any] | None]:
        """Take the streams out of flight and ask the child for their final outputs."""
        taken = []
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                taken.append((request_id, stream))
                self._aborting.setdefault(request_id, []).append(stream)
        aborted = [request_id for request_id, _ in taken]
        if not taken or self._dead is not None or self._loop is None:
            for request_id, stream in taken:
                self._end_aborted(request_id, stream, None)
            return aborted, None
        ticket = next(self._tickets)
        reply = self._replies[ticket] = self._loop.create_future()
        self._abort_tickets[ticket] = taken
        self._send((ABORT, ticket, aborted))
        return aborted, reply

    def _end_aborted(
        self, request_id: str, stream: RequestStream, encoded: tuple[Any, ...] | None
    ) -> None:
        """Give an aborted stream its final output: the child's, or one made here."""
        pending = self._aborting.get(request_id)
        if pending is not None and stream in pending:
            pending.remove(stream)
            if not pending:
                del self._aborting[request_id]
        if stream.is_finished:
            return
        if encoded is None:  # never queued there (still tokenizing, or compiling)
            samples = [
                CompletionOutput(i, "", [], finish=FinishReason.ABORTED)
                for i in range(stream.num_samples)
            ]
            out = RequestOutput(
                request_id, stream.prompt, stream.prompt_token_ids, samples, finished=True
            )
        else:
            out = decode_output(encoded, stream)
        self._put(stream, out)
        if self.observer is not None:
            self.observer.on_request_done(request_id, out)

    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            self._conn.send(message)
        except (OSError, ValueError) as exc:  # the child is gone
            self._die(exc)
            self.check_health()

    # -- the loop ----------------------------------------------------------------------------

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None:  # an earlier event loop ended under the engine
            self._abort_now(list(self._streams))
        self._loop = loop
        # in an empty context: the reader must not log in its first caller's request context
        contextvars.Context().run(loop.add_reader, self._conn.fileno(), self._on_readable)

    def _on_readable(self) -> None:
        try:
            while self._conn.poll():
                self._on_message(self._conn.recv())
        except (EOFError, OSError):
            self._stop_reading()
            self._process.join(5)
            self._die(RuntimeError(f"the engine process exited ({self._process.exitcode})"))
        except Exception as exc:  # a bug here, as one in the step: the engine is dead
            self._stop_reading()
            self._die(exc)

    def _stop_reading(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._conn.fileno())

    def _on_message(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == STEP:
            _, outputs, stats, engine_stats, phases = message
            self._stats = EngineStats(*engine_stats)
            if phases is not None:
                self._phases = phases
            self._deliver_encoded(outputs)
            if self.observer is not None:
                self.observer.on_step(StepStats(*stats))
        elif kind == ADDED:
            _, ticket, request_id, error, constraint_kind, compile_s = message
            reply = self._replies.pop(ticket, None)
            if reply is None:  # a request queued without a reply could not be queued after all
                self._fail_unqueued(request_id, error)
            elif not reply.done():  # (done: cancelled, its caller left)
                reply.set_result((error, constraint_kind, compile_s))
        elif kind == ABORTED:
            _, ticket, _, finals, engine_stats = message
            self._stats = EngineStats(*engine_stats)
            by_id = {encoded[0]: encoded for encoded in finals}
            aborted = []  # of those asked: the ones that had not finished before the child saw it
            for request_id, stream in self._abort_tickets.pop(ticket, []):
                if not stream.is_finished:
                    aborted.append(request_id)
                self._end_aborted(request_id, stream, by_id.get(request_id))
            reply = self._replies.pop(ticket, None)
            if reply is not None and not reply.done():
                reply.set_result(aborted)
        elif kind == FAILED:
            _, words, trace, exc = message
            logger.error("engine_core_failed", cause=words, traceback=trace)
            self._die(exc if isinstance(exc, BaseException) else RuntimeError(words))

    def _fail_unqueued(self, request_id: str, error: Any) -> None:
        """The child could not queue a request (an engine bug, logged there): it fails alone."""
        if error in (None, "aborted"):
            return
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.fail(RequestFailedError("the request could not be queued (see the server log)"))
            if self.observer is not None:
                self.observer.on_request_done(request_id, None)

    def _deliver_encoded(self, outputs: list[tuple[Any, ...]]) -> None:
        streams, aborting = self._streams, self._aborting
        for encoded in outputs:
            request_id = encoded[0]
            pending = aborting.get(request_id)
            if pending is not None:  # the child had not taken the abort yet: its tokens
                oldest = pending[0]  # belong to the oldest stream aborted under that id
                if encoded[2]:  # it finished all the same
                    self._end_aborted(request_id, oldest, encoded)
                else:
                    self._put(oldest, decode_output(encoded, oldest))
                continue
            stream = streams.get(request_id)
            if stream is None:
                continue
            out = decode_output(encoded, stream)
            self._put(stream, out)
            if out.finished:
                del streams[request_id]
                if self.observer is not None:
                    self.observer.on_request_done(request_id, out)

    def _die(self, cause: BaseException | None) -> None:
        if self._dead is not None:
            return
        super()._die(cause)
        assert self._dead is not None
        self._fail_aborting(self._dead)
        for reply in self._replies.values():
            if not reply.done():
                reply.set_exception(self._dead)
        self._replies.clear()

    def _fail_aborting(self, error: EngineDeadError) -> None:
        for streams in self._aborting.values():
            for stream in streams:
                stream.fail(error)
        self._aborting.clear()
        self._abort_tickets.clear()

    async def shutdown(self) -> None:
        """Abort every request, stop the child (after its step in flight) and the threads."""
        if self._loop is not None and self._dead is None:
            # the child answers between steps; one that hangs is killed below
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.abort(list(self._streams)), SHUTDOWN_ABORT_S)
        if self._dead is None:
            self._dead = EngineDeadError("the engine was shut down")
        self._fail_aborting(self._dead)
        with contextlib.suppress(OSError, ValueError):  # the child is gone already
            self._conn.send((STOP,))
        await asyncio.to_thread(self._process.join, 30)
        if self._process.is_alive():
            self._process.kill()
            await asyncio.to_thread(self._process.join, 5)
        self._stop_reading()
        self._conn.close()
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)


def _wait_ready(conn: Connection, process: Any) -> tuple[Any, ...]:
    """The child's READY, or its start-up error raised here (a dead child says so too)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not conn.poll(0.2):
        if not process.is_alive():
            raise RuntimeError(f"the engine process exited ({process.exitcode}) while starting")
        if time.monotonic() > deadline:
            process.kill()
            raise TimeoutError(f"the engine process did not start in {START_TIMEOUT_S} s")
    try:
        message = conn.recv()
    except EOFError:
        process.join(5)
        raise RuntimeError(
            f"the engine process exited ({process.exitcode}) while starting"
        ) from None
    if message[0] == FAILED:
        _, words, trace, exc = message
        process.join(5)
        logger.debug("engine_core_start_failed", traceback=trace)
        # the child's own exception (a ValueError for a bad setting, a KVCacheSizingError):
        # the CLI turns those into one line, as it does without an engine process
        raise exc if isinstance(exc, BaseException) else RuntimeError(words)
    assert message[0] == READY
    return message


def _stop_at_exit(ref: weakref.ref[ProcessAsyncLLMEngine]) -> None:
    """At interpreter exit, an engine never shut down: end its process (multiprocessing's
    own exit hook, which runs after this one, would wait for it forever)."""
    engine = ref()
    if engine is None or not engine._process.is_alive():
        return
    with contextlib.suppress(OSError, ValueError):
        engine._conn.close()  # the child's reader sees the end and stops it
    engine._process.join(10)
    if engine._process.is_alive():
        engine._process.kill()
