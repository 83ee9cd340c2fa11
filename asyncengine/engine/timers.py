"""A timer cheap to restart, for deadlines that move on every message of a stream."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class LazyTimer:
    """Calls `callback` once `delay` seconds pass after the last `start`, unless `stop` came first.

    Restarting only moves the deadline: the loop timer under it is replaced only for an earlier
    deadline, and one that fires early sleeps again for the rest. A stream that restarts its
    stall or heartbeat timer on every message so costs the loop about one timer per period, not
    one per message (an `asyncio.timeout` scope costs ~4 us: a timer set and cancelled).
    """

    def __init__(self, callback: Callable[[], None]) -> None:
        """Made on the event loop it times (each lookup of the running loop is a getpid call)."""
        self._callback = callback
        self._loop = asyncio.get_running_loop()
        self._deadline: float | None = None  # loop time the callback is due; None: stopped
        self._handle: asyncio.TimerHandle | None = None
        self._handle_at = 0.0

    def start(self, delay: float) -> None:
        self._deadline = deadline = self._loop.time() + delay
        if self._handle is None or self._handle_at > deadline:
            self._arm(deadline)

    def stop(self) -> None:
        """Nothing is called until the next `start` (the loop timer may still fire, idle)."""
        self._deadline = None

    def close(self) -> None:
        """Stop, and let go of the loop timer: nothing is left scheduled."""
        self._deadline = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _arm(self, when: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle, self._handle_at = self._loop.call_at(when, self._fire), when

    def _fire(self) -> None:
        self._handle = None
        deadline = self._deadline
        if deadline is None:
            return
        if self._loop.time() < deadline:  # restarted since this timer was set
            self._arm(deadline)
            return
        self._deadline = None
        self._callback()
