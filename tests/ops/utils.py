"""Small gRPC helpers over the generated stubs (the server tests have their own)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from asyncengine.v1 import control_pb2_grpc, generation_pb2_grpc
from asyncengine.v1 import generation_pb2 as pb


def stubs(channel: Any) -> tuple[generation_pb2_grpc.GenerationStub, control_pb2_grpc.ControlStub]:
    return generation_pb2_grpc.GenerationStub(channel), control_pb2_grpc.ControlStub(channel)


def greedy_request(prompt: Sequence[int], max_new_tokens: int | None, **kwargs: Any) -> Any:
    """A greedy GenerateRequest over token ids that ignores eos (so lengths are exact)."""
    stopping = pb.StoppingOptions(ignore_eos=True)
    if max_new_tokens is not None:
        stopping.max_new_tokens = max_new_tokens
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingOptions(temperature=0.0),
        stopping=stopping,
        **kwargs,
    )


async def read_until(call: Any, kind: str) -> list[pb.GenerateResponse]:
    """Read an aio stream up to and including its first `kind` event."""
    responses = [await call.read()]
    while responses[-1].WhichOneof("event") != kind:
        responses.append(await call.read())
    return responses


async def read_rest(call: Any) -> list[pb.GenerateResponse]:
    """The remaining responses of an aio stream read with `read()`."""
    responses = []
    while (response := await call.read()) != grpc.aio.EOF:
        responses.append(response)
    return responses
