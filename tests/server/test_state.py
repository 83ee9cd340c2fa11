"""ServerState on its own: admission slots come back however a call ends."""

from __future__ import annotations

import asyncio
from typing import Any

from asyncengine.server.options import ServeOptions
from asyncengine.server.state import Flight, ServerState


class _SlowAbortEngine:
    """An engine whose abort answers only when told (as one in its own process answers after
    its step)."""

    max_num_seqs = 4
    num_requests = 0

    def __init__(self) -> None:
        self.answer = asyncio.Event()

    def check_health(self) -> None:
        pass

    async def abort(self, request_id: Any) -> list[str]:
        await self.answer.wait()
        return []


def test_a_handler_cancelled_while_its_abort_is_answered_still_gives_its_slot_back() -> None:
    async def main() -> None:
        engine = _SlowAbortEngine()
        state = ServerState(engine, ServeOptions())  # type: ignore[arg-type]
        flight = Flight("r1")
        state.admit([flight])
        state.entered()
        releasing = asyncio.create_task(state.release(flight))
        await asyncio.sleep(0)
        releasing.cancel()  # the call's handler is cancelled again, mid-release
        await asyncio.gather(releasing, return_exceptions=True)
        assert "r1" not in state.flights and state.num_admitted == 0
        await asyncio.wait_for(state._idle.wait(), 1)  # a drain would not wait for it

    asyncio.run(main())
