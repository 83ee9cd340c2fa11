"""The engine process: its main (`run_engine_core`) and its loop, the far side of `MPClient`.

The child owns the `LLMEngine` (scheduler, KV cache, model, detokenizer) and steps while there
is work; the front process keeps validation, tokenizing and the callers' streams. They share
two ZMQ sockets (engine/messages.py says what crosses):

- input (PULL, bound by the child before it says Ready): requests and aborts, read by a thread
  of its own into a queue, so the parent is never held up by a step; the loop takes what is
  queued between steps.
- output (PUSH): each step's outputs in one message, sent by the loop; while the parent has
  not taken the last one (`OutputsTaken`), the steps made meanwhile go in the next one.

A third thread proves the process alive: a heartbeat every `heartbeat_interval_s`, whatever the
steps are doing, and it ends the process when a step runs past `step_timeout_s` or the parent
is gone. The child is spawned, not forked, and builds its engine from `CoreFactory`.
"""

from __future__ import annotations

import functools
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from asyncengine.config import EngineArgs
from asyncengine.engine.core_client import step_stats
from asyncengine.engine.grammar_compiles import GrammarCompile
from asyncengine.engine.llm_engine import LLMEngine
from asyncengine.engine.messages import (
    Aborted,
    AbortRequests,
    Added,
    AddLoRA,
    AddRequest,
    Failed,
    Heartbeat,
    ListLoRAs,
    LoRAAnswer,
    OutputsTaken,
    PrefixCacheReset,
    Ready,
    RemoveLoRA,
    ResetPrefixCache,
    Shutdown,
    ToEngine,
    request_id_of_malformed,
)
from asyncengine.engine.output_batch import OutputBatch
from asyncengine.engine.validator import ValidatedRequest
from asyncengine.errors import InvalidRequestError, LoRAInUseError, LoRANotFoundError
from asyncengine.logging import get_logger
from asyncengine.outputs import RequestOutput
from asyncengine.sampling_params import RequestOutputKind

logger = get_logger(__name__)

# builds the child's engine; must be picklable (a module-level function, or a partial of one)
CoreFactory = Callable[[EngineArgs], LLMEngine]

PHASES_INTERVAL_S = 0.25  # how often a StepOutputs carries every request's phase
IDLE_HEALTH_CHECK_S = 0.5  # how often an idle child checks its model (tensor-parallel workers)


@dataclass(frozen=True)
class CoreProcessOptions:
    """What the parent tells the child besides the engine's arguments."""

    input_address: str
    output_address: str
    logging_settings: tuple[str, bool] | None
    torch_threads: int | None
    step_timeout_s: float
    heartbeat_interval_s: float
    # the parent's pid, as the parent saw it: read in the child after its imports, a parent
    # that died meanwhile would already be pid 1
    parent_pid: int


@dataclass(frozen=True)
class _Compiled:
    """A grammar compile that finished (the loop's own command, from the grammar pool)."""

    request: ValidatedRequest
    constraint: Any
    error: InvalidRequestError | None
    bug: str | None


@dataclass(frozen=True)
class _LoRARead:
    """An adapter read (or refused) off the loop, for the loop to register."""

    message: AddLoRA
    weights: Any
    error: Exception | None


@dataclass
class _Malformed:
    """An input message that did not decode; `request_id` when it named one."""

    request_id: str | None
    reason: str


