"""Following one request's engine stream with a clock: heartbeats, time limits, clean exits."""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import AsyncGenerator
from typing import Any, cast

from asyncengine.engine.async_llm_engine import AsyncLLMEngine
from asyncengine.outputs import RequestOutput
from asyncengine.server import convert
from asyncengine.server.convert import FinishReason
from asyncengine.server.state import Flight, ServerState
from asyncengine.v1 import generation_pb2


class EngineStream:
    """`engine.generate` for one request, read with timeouts that never cancel the read.

    A timed-out `wait_for` would cancel the generator and so abort the request; instead the
    pending read is a task that outlives each wait.
    """

    def __init__(self, engine: AsyncLLMEngine, flight: Flight) -> None:
        gen = engine.generate(
            flight.prompt_token_ids,
            flight.params,
            flight.request_id,
            flight.priority,
            cache_salt=flight.cache_salt,
        )
        self._gen = cast(AsyncGenerator[RequestOutput, None], gen)
        self._next: asyncio.Task[RequestOutput] | None = None

    async def start(self) -> None:
        """Hand the request to the engine now; raises its validation error, if any."""
        self._next = self._spawn_read()
        # the task runs first (it was queued before us): the engine has the request on return
        await asyncio.sleep(0)
        if self._next.done():
            self._next.result()  # raises if the engine refused the request

    async def next(self, timeout: float | None) -> RequestOutput | None:
        """The next cumulative output, or None if none came within `timeout` seconds."""
        assert self._next is not None, "start() first, and not after the final output"
        done, _ = await asyncio.wait({self._next}, timeout=timeout)
        if not done:
            return None
        out = self._next.result()
        self._next = None if out.finished else self._spawn_read()
        return out

    async def close(self) -> None:
        """Stop reading; the engine aborts the request if it had not finished."""
        if self._next is not None:
            self._next.cancel()
            await asyncio.gather(self._next, return_exceptions=True)
            self._next = None
        await self._gen.aclose()

    def _spawn_read(self) -> asyncio.Task[RequestOutput]:
        # an empty context: the engine's step loop may start inside this task, and would
        # otherwise carry this request's log context (its request_id) into every later line
        return contextvars.Context().run(asyncio.create_task, self._read())

    async def _read(self) -> RequestOutput:
        return await self._gen.__anext__()


async def follow(
    state: ServerState, flight: Flight, stream: EngineStream, heartbeat_s: float | None
) -> AsyncGenerator[RequestOutput | None, None]:
    """Yield each new output until the final one, and None after `heartbeat_s` of silence.

    Enforces the flight's time limit: past it the request is aborted and ends TIME_LIMIT.
    """
    deadline = None
    if flight.time_limit_s is not None:
        deadline = time.monotonic() + flight.time_limit_s
    while True:
        timeout = heartbeat_s
        if deadline is not None:
            left = max(0.0, deadline - time.monotonic())
            timeout = left if timeout is None else min(timeout, left)
        out = await stream.next(timeout)
        if out is not None:
            yield out
            if out.finished:
                return
        elif deadline is not None and time.monotonic() >= deadline:
            deadline = None  # the final output (finish reason "abort") comes next
            state.abort([flight.request_id], FinishReason.TIME_LIMIT)
        else:
            yield None


class DeltaTracker:
    """Turns cumulative outputs into deltas: only what the client has not seen yet."""

    def __init__(self, flight: Flight, num_top_logprobs: int | None, return_token_ids: bool):
        self.flight = flight
        self.num_top_logprobs = num_top_logprobs
        self.return_token_ids = return_token_ids
        self.text_len = 0
        self.num_tokens = 0

    def delta(
        self, out: RequestOutput, sequence_number: int, tokenizer: Any, sample: int = 0
    ) -> generation_pb2.Delta | None:
        completion = out.outputs[sample]
        text = completion.text[self.text_len :]
        token_ids = completion.token_ids[self.num_tokens :]
        if not text and not token_ids:
            return None
        msg = generation_pb2.Delta(
            sample_index=completion.index,
            sequence_number=sequence_number,
            token_offset=self.num_tokens,
            text=text,
            completion_tokens=len(completion.token_ids),
        )
        if self.return_token_ids:
            msg.token_ids.extend(token_ids)
        if self.num_top_logprobs is not None and completion.logprobs is not None:
            entries = completion.logprobs[self.num_tokens :]
            msg.logprobs.extend(
                convert.logprobs(entries, token_ids, self.num_top_logprobs, tokenizer)
            )
        self.text_len = max(self.text_len, len(completion.text))
        self.num_tokens = len(completion.token_ids)
        return msg
