"""RequestStream: one request's outputs, handed from the step loop to its caller."""

from __future__ import annotations

import asyncio

from asyncengine.engine.timers import LazyTimer
from asyncengine.outputs import RequestOutput, merge_deltas


class RequestStream:
    """One request's outputs as the step loop makes them, for its caller to take.

    The step loop never waits for a caller: a CUMULATIVE output replaces the one not yet
    taken (it carries every token of it) and DELTA outputs are merged into one, so a slow
    caller costs one pending output, bounded by its own request's size. DELTAs are merged
    when the caller takes them, all at once: a step's `put` only appends (an engine that
    steps faster than its caller reads puts many per take).
    """

    def __init__(self, request_id: str, is_delta: bool = False, num_samples: int = 1) -> None:
        self.request_id = request_id
        self.is_delta = is_delta
        self.num_samples = num_samples  # SamplingParams.n
        self.prompt: str | None = None  # the text, when the caller sent text
        self.prompt_token_ids: list[int] = []  # set once the prompt is tokenized
        self.core_id: str | None = None  # the core's id for it, once handed to the core
        self._pending: RequestOutput | None = None
        self._later: list[RequestOutput] = []  # DELTAs put after `_pending`, not merged yet
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self.is_finished = False  # the final output, or an error, was put
        self._timed_out = False
        self._timer: LazyTimer | None = None  # made by the first get() with a timeout

    def put(self, out: RequestOutput) -> None:
        if self._error is not None:
            return
        if self.is_delta and self._pending is not None:
            self._later.append(out)
        else:
            self._pending = out
        self.is_finished = out.finished
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        self._error, self._pending = error, None
        self._later.clear()
        self.is_finished = True
        self._ready.set()

    async def get(self, timeout: float | None = None) -> RequestOutput | None:
        """The next output, or None when none came within `timeout` seconds.

        Raises the request's error (invalid, failed, or the engine died) in its place.
        """
        if not self._ready.is_set():
            if timeout is None:
                await self._ready.wait()
            else:
                # one timer per stream, restarted per wait (no task per wait, unlike wait_for,
                # and no timer set and cancelled per output, unlike asyncio.timeout)
                if self._timer is None:
                    self._timer = LazyTimer(self._time_out)
                self._timer.start(timeout)
                try:
                    await self._ready.wait()
                finally:
                    self._timer.stop()
                timed_out, self._timed_out = self._timed_out, False
                if timed_out and self._pending is None and self._error is None:
                    self._ready.clear()
                    return None
        if self._error is not None:
            if self._timer is not None:
                self._timer.close()
            raise self._error
        out, self._pending = self._pending, None
        self._ready.clear()
        assert out is not None
        if self._later:
            merge_deltas(out, self._later)
            self._later.clear()
        if out.finished and self._timer is not None:
            self._timer.close()
        return out

    def _time_out(self) -> None:
        self._timed_out = True
        self._ready.set()
