"""LazyTimer (the stall and heartbeat timers of every stream) and RequestStream.get's timeout."""

from __future__ import annotations

import asyncio

from asyncengine.engine.request_stream import RequestStream
from asyncengine.engine.timers import LazyTimer
from asyncengine.outputs import RequestOutput


async def fired_at(timer_delays: list[float], stop_after: float | None = None) -> list[float]:
    """Start a timer with each delay in turn, 10 ms apart; when (since the first start) it
    fired, if at all, within 1 s."""
    loop = asyncio.get_running_loop()
    fired: list[float] = []
    started = loop.time()
    timer = LazyTimer(lambda: fired.append(loop.time() - started))
    for delay in timer_delays:
        timer.start(delay)
        await asyncio.sleep(0.01)
    if stop_after is not None:
        await asyncio.sleep(stop_after)
        timer.stop()
    await asyncio.sleep(1.0)
    timer.close()
    return fired


def test_it_fires_once_after_the_last_start_not_the_first() -> None:
    # restarted for 0.2 s at 0.04 s: due at ~0.24 s, not at 0.2 s after the first start
    fired = asyncio.run(fired_at([0.2, 0.2, 0.2, 0.2, 0.2]))
    assert len(fired) == 1 and fired[0] >= 0.24


def test_an_earlier_deadline_is_not_kept_waiting_for_a_later_one() -> None:
    fired = asyncio.run(fired_at([0.8, 0.05]))
    assert len(fired) == 1 and 0.05 <= fired[0] < 0.5


def test_stopped_it_never_fires() -> None:
    assert asyncio.run(fired_at([0.1], stop_after=0.0)) == []


def test_close_leaves_no_timer_scheduled() -> None:
    async def main() -> int:
        loop = asyncio.get_running_loop()
        timer = LazyTimer(lambda: None)
        timer.start(30)
        timer.close()
        scheduled = loop._scheduled  # type: ignore[attr-defined]
        return sum(not handle.cancelled() for handle in scheduled)

    assert asyncio.run(main()) == 0


def output(finished: bool) -> RequestOutput:
    return RequestOutput("r", None, [1], [], finished)


def test_get_times_out_with_none_then_still_gets_what_comes() -> None:
    async def main() -> list[object]:
        stream = RequestStream("r")
        got: list[object] = [await stream.get(0.05), await stream.get(0)]
        asyncio.get_running_loop().call_later(0.05, stream.put, output(False))
        got.append(await stream.get(5))  # waits for the put, not the 5 s
        stream.put(output(True))
        got.append(await stream.get(0.05))  # ready: no wait at all
        return got

    none, zero, first, last = asyncio.run(main())
    assert none is None and zero is None
    assert isinstance(first, RequestOutput) and not first.finished
    assert isinstance(last, RequestOutput) and last.finished