def run_engine_core(factory: CoreFactory, args: EngineArgs, options: CoreProcessOptions) -> None:
    """The child's main: build the engine, say Ready, then step until Shutdown."""
    from asyncengine.logging import configure_logging

    if options.logging_settings is not None:
        configure_logging(*options.logging_settings)
    # the parent owns the lifecycle: a Ctrl-C or a SIGTERM to the whole group (systemd's
    # default) must not end the steps under a drain; Shutdown, or the parent's end, does
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    context = zmq.Context()
    output = _push(context, options.output_address)
    # bound before Ready: what the parent sends from then on waits here for the reader
    input_sock = context.socket(zmq.PULL)
    input_sock.setsockopt(zmq.RCVHWM, 0)
    input_sock.bind(options.input_address)
    encoder = msgspec.msgpack.Encoder()
    monitor = _Monitor(context, options, options.parent_pid)
    try:
        if options.torch_threads:
            import torch

            torch.set_num_threads(options.torch_threads)
        engine = factory(args)
    except BaseException as exc:
        failed = Failed.of(f"the engine did not start: {exc!r}", traceback.format_exc(), exc)
        output.send(encoder.encode(failed))
        output.close(linger=5000)
        return
    stats = engine.get_stats()
    ready = Ready(engine.vocab_size, engine.eos_token_ids, stats.num_gpu_blocks, stats)
    output.send(encoder.encode(ready))
    core = _Core(engine, input_sock, output, monitor)
    try:
        core.run()
    except BaseException as exc:
        logger.error("engine_core_failed", cause=repr(exc), exc_info=exc)
        output.send(encoder.encode(Failed.of(repr(exc), traceback.format_exc(), exc)))
    finally:
        engine.shutdown()
        output.close(linger=5000)


def _push(context: zmq.Context[Any], address: str) -> zmq.Socket[Any]:
    """A PUSH socket to the parent that never drops and never refuses a message: the parent's
    reader keeps up, and a full buffer only means waiting."""
    sock = context.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(address)
    return sock


class _Monitor:
    """The child's watch thread: heartbeats, the step deadline, the parent's end."""

    def __init__(
        self, context: zmq.Context[Any], options: CoreProcessOptions, parent_pid: int
    ) -> None:
        self.options = options
        self.parent_pid = parent_pid
        self.step_started: float | None = None  # set by the loop around each step
        self.on_parent_gone: Callable[[], None] = lambda: None
        # its own socket: ZMQ sockets belong to one thread each
        self.sock = _push(context, options.output_address)
        threading.Thread(target=self._watch, name="core-monitor", daemon=True).start()

    def _watch(self) -> None:
        heartbeat = msgspec.msgpack.encode(Heartbeat())
        interval = self.options.heartbeat_interval_s
        timeout = self.options.step_timeout_s
        while True:
            self.sock.send(heartbeat)
            time.sleep(min(interval, timeout / 4))
            started = self.step_started
            if started is not None and time.monotonic() - started > timeout:
                reason = f"a step took longer than {timeout} s"
                self.sock.send(msgspec.msgpack.encode(Failed(reason, "")))
                self.sock.close(linger=2000)
                os._exit(1)
            if os.getppid() != self.parent_pid:  # the parent died: nobody reads us
                self.on_parent_gone()
                time.sleep(10)  # the loop's own exit, unless a step hangs
                os._exit(1)


