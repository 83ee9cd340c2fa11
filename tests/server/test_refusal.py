"""A call that comes while admission is full is refused before any work for it (issue 24).

In a burst of 2,000 streams most calls are refused; each one parsed, checked and built into a
SamplingParams and a status before its refusal cost the serving loop ~0.5 ms, which every
other stream waited behind. Refused first, with a status built once, it costs grpc's own part.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from asyncengine.server.options import ServeOptions
from asyncengine.server.servicer_generation import GenerationServicer
from asyncengine.server.state import ServerState
from asyncengine.v1 import generation_pb2 as pb


class _FullEngine:
    """An engine whose one slot is taken."""

    max_num_seqs = 1
    num_requests = 1

    def check_health(self) -> None:
        pass

    def get_tokenizer(self) -> Any:
        return None


class _Aborted(Exception):
    pass


class _Context:
    """What the handler ends the call with, however it does."""

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.trailing_metadata: tuple[Any, ...] = ()

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing: Any = ()) -> None:
        self.code, self.details, self.trailing_metadata = code, details, tuple(trailing)
        raise _Aborted

    async def abort_with_status(self, status: Any) -> None:
        await self.abort(status.code, status.details, status.trailing_metadata)

    def invocation_metadata(self) -> tuple[Any, ...]:
        return ()


def _refuse(servicer: GenerationServicer, request: pb.GenerateRequest) -> _Context:
    context = _Context()
    with pytest.raises(_Aborted):
        asyncio.run(servicer.GenerateStream(request, context))  # type: ignore[arg-type]
    return context


def test_a_call_while_admission_is_full_is_refused_before_its_request_is_read() -> None:
    state = ServerState(_FullEngine(), ServeOptions(max_queued_requests=0))  # type: ignore[arg-type]
    servicer = GenerationServicer(state)
    # no prompt: refused for its content (INVALID_ARGUMENT) had it been read first
    first = _refuse(servicer, pb.GenerateRequest())
    assert first.code == grpc.StatusCode.RESOURCE_EXHAUSTED, (first.code, first.details)
    assert first.details == "1 requests admitted; the limit is 1"
    (binary,) = [value for key, value in first.trailing_metadata if key.endswith("-bin")]
    status = status_pb2.Status.FromString(binary)
    retry = error_details_pb2.RetryInfo()
    assert any(detail.Unpack(retry) for detail in status.details)
    assert retry.retry_delay.ToMilliseconds() == 1000  # --retry-after's default
    # the next refusal reuses the status: nothing is built per refused call
    second = _refuse(servicer, pb.GenerateRequest(text="a prompt"))
    assert second.trailing_metadata[0][1] is first.trailing_metadata[0][1]
