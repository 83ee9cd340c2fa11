"""The engine process's side: its main (`run_engine_core`), its loop, and what crosses the pipe.

`ProcessAsyncLLMEngine` (engine/process_engine.py) starts it. The child owns the `LLMEngine`
(scheduler, KV cache, model, detokenizer) and steps as fast as it can; the parent keeps the
front door (validation, tokenizing, the streams, the observer) and gets each step's outputs
in one message. The two share nothing but a pipe:

    parent -> child   ADD (a validated request), ABORT (ids, a ticket), STOP
    child -> parent   READY (what the parent needs to validate), STEP (a step's outputs and
                      figures), ADDED (a constrained request's grammar compiled, or why not),
                      ABORTED (the aborted requests' final outputs), FAILED (why it died)

The child reads the pipe in a thread of its own, so neither side ever blocks the other on a
full pipe. Outputs cross as plain tuples (pickling the dataclasses costs ~10x more). The child
is spawned, not forked: it imports what it needs and builds the engine from `CoreFactory`.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from asyncengine.config import EngineArgs
from asyncengine.core.request import FinishReason
from asyncengine.engine.llm_engine import LLMEngine
from asyncengine.engine.request_stream import RequestStream
from asyncengine.engine.validator import ValidatedRequest
from asyncengine.errors import InvalidRequestError
from asyncengine.logging import get_logger
from asyncengine.outputs import CompletionOutput, RequestMetrics, RequestOutput

logger = get_logger(__name__)

# builds the child's engine; must be picklable (a module-level function, or a partial of one)
CoreFactory = Callable[[EngineArgs], LLMEngine]

# the messages, each a tuple whose first item says which
READY, STEP, ADDED, ABORTED, FAILED = range(5)  # child -> parent
ADD, ABORT, STOP, COMPILED = range(4)  # parent -> child (COMPILED: the child's own)

PHASES_INTERVAL_S = 0.25  # how often a STEP carries every request's phase (for heartbeats)
IDLE_HEALTH_CHECK_S = 0.5  # how often an idle child checks its model (tensor-parallel workers)


# -- outputs as tuples ----------------------------------------------------------------------


def encode_output(out: RequestOutput) -> tuple[Any, ...]:
    """`out` as builtins only, without its prompt (the parent's stream has it)."""
    m = out.metrics
    metrics = None
    if m is not None:
        metrics = (
            m.arrival_time,
            m.first_scheduled_time,
            m.first_token_time,
            m.finished_time,
            m.num_preemptions,
            m.num_cached_tokens,
            m.num_output_tokens,
        )
    samples = [
        (
            c.index,
            c.text,
            c.token_ids,
            c.logprobs,
            None if c.finish is None else c.finish.value,
            c.stop_reason,
        )
        for c in out.outputs
    ]
    return (out.request_id, samples, out.finished, out.error, metrics, out.prompt_logprobs)


def decode_output(encoded: tuple[Any, ...], stream: RequestStream) -> RequestOutput:
    request_id, samples, finished, error, metrics, prompt_logprobs = encoded
    return RequestOutput(
        request_id,
        stream.prompt,
        stream.prompt_token_ids,
        [
            CompletionOutput(i, text, ids, lp, None if f is None else FinishReason(f), stop)
            for i, text, ids, lp, f, stop in samples
        ],
        finished,
        error,
        None if metrics is None else RequestMetrics(*metrics),
        prompt_logprobs,
    )


def _stats_tuple(engine: LLMEngine) -> tuple[Any, ...]:
    return tuple(vars(engine.get_stats()).values())


# -- the child ------------------------------------------------------------------------------


def run_engine_core(
    factory: CoreFactory,
    args: EngineArgs,
    conn: Connection,
    settings: tuple[str, bool] | None,
    torch_threads: int | None,
    step_timeout_s: float,
) -> None:
    """The child's main: build the engine, say READY, then step until STOP or the pipe ends."""
    from asyncengine.logging import configure_logging

    if settings is not None:
        configure_logging(*settings)
    # the parent owns the lifecycle: a Ctrl-C or a SIGTERM to the whole group (systemd's
    # default) must not end the steps under a drain; STOP or the pipe's end does
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    send_lock = threading.Lock()

    def send(message: tuple[Any, ...]) -> None:
        with send_lock:
            conn.send(message)

    try:
        if torch_threads:
            import torch

            torch.set_num_threads(torch_threads)
        engine = factory(args)
    except BaseException as exc:
        _send_failure(send, f"the engine did not start: {exc!r}", traceback.format_exc(), exc)
        return
    send(
        (
            READY,
            engine.config,
            engine.vocab_size,
            engine.eos_token_ids,
            engine.block_manager.num_gpu_blocks,
            _stats_tuple(engine),
        )
    )
    core = _Core(engine, conn, send, step_timeout_s)
    try:
        core.run()
    except BaseException as exc:
        logger.error("engine_core_failed", cause=repr(exc), exc_info=exc)
        _send_failure(send, repr(exc), traceback.format_exc(), exc)
    finally:
        engine.shutdown()


def _send_failure(
    send: Callable[[tuple[Any, ...]], None], words: str, trace: str, exc: BaseException
) -> None:
    """FAILED with the exception itself, so the parent raises (or dies of) what happened here;
    its words alone if it does not pickle."""
    try:
        pickle.loads(pickle.dumps(exc))  # one that does not come back whole is not sent
        send((FAILED, words, trace, exc))
    except Exception:
        send((FAILED, words, trace, None))


class _Core:
    """The child's loop: take commands between steps, step while there is work."""

    def __init__(
        self,
        engine: LLMEngine,
        conn: Connection,
        send: Callable[[tuple[Any, ...]], None],
        step_timeout_s: float,
    ) -> None:
        self.engine = engine
        self.send = send
        self.step_timeout_s = step_timeout_s
        self.commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.grammar_pool = ThreadPoolExecutor(2, thread_name_prefix="asyncengine-grammar")
        # constrained requests being compiled, by id: the ticket of their ADD (an aborted one
        # is dropped from here, and its compile when it finishes)
        self.compiling: dict[str, tuple[int, ValidatedRequest]] = {}
        self.stopping = False
        self.step_started: float | None = None
        self.last_phases = 0.0
        threading.Thread(target=self._read, args=(conn,), name="core-reader", daemon=True).start()
        threading.Thread(target=self._watch, name="core-watchdog", daemon=True).start()

    def _read(self, conn: Connection) -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the parent is gone: stop
                self.commands.put((STOP,))
                return
            self.commands.put(message)

    def _watch(self) -> None:
        """A step that hangs past the timeout kills the child: the parent sees it die."""
        while True:
            time.sleep(min(1.0, self.step_timeout_s / 4))
            started = self.step_started
            if started is not None and time.monotonic() - started > self.step_timeout_s:
                self.send((FAILED, f"a step took longer than {self.step_timeout_s} s", "", None))
                os._exit(1)

    def run(self) -> None:
        engine = self.engine
        while not self.stopping:
            if not engine.has_unfinished_requests():
                engine.check_every_block_came_back()
                self._handle(self._next_command_when_idle())
            while not self.stopping:
                try:
                    self._handle(self.commands.get_nowait())
                except queue.Empty:
                    break
            if not self.stopping and engine.has_unfinished_requests():
                self._step()
        self.compiling.clear()
        engine.abort_request(engine.in_flight_ids())

    def _next_command_when_idle(self) -> tuple[Any, ...]:
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
        self.step_started = time.monotonic()
        plan = engine.schedule()
        scheduled = time.perf_counter()
        result = engine.execute(plan)
        executed = time.perf_counter()
        outputs = engine.update(plan, result)
        self.step_started = None
        stats = (
            scheduled - started,
            executed - scheduled,
            time.perf_counter() - executed,
            len(result.sampled_token_ids),
            len(plan.blocks_to_swap_out),
            len(plan.blocks_to_swap_in),
        )
        phases = None
        now = time.monotonic()
        if now - self.last_phases >= PHASES_INTERVAL_S:
            self.last_phases = now
            phases = {rid: engine.request_phase(rid) for rid in engine.in_flight_ids()}
        encoded = [encode_output(out) for out in outputs]
        self.send((STEP, encoded, stats, _stats_tuple(engine), phases))

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == ADD:
            _, ticket, validated = message
            if validated.sampling_params.structured_outputs is None:
                self._add(ticket, validated, None)
            else:
                self.compiling[validated.request_id] = (ticket, validated)
                self.grammar_pool.submit(self._compile, ticket, validated)
        elif kind == COMPILED:
            _, ticket, validated, constraint, error = message
            request_id = validated.request_id
            entry = self.compiling.get(request_id)
            if entry is None or entry[0] != ticket:  # aborted while compiling
                self.send((ADDED, ticket, request_id, "aborted", None, None))
                return
            del self.compiling[request_id]
            if error is not None:
                self.send((ADDED, ticket, request_id, error, None, None))
            else:
                self._add(ticket, validated, constraint)
        elif kind == ABORT:
            _, ticket, request_ids = message
            for request_id in request_ids:
                self.compiling.pop(request_id, None)  # its compile is dropped when done
            finals = [encode_output(out) for out in self.engine.abort_request(request_ids)]
            # a request the child never queued gets no final here: the parent makes it
            self.send((ABORTED, ticket, request_ids, finals, _stats_tuple(self.engine)))
        elif kind == STOP:
            self.stopping = True

    def _compile(self, ticket: int, validated: ValidatedRequest) -> None:
        try:
            constraint = self.engine.validator.check_structured_outputs(validated.sampling_params)
        except InvalidRequestError as exc:
            self.commands.put((COMPILED, ticket, validated, None, (exc.field, exc.description)))
        except Exception as exc:
            self.commands.put((COMPILED, ticket, validated, None, (None, repr(exc))))
        else:
            self.commands.put((COMPILED, ticket, validated, constraint, None))

    def _add(self, ticket: int, validated: ValidatedRequest, constraint: Any) -> None:
        try:
            self.engine.add_validated_request(validated, constraint=constraint)
        except Exception as exc:  # an engine bug: that request fails, the others go on
            logger.error("request_failed", request_id=validated.request_id, cause=repr(exc))
            self.send((ADDED, ticket, validated.request_id, (None, repr(exc)), None, None))
            return
        if constraint is not None:
            self.send(
                (ADDED, ticket, validated.request_id, None, constraint.kind, constraint.compile_s)
            )