class _Core:
    """The child's loop: take commands between steps, step while there is work."""

    def __init__(
        self,
        engine: LLMEngine,
        input_sock: zmq.Socket[Any],
        output: zmq.Socket[Any],
        monitor: _Monitor,
    ) -> None:
        self.engine = engine
        self.output = output
        self.monitor = monitor
        self.encoder = msgspec.msgpack.Encoder()
        self.commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # constrained requests whose grammar compiles, by core id, and their compiles (an
        # aborted one is dropped from here and its compile cancelled)
        self.compiling: dict[str, tuple[ValidatedRequest, GrammarCompile]] = {}
        self.is_stopping = False
        self.last_phases = 0.0
        self.batch = OutputBatch()  # outputs made while the parent has not taken the last
        self.is_sent_untaken = False  # a StepOutputs went out and no OutputsTaken since
        monitor.on_parent_gone = lambda: self.commands.put(Shutdown())
        threading.Thread(
            target=self._read, args=(input_sock,), name="core-reader", daemon=True
        ).start()

    def _read(self, sock: zmq.Socket[Any]) -> None:
        decoder = msgspec.msgpack.Decoder(ToEngine)
        while True:
            frame = sock.recv(copy=False)
            try:
                self.commands.put(decoder.decode(frame.buffer))
            except msgspec.DecodeError as exc:
                self.commands.put(_Malformed(request_id_of_malformed(frame.bytes), str(exc)))

    def send(self, message: msgspec.Struct) -> None:
        """Send a message other than outputs, after the outputs gathered (they came first)."""
        self._send_batch()
        self._send(message)

    def _send(self, message: msgspec.Struct) -> None:
        self.output.send(self.encoder.encode(message), copy=False)

    def _send_batch(self) -> None:
        if self.batch:
            self._send(self.batch.take(self.engine.get_stats()))
            self.is_sent_untaken = True

    def run(self) -> None:
        engine = self.engine
        while not self.is_stopping:
            if not engine.has_unfinished_requests():
                engine.check_every_block_came_back()
                self._handle(self._next_command_when_idle())
            while not self.is_stopping:
                try:
                    self._handle(self.commands.get_nowait())
                except queue.Empty:
                    break
            if not self.is_stopping and engine.has_unfinished_requests():
                self._step()
        self._send_batch()
        self.compiling.clear()
        engine.abort_request(engine.in_flight_ids())

    def _next_command_when_idle(self) -> Any:
        """Wait for work; meanwhile check the model every IDLE_HEALTH_CHECK_S (a tensor-parallel
        worker that dies while nothing runs raises here: the engine is dead, health says so)."""
        while True:
            try:
                return self.commands.get(timeout=IDLE_HEALTH_CHECK_S)
            except queue.Empty:
                self.engine.check_health()

    def _step(self) -> None:
        engine = self.engine
        started = time.perf_counter()
        self.monitor.step_started = time.monotonic()
        plan = engine.schedule()
        scheduled = time.perf_counter()
        result = engine.execute(plan)
        executed = time.perf_counter()
        outputs = engine.update(plan, result)
        self.monitor.step_started = None
        step = step_stats(plan, result, scheduled - started, executed - scheduled, executed)
        phases = None
        now = time.monotonic()
        if now - self.last_phases >= PHASES_INTERVAL_S:
            self.last_phases = now
            phases = {rid: engine.request_phase(rid) or "queued" for rid in engine.in_flight_ids()}
        self._send_outputs(outputs, step, phases, engine.take_kv_events())

    def _send_outputs(
        self, outputs: list[RequestOutput], step: Any, phases: Any = None, kv_events: Any = ()
    ) -> None:
        """Gather them, and send what is gathered unless the parent has yet to take the last."""
        self.batch.add(outputs, step, phases, list(kv_events))
        if not self.is_sent_untaken:
            self._send_batch()

    def _handle(self, message: Any) -> None:
        if isinstance(message, AddRequest):
            request = message.request
            if request.sampling_params.structured_outputs is None:
                self._add(request, None)
            else:
                compile_ = self.engine.grammar_compiles.submit(request.sampling_params)
                self.compiling[request.request_id] = (request, compile_)
                compile_.add_done_callback(functools.partial(self._on_compile_done, request))
        elif isinstance(message, _Compiled):
            self._on_compiled(message)
        elif isinstance(message, OutputsTaken):
            self.is_sent_untaken = False
            self._send_batch()
        elif isinstance(message, AbortRequests):
            self._abort(message)
        elif isinstance(message, ResetPrefixCache):
            is_reset = self.engine.reset_prefix_cache()
            if kv_events := self.engine.take_kv_events():
                self._send_outputs([], None, None, kv_events)
            self.send(PrefixCacheReset(message.ticket, is_reset))
        elif isinstance(message, AddLoRA | RemoveLoRA | ListLoRAs | _LoRARead):
            self._lora_call(message)
        elif isinstance(message, Shutdown):
            self.is_stopping = True
        elif isinstance(message, _Malformed):
            logger.error("malformed_message", request_id=message.request_id, cause=message.reason)
            if message.request_id is not None:
                self.send(Added(message.request_id, error="the request did not decode"))

    def _lora_call(self, message: AddLoRA | RemoveLoRA | ListLoRAs | _LoRARead) -> None:
        """LoRA calls between steps; an adapter is read in the loader thread, then added."""
        engine = self.engine
        try:
            if isinstance(message, AddLoRA):
                if engine.is_lora_registered(message.lora_request):
                    self.send(LoRAAnswer(message.ticket, False, sorted(engine.list_loras())))
                    return
                reading = engine.read_lora(message.lora_request)
                reading.add_done_callback(functools.partial(self._on_lora_read, message))
                return
            if isinstance(message, _LoRARead):
                if message.error is not None:
                    raise message.error
                ticket = message.message.ticket
                result = engine.add_lora(message.message.lora_request, message.weights)
            elif isinstance(message, RemoveLoRA):
                ticket, result = message.ticket, engine.remove_lora(message.lora_int_id)
            else:
                ticket, result = message.ticket, True
        except (InvalidRequestError, LoRANotFoundError, LoRAInUseError) as exc:
            ticket = message.message.ticket if isinstance(message, _LoRARead) else message.ticket
            self.send(LoRAAnswer.failed(ticket, exc))
            return
        self.send(LoRAAnswer(ticket, result, sorted(engine.list_loras())))

    def _on_lora_read(self, message: AddLoRA, reading: Any) -> None:
        """In the loader thread: hand the adapter (or why it was refused) to the loop."""
        exc = reading.exception()
        if exc is not None and not isinstance(exc, InvalidRequestError):
            exc = InvalidRequestError("lora_request.lora_path", f"cannot be read: {exc!r}")
        self.commands.put(_LoRARead(message, None if exc else reading.result(), exc))

    def _abort(self, message: AbortRequests) -> None:
        finals = self.engine.abort_request(message.request_ids)
        for request_id in message.request_ids:
            compiling = self.compiling.pop(request_id, None)
            if compiling is not None:
                request, compile_ = compiling
                compile_.cancel()  # dropped if queued; if running, its result is ignored
                finals.append(RequestOutput.aborted(request.request_id, request.sampling_params.n))
        if finals:
            self._send_outputs(finals, None)
        self.send(Aborted(message.ticket, [out.request_id for out in finals]))

    def _on_compile_done(self, request: ValidatedRequest, compile_: GrammarCompile) -> None:
        """In the thread that settled the compile (or cancelled it): hand it to the loop."""
        if compile_.cancelled():  # aborted: the loop knows already
            return
        exc = compile_.exception()
        if exc is None:
            self.commands.put(_Compiled(request, compile_.result(), None, None))
        elif isinstance(exc, InvalidRequestError):
            self.commands.put(_Compiled(request, None, exc, None))
        else:
            self.commands.put(_Compiled(request, None, None, repr(exc)))

    def _on_compiled(self, compiled: _Compiled) -> None:
        request_id = compiled.request.request_id
        compiling = self.compiling.get(request_id)
        if compiling is None or compiling[0] is not compiled.request:  # aborted meanwhile
            return
        del self.compiling[request_id]
        if compiled.error is not None:
            error = compiled.error
            self.send(Added(request_id, error_field=error.field, error=error.description))
        elif compiled.bug is not None:
            logger.error("request_failed", request_id=request_id, cause=compiled.bug)
            self.send(Added(request_id, error=compiled.bug))
        else:
            self._add(compiled.request, compiled.constraint)

    def _add(self, request: ValidatedRequest, constraint: Any) -> None:
        try:
            self.engine.add_validated_request(request, constraint=constraint)
        except Exception as exc:  # an engine bug: that request fails, the others go on
            logger.error("request_failed", request_id=request.request_id, cause=repr(exc))
            self.send(Added(request.request_id, error=repr(exc)))
            return
        is_delta = request.sampling_params.output_kind is RequestOutputKind.DELTA
        self.batch.track(request.request_id, is_delta)
        if request.sampling_params.structured_outputs is not None:
            kind, compile_s = constraint.kind, constraint.compile_s
            self.send(Added(request.request_id, constraint_kind=kind, compile_s=compile_s))
