"""Grammar compiles off the step: a bounded pool, a time limit per spec, dropped when the caller
leaves.

xgrammar (0.2.9) cannot stop a compile once it runs: its `compile_*` calls take no cancel or
timeout hook and run in C++ with the GIL released (the only time limit it has is on the
draft-tree bitmask walk). Nor is a process that could be killed a way out: a compiled grammar
crosses processes only through `serialize_json`, which for a 6.5 MB grammar (2,000 chained
rules, a 512-token vocabulary) wrote 890 MB in 104 s. So each compile is bounded by what is
around it:

- at most `compile_threads` compiles run at once, each in one pool thread (xgrammar's own
  `max_threads` is 1, so the compile runs in that thread), at the process's priority: a
  niced one (+10) starved on a CPU host, whose step keeps every core busy (a 1 CPU-s compile
  took over 10 s at load 12), and one thread leaves the step the other cores;
- a queued compile whose caller left (abort, cancel, deadline) never starts;
- a caller waits at most `max_compile_s` from its compile's start, then gets an error naming
  its field; a compile that outlives its caller runs to its end (the spec's size, at most
  64 KB, bounds that),
  and its grammar is cached, so sending the spec again costs nothing.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import TYPE_CHECKING

from asyncengine.config import StructuredOutputsConfig
from asyncengine.engine.validator import constraint_field
from asyncengine.errors import InvalidRequestError
from asyncengine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from asyncengine.engine.structured_output import CompiledConstraint
    from asyncengine.engine.validator import RequestValidator

GrammarCompile = Future["CompiledConstraint | None"]
Check = Callable[[SamplingParams], "CompiledConstraint | None"]


class GrammarCompiles:
    """The engine's compile pool. `submit` from any thread; cancel the returned future when the
    caller leaves. Counters for the engine's stats are kept here."""

    def __init__(self, validator: RequestValidator, config: StructuredOutputsConfig) -> None:
        # the validator's check is looked up per compile (tests slow it down by replacing it)
        self._validator = validator
        self.max_compile_s = config.max_compile_s
        self._pool = ThreadPoolExecutor(
            config.compile_threads,
            thread_name_prefix="asyncengine-grammar",
        )
        self._lock = threading.Lock()
        self.num_dropped = 0  # callers left before their compile started
        self.num_timed_out = 0  # callers told their compile ran past max_compile_s
        self.busy_s = 0.0  # seconds the pool's threads compiled, for callers or not

    def submit(self, params: SamplingParams) -> GrammarCompile:
        """The compiled constraint of `params`, or `InvalidRequestError` naming its field (one
        that does not compile, or did not within max_compile_s)."""
        outcome: GrammarCompile = Future()
        self._pool.submit(self._run, params, outcome)
        return outcome

    def _run(self, params: SamplingParams, outcome: GrammarCompile) -> None:
        if not outcome.set_running_or_notify_cancel():  # the caller left first: dropped
            with self._lock:
                self.num_dropped += 1
            return
        timer = threading.Timer(self.max_compile_s, self._time_out, (params, outcome))
        timer.daemon = True
        timer.start()
        started = time.perf_counter()
        try:
            _settle(outcome, self._validator.check_structured_outputs, params)
        finally:
            timer.cancel()
            with self._lock:
                self.busy_s += time.perf_counter() - started

    def _time_out(self, params: SamplingParams, outcome: GrammarCompile) -> None:
        assert params.structured_outputs is not None
        error = InvalidRequestError(
            constraint_field(params.structured_outputs),
            f"did not compile in {self.max_compile_s:g} s (max_grammar_compile_s)",
        )
        with contextlib.suppress(InvalidStateError):  # it compiled just in time
            outcome.set_exception(error)
            with self._lock:
                self.num_timed_out += 1

    def shutdown(self) -> None:
        """Drop what is queued; a compile running ends on its own (xgrammar cannot stop it)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _settle(outcome: GrammarCompile, check: Check, params: SamplingParams) -> None:
    """Run `check(params)` into `outcome`, unless the time limit answered first."""
    try:
        result = check(params)
    except BaseException as exc:
        with contextlib.suppress(InvalidStateError):
            outcome.set_exception(exc)
        return
    with contextlib.suppress(InvalidStateError):
        outcome.set_result(result)
