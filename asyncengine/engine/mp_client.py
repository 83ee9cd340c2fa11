"""`MPClient`: the core client whose `LLMEngine` steps in a child process (as `serve` runs it).

The parent's side of the channel (the child's is engine/core_process.py), two ZMQ sockets.
Requests and aborts go out on one, sent from the event loop and connected to the child's once
it is Ready: a connected PUSH queues what it is given (a bound one with no peer yet refuses
it), so a request sent the moment the child is Ready waits for the child's reader. Outputs
come back on the other, bound here, read by a thread of its own that decodes them and hands
them to the loop. Once the streams they woke have run, `OutputsTaken` tells the child: until
then it gathers its steps into one message, so a busy loop takes one message however many
steps it missed. The thread also watches the child: a process that exits, or that sends
nothing (not even a heartbeat) for `heartbeat_timeout_s`, is a dead engine, as a crash is; a
silent one is killed first.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from asyncengine.config import EngineArgs, EngineConfig
from asyncengine.engine.core_client import EngineFront, OutputSink, Queued
from asyncengine.engine.core_process import CoreFactory, CoreProcessOptions, run_engine_core
from asyncengine.engine.llm_engine import EngineStats, LLMEngine, encode_prompt, freeze_heap
from asyncengine.engine.messages import (
    Aborted,
    AbortRequests,
    Added,
    AddLoRA,
    AddRequest,
    Failed,
    FromEngine,
    Heartbeat,
    ListLoRAs,
    LoRAAnswer,
    OutputsTaken,
    PrefixCacheReset,
    Ready,
    RemoveLoRA,
    ResetPrefixCache,
    Shutdown,
    StepOutputs,
)
from asyncengine.engine.validator import RequestValidator, ValidatedRequest
from asyncengine.errors import (
    EngineDeadError,
    EngineProcessLostError,
    InvalidRequestError,
    RequestFailedError,
)
from asyncengine.logging import get_logger, logging_settings
from asyncengine.lora.request import LoRARequest
from asyncengine.outputs import RequestOutput
from asyncengine.processes import start_process

logger = get_logger(__name__)

START_TIMEOUT_S = 600.0
# silence from the child past this is death. Heartbeats come from a thread of their own every
# HEARTBEAT_INTERVAL_S whatever the steps do (the forward releases the GIL), so a long step
# does not trip it; a stopped, frozen or GIL-starved process does
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0
HEARTBEAT_INTERVAL_S = 1.0
_POLL_S = 0.2  # how often the reader looks at the child when nothing arrives


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


class MPClient:
    """Steps an `LLMEngine` (built by `factory` from `args`) in a child process.

    `heartbeat_timeout_s`: how long the child may be silent before it is declared dead.
    `step_timeout_s`: the child's own deadline for one step. `torch_threads`: its intra-op
    threads (None: torch's default).
    """

    def __init__(
        self,
        args: EngineArgs,
        factory: CoreFactory = LLMEngine.from_engine_args,
        step_timeout_s: float = 300.0,
        heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
        torch_threads: int | None = None,
    ) -> None:
        from transformers import AutoTokenizer

        config = args.create_engine_config()  # a bad setting fails here, before a process
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._dir = tempfile.mkdtemp(prefix="asyncengine-")
        self._context: zmq.Context[Any] = zmq.Context()
        self._input = self._socket(zmq.PUSH)  # connected once the child has bound its end
        self._output = self._socket(zmq.PULL)
        self._output.bind(self._address("output"))
        options = CoreProcessOptions(
            input_address=self._address("input"),
            output_address=self._address("output"),
            logging_settings=logging_settings(),
            torch_threads=torch_threads,
            step_timeout_s=step_timeout_s,
            heartbeat_interval_s=min(HEARTBEAT_INTERVAL_S, heartbeat_timeout_s / 4),
            parent_pid=os.getpid(),
        )
        started = time.perf_counter()
        # spawned without re-running the caller's __main__ (a script without a main guard,
        # stdin, a notebook); not a daemon: it starts tensor-parallel workers of its own. It
        # stops on Shutdown or when this process ends, and `_stop_at_exit` sees to that
        self._process = start_process(
            run_engine_core, (factory, args, options), name="asyncengine-core", daemon=False
        )
        atexit.register(_stop_at_exit, weakref.ref(self))
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromEngine)
        try:
            ready = self._wait_ready()
        except BaseException:
            self._close()
            raise
        self._input.connect(self._address("input"))
        tokenizer = AutoTokenizer.from_pretrained(config.model_config.tokenizer)
        validator = RequestValidator(config, ready.vocab_size, ready.num_gpu_blocks)
        self.front: EngineFront = _Front(
            config, tokenizer, validator, ready.vocab_size, tuple(ready.eos_token_ids)
        )
        self._stats: EngineStats = ready.stats
        self._phases: dict[str, str] = {}
        self._adding: dict[str, asyncio.Future[Queued | None]] = {}  # constrained, by core id
        self._aborting: dict[int, asyncio.Future[list[str]]] = {}  # by ticket
        self._resetting: dict[int, asyncio.Future[bool]] = {}  # by ticket
        self._lora_calls: dict[int, asyncio.Future[LoRAAnswer]] = {}  # by ticket
        self._tickets = itertools.count()
        self._sink: OutputSink | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.num_step_messages = 0  # StepOutputs taken, and the steps they carried
        self.num_steps = 0
        self._is_taken_due = False  # an OutputsTaken is to be sent once the streams ran
        self._dead: BaseException | None = None  # set by the reader the moment it knows
        self._is_closing = False
        self._last_heard = time.monotonic()
        self._reader = threading.Thread(target=self._read, name="core-client", daemon=True)
        self._reader.start()
        freeze_heap()  # the tokenizer and the imports, as the child does its engine
        logger.info(
            "engine_core_started", pid=self._process.pid, start_s=time.perf_counter() - started
        )

    def _address(self, name: str) -> str:
        return f"ipc://{self._dir}/{name}"

    def _socket(self, kind: int) -> zmq.Socket[Any]:
        sock = self._context.socket(kind)
        # no high-water mark: a burst is buffered, never dropped or refused (admission bounds it)
        sock.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, 0)
        # nothing left to send once the child is gone: exiting never waits on these
        sock.setsockopt(zmq.LINGER, 0)
        return sock

    def _wait_ready(self) -> Ready:
        """The child's Ready, or its start-up error raised here (a dead child says so too)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self._output.poll(int(_POLL_S * 1000)):
                message = self._decoder.decode(self._output.recv())
                if isinstance(message, Ready):
                    return message
                if isinstance(message, Failed):
                    self._process.join(5)
                    logger.debug("engine_core_start_failed", traceback=message.traceback)
                    # the child's own exception (a ValueError for a bad setting, a
                    # KVCacheSizingError): the CLI turns those into one line, as in-process
                    raise message.error()
                continue  # heartbeats while the model loads
            if not self._process.is_alive():
                code = self._process.exitcode
                raise RuntimeError(f"the engine process exited ({code}) while starting")
            if time.monotonic() > deadline:
                self._process.kill()
                raise TimeoutError(f"the engine process did not start in {START_TIMEOUT_S} s")

    # -- EngineCoreClient ----------------------------------------------------------------------

    def start(self, sink: OutputSink) -> None:
        self._sink, self._loop = sink, asyncio.get_running_loop()
        # outputs an earlier event loop never took would hold the child's next ones back
        self._send_taken()

    async def add_request(self, request: ValidatedRequest) -> Queued | None:
        self.check_health()
        reply = None
        if request.sampling_params.structured_outputs is not None:
            reply = asyncio.get_running_loop().create_future()
            self._adding[request.request_id] = reply
        self._send(AddRequest(request.request_id, request))
        if reply is None:
            return Queued()
        try:
            return await reply
        finally:
            if self._adding.get(request.request_id) is reply:
                del self._adding[request.request_id]

    def abort(self, request_ids: list[str]) -> asyncio.Future[list[str]]:
        reply: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
        if self._dead is not None:
            reply.set_result([])
            return reply
        ticket = next(self._tickets)
        self._aborting[ticket] = reply
        self._send(AbortRequests(ticket, request_ids))
        return reply

    async def reset_prefix_cache(self) -> bool:
        self.check_health()
        reply: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        ticket = next(self._tickets)
        self._resetting[ticket] = reply
        self._send(ResetPrefixCache(ticket))
        try:
            return await reply
        finally:
            self._resetting.pop(ticket, None)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        return (await self._lora_call(AddLoRA(next(self._tickets), lora_request))).result

    async def remove_lora(self, lora_int_id: int) -> bool:
        return (await self._lora_call(RemoveLoRA(next(self._tickets), lora_int_id))).result

    async def list_loras(self) -> set[int]:
        return set((await self._lora_call(ListLoRAs(next(self._tickets)))).lora_int_ids)

    async def _lora_call(self, message: AddLoRA | RemoveLoRA | ListLoRAs) -> LoRAAnswer:
        self.check_health()
        reply: asyncio.Future[LoRAAnswer] = asyncio.get_running_loop().create_future()
        self._lora_calls[message.ticket] = reply
        self._send(message)
        try:
            answer = await reply
        finally:
            self._lora_calls.pop(message.ticket, None)
        error = answer.exception()
        if error is not None:
            raise error
        return answer

    def get_stats(self) -> EngineStats:
        return self._stats

    def request_phase(self, request_id: str) -> str | None:
        return self._phases.get(request_id)

    def check_health(self) -> None:
        # an exit is the reader's to find (within two polls): it takes a Failed the child sent
        # before exiting as the cause, where this would take the exit. The reader is asked
        # first: a thread's state is a flag, the process's a waitpid call on every request
        if self._dead is None and not self._reader.is_alive() and not self._process.is_alive():
            self._dead = EngineProcessLostError(
                f"the engine process exited ({self._process.exitcode})"
            )
        if self._dead is not None:
            raise EngineDeadError("the engine process is gone") from self._dead

    async def shutdown(self) -> None:
        """Stop the child (after its step in flight), then the reader and the sockets."""
        if self._process.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self._send_now(Shutdown())
            await asyncio.to_thread(self._process.join, 30)
            if self._process.is_alive():
                self._process.kill()
                await asyncio.to_thread(self._process.join, 5)
        if self._dead is None:
            self._dead = EngineDeadError("the engine was shut down")
        self._close()

    def _close(self) -> None:
        self._is_closing = True
        reader = getattr(self, "_reader", None)
        if reader is not None and reader is not threading.current_thread():
            reader.join(2 * _POLL_S + 1)
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- sending (on the event loop) ---------------------------------------------------------

    def _send(self, message: msgspec.Struct) -> None:
        try:
            self._send_now(message)
        except zmq.ZMQError as exc:  # the socket is closed: this client was shut down
            self._dead = self._dead or exc
            self.check_health()

    def _send_now(self, message: msgspec.Struct) -> None:
        # never blocks: no high-water mark, and ZMQ's I/O thread writes a large message out
        # in as many pieces as the socket takes
        self._input.send(self._encoder.encode(message), flags=zmq.NOBLOCK, copy=False)

    # -- receiving (the reader thread, then the event loop) ----------------------------------

    def _read(self) -> None:
        """Decode what the child sends and hand it to the loop; declare the child dead when it
        exits or goes silent past the heartbeat deadline."""
        try:
            while not self._is_closing:
                if self._output.poll(int(_POLL_S * 1000)):
                    messages, failed = self._drain()
                    if messages:
                        self._post(self._on_messages, messages)
                    if failed is not None:  # the outputs before it are delivered first
                        self._post_death(failed)
                        return
                    continue
                cause = self._check_child()
                if cause is not None:
                    # what it sent before it went (a Failed last) may still be in flight
                    if self._output.poll(int(_POLL_S * 1000)):
                        messages, failed = self._drain()
                        if messages:
                            self._post(self._on_messages, messages)
                        cause = failed or cause
                    self._post_death(cause)
                    return
        except Exception as exc:  # a bug here, as one in a step: the engine is dead
            if not self._is_closing:
                self._post_death(exc)

    def _drain(self) -> tuple[list[Any], BaseException | None]:
        """What the child has sent, and the error of a Failed among it: the child's own
        account of its death, taken here before its exit (what this thread would notice next,
        and take for the cause) can be seen."""
        messages: list[Any] = []
        failed: BaseException | None = None
        while True:
            try:
                frame = self._output.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return messages, failed
            self._last_heard = time.monotonic()
            message = self._decoder.decode(frame.buffer)
            if isinstance(message, Failed):
                logger.error(
                    "engine_core_failed", cause=message.reason, traceback=message.traceback
                )
                failed = failed or message.error()
            elif not isinstance(message, Heartbeat):
                messages.append(message)

    def _check_child(self) -> BaseException | None:
        if not self._process.is_alive():
            self._process.join(1)
            return EngineProcessLostError(f"the engine process exited ({self._process.exitcode})")
        silent_s = time.monotonic() - self._last_heard
        if silent_s <= self.heartbeat_timeout_s:
            return None
        logger.error(
            "engine_heartbeat_lost",
            pid=self._process.pid,
            silent_s=round(silent_s, 1),
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            action="killing the engine process",
        )
        self._process.kill()  # stopped, frozen or starved: it will not recover on its own
        return EngineProcessLostError(
            f"the engine process sent no heartbeat for {silent_s:.1f} s "
            f"(heartbeat_timeout_s {self.heartbeat_timeout_s})"
        )

    def _post(self, fn: Callable[[Any], None], arg: Any) -> None:
        loop = self._loop
        if loop is None:
            return  # nothing asked yet: there is nothing to deliver to
        with contextlib.suppress(RuntimeError):  # its event loop ended: its streams with it
            loop.call_soon_threadsafe(fn, arg)

    def _post_death(self, cause: BaseException) -> None:
        """Once: the first cause known (a Failed's error before the exit it led to) is told."""
        if self._dead is None:
            self._dead = cause
        self._post(self._on_death, self._dead)

    def _on_messages(self, messages: list[Any]) -> None:
        for message in messages:
            if isinstance(message, StepOutputs):
                self._on_outputs(message)
            elif isinstance(message, Added):
                self._on_added(message)
            elif isinstance(message, PrefixCacheReset):
                resetting = self._resetting.pop(message.ticket, None)
                if resetting is not None and not resetting.done():
                    resetting.set_result(message.is_reset)
            elif isinstance(message, LoRAAnswer):
                call = self._lora_calls.pop(message.ticket, None)
                if call is not None and not call.done():
                    call.set_result(message)
            elif isinstance(message, Aborted):
                reply = self._aborting.pop(message.ticket, None)
                if reply is not None and not reply.done():
                    reply.set_result(message.request_ids)

    def _on_outputs(self, message: StepOutputs) -> None:
        self.num_step_messages += 1
        self.num_steps += len(message.steps)
        self._stats = message.stats
        if message.phases is not None:
            self._phases = message.phases
        assert self._sink is not None and self._loop is not None
        self._sink.on_outputs(message.outputs, message.steps)
        if not self._is_taken_due:
            # after the callbacks the outputs scheduled: the streams they woke run first
            self._is_taken_due = True
            self._loop.call_soon(self._send_taken)
        if message.kv_events:
            self._sink.on_kv_events(message.kv_events)
        if self._adding:  # constrained requests aborted while compiling end here
            for out in message.outputs:
                reply = self._adding.pop(out.request_id, None) if out.finished else None
                if reply is not None and not reply.done():
                    reply.set_result(None)

    def _send_taken(self) -> None:
        self._is_taken_due = False
        if self._dead is None:
            with contextlib.suppress(zmq.ZMQError):  # no child to take it: it is dead
                self._send_now(OutputsTaken())

    def _on_added(self, added: Added) -> None:
        reply = self._adding.pop(added.request_id, None)
        if reply is None:  # a request queued without a reply could not be queued after all
            if added.error is not None and self._sink is not None:
                failed = RequestOutput(added.request_id, None, [], [], True, error=_UNQUEUED)
                self._sink.on_outputs([failed], ())
            return
        if reply.done():  # its caller left
            return
        if added.is_aborted:
            reply.set_result(None)
        elif added.error_field is not None:
            reply.set_exception(InvalidRequestError(added.error_field, added.error or ""))
        elif added.error is not None:
            reply.set_exception(RequestFailedError(_UNQUEUED))
        else:
            reply.set_result(Queued(added.constraint_kind, added.compile_s))

    def _on_death(self, cause: BaseException) -> None:
        dead = EngineDeadError("the engine process is gone")
        dead.__cause__ = cause
        for reply in self._adding.values():
            if not reply.done():
                reply.set_exception(dead)
        for aborted in self._aborting.values():
            if not aborted.done():
                aborted.set_result([])
        waits: list[asyncio.Future[Any]] = [*self._resetting.values(), *self._lora_calls.values()]
        for waiting in waits:
            if not waiting.done():
                waiting.set_exception(dead)
        self._adding.clear()
        self._aborting.clear()
        if self._sink is not None:
            self._sink.on_dead(cause)


_UNQUEUED = "the request could not be queued (see the server log)"


def _stop_at_exit(ref: weakref.ref[MPClient]) -> None:
    """At interpreter exit, an engine never shut down: end its process (multiprocessing's
    own exit hook, which runs after this one, would wait for it forever)."""
    client = ref()
    if client is None or not client._process.is_alive():
        return
    with contextlib.suppress(zmq.ZMQError):
        client._send_now(Shutdown())
    client._process.join(10)
    if client._process.is_alive():
        client._process.kill()
    client._is_closing = True
