"""Request ids are scoped by tenant: two tenants may use one id at once, neither learns anything
of the other's ids, a tenant's Abort reaches its own requests only, and an operator's (a Control
token) reaches anyone's. Real in-process servers on loopback, real aio clients."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from structlog.testing import capture_logs

from asyncengine.engine.validator import MAX_REQUEST_ID_LEN
from asyncengine.sampling_params import SamplingParams
from asyncengine.server import app
from asyncengine.server.state import engine_request_id
from asyncengine.v1 import control_pb2 as cpb
from asyncengine.v1 import generation_pb2 as pb

from .test_security import bearer, start_server, status_of
from .utils import bad_field, detail, events, greedy_request, read_rest, read_until, stubs

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ALPHA, BETA, OPS = "alpha-token", "beta-token", "ops-token"
FLAGS = ("--auth-token", ALPHA, "--auth-token", BETA, "--control-auth-token", OPS)


def test_engine_ids_are_one_per_tenant_and_id_and_fit_the_engines_bound() -> None:
    longest = "x" * MAX_REQUEST_ID_LEN
    ids = [engine_request_id(t, rid) for t in ("group:a", "group:b") for rid in ("r", longest)]
    assert len(set(ids)) == 4 and all(len(i) <= MAX_REQUEST_ID_LEN for i in ids)
    assert ids[0].startswith("r@") and "group" not in ids[0]  # a digest, not the name
    assert engine_request_id(None, "r") == "r"  # no tenants: one namespace, the caller's ids


def test_tenants_use_the_same_ids_apart_and_abort_only_their_own(
    model_dir: Callable[..., Path],
) -> None:
    async def main() -> dict[str, Any]:
        server, state, target = await start_server(model_dir("llama"), *FLAGS)
        seen: dict[str, Any] = {}
        try:
            async with grpc.aio.insecure_channel(target) as chan:
                generation, control = stubs(chan)

                def stream(token: str, request_id: str) -> Any:
                    request = greedy_request([5, 6], None, request_id=request_id)
                    return generation.GenerateStream(request, metadata=bearer(token))

                async def abort(token: str, *ids: str) -> Any:
                    request = cpb.AbortRequest(request_ids=ids)
                    return await control.Abort(request, metadata=bearer(token))

                calls = [stream(ALPHA, "shared-1"), stream(BETA, "shared-1")]
                calls.append(stream(BETA, "b-secret-1"))
                seen["heads"] = [await read_until(call, "accepted") for call in calls]
                # within one tenant an id in flight is still taken
                seen["duplicate"] = await status_of(stream(BETA, "shared-1"))
                # A probing B's id hears what an unknown id gets, and B's request runs on
                seen["probe"] = await abort(ALPHA, "b-secret-1")
                seen["unknown"] = await abort(ALPHA, "never-sent")
                seen["own"] = await abort(ALPHA, "shared-1")
                seen["alpha_end"] = await read_rest(calls[0])
                seen["left"] = sorted(f.request_id for f in state.flights.values())
                seen["operator"] = await abort(OPS, "b-secret-1", "shared-1")
                seen["beta_ends"] = [await read_rest(call) for call in calls[1:]]
                batch = pb.GenerateBatchRequest(
                    prompts=[pb.Prompt(text="x")], stopping=pb.StoppingOptions(max_new_tokens=2)
                )
                seen["batch"] = await generation.Generate(batch, metadata=bearer(ALPHA))
        finally:
            assert await app.stop(server, state) == 0
        return seen

    with capture_logs() as logs:
        seen = asyncio.run(main())
    assert [head[0].accepted.request_id for head in seen["heads"]] == [
        "shared-1",
        "shared-1",
        "b-secret-1",
    ]
    duplicate = seen["duplicate"]
    assert duplicate.code() == grpc.StatusCode.ALREADY_EXISTS
    assert detail(duplicate, error_details_pb2.ErrorInfo).reason == "DUPLICATE_REQUEST_ID"
    assert "'shared-1'" in duplicate.details() and "@" not in duplicate.details()
    assert list(seen["probe"].aborted_ids) == list(seen["unknown"].aborted_ids) == []
    assert list(seen["own"].aborted_ids) == ["shared-1"]
    assert seen["alpha_end"][-2].finished.reason == pb.CANCELLED
    assert seen["left"] == ["b-secret-1", "shared-1"]  # alpha's abort took only alpha's
    assert sorted(seen["operator"].aborted_ids) == ["b-secret-1", "shared-1"]
    for end in seen["beta_ends"]:
        assert end[-2].finished.reason == pb.CANCELLED and events(end)[-1] == "usage"
    assert "@" not in seen["batch"].results[0].request_id  # the caller's id, not the engine's
    # each tenant's line names its own id and its tenant; no line carries the engine's id
    lines = [line for line in logs if line["event"] == "request_finished"]
    shared = [line for line in lines if line["request_id"] == "shared-1"]
    tenants = {line["tenant"] for line in shared}
    assert len(tenants) == 2 and None not in tenants
    assert all(line["tenant"] and "@" not in line["request_id"] for line in lines), lines


def test_an_engine_id_in_use_is_already_exists_named_by_the_callers_id(
    model_dir: Callable[..., Path],
) -> None:
    """The engine's own DuplicateRequestError (its id taken by a caller of the engine itself)
    is ALREADY_EXISTS, as the server's own check is, and names the caller's id alone."""

    async def main() -> grpc.aio.AioRpcError:
        server, state, target = await start_server(model_dir("llama"), *FLAGS)
        try:
            tenant = state.tenants.identity(bearer(ALPHA))
            taken = engine_request_id(tenant, "taken-1")
            await state.engine.add_request(taken, [5, 6], SamplingParams(max_tokens=500))
            async with grpc.aio.insecure_channel(target) as chan:
                request = greedy_request([5, 6], 2, request_id="taken-1")
                call = stubs(chan)[0].GenerateStream(request, metadata=bearer(ALPHA))
                error = await status_of(call)
            await state.engine.abort(taken)
        finally:
            assert await app.stop(server, state) == 0
        return error

    error = asyncio.run(main())
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS, error
    assert detail(error, error_details_pb2.ErrorInfo).reason == "DUPLICATE_REQUEST_ID"
    assert "'taken-1'" in error.details() and "@" not in error.details()


def test_min_tokens_past_the_context_is_refused_naming_the_field(
    model_dir: Callable[..., Path],
) -> None:
    async def main() -> list[grpc.aio.AioRpcError]:
        server, state, target = await start_server(model_dir("llama"), "--max-model-len", "256")
        try:
            async with grpc.aio.insecure_channel(target) as chan:
                generation, _ = stubs(chan)
                errors = []
                for min_new_tokens in (10**9, 255):  # 255 + the prompt's 2 tokens > 256
                    stopping = pb.StoppingOptions(min_new_tokens=min_new_tokens)
                    request = greedy_request([5, 6], None, stopping=stopping)
                    errors.append(await status_of(generation.GenerateStream(request)))
                fits = greedy_request([5, 6], 3, stopping=pb.StoppingOptions(min_new_tokens=3))
                assert events(await read_rest(generation.GenerateStream(fits)))[-1] == "usage"
        finally:
            assert await app.stop(server, state) == 0
        return errors

    for error in asyncio.run(main()):
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert bad_field(error) == "stopping.min_new_tokens"
        assert "context length" in error.details()


def test_a_tenants_id_is_bounded_as_the_engines_own(model_dir: Callable[..., Path]) -> None:
    """A tenant's id of MAX_REQUEST_ID_LEN is taken (its scope never pushes it past the
    engine's bound); one character more is refused, naming request_id."""

    async def main() -> tuple[list[Any], grpc.aio.AioRpcError]:
        server, state, target = await start_server(model_dir("llama"), *FLAGS)
        try:
            async with grpc.aio.insecure_channel(target) as chan:
                generation, _ = stubs(chan)
                longest = greedy_request([5, 6], 2, request_id="y" * MAX_REQUEST_ID_LEN)
                served = await read_rest(generation.GenerateStream(longest, metadata=bearer(BETA)))
                over = greedy_request([5, 6], 2, request_id="y" * (MAX_REQUEST_ID_LEN + 1))
                error = await status_of(generation.GenerateStream(over, metadata=bearer(BETA)))
        finally:
            assert await app.stop(server, state) == 0
        return served, error

    served, error = asyncio.run(main())
    assert served[0].accepted.request_id == "y" * MAX_REQUEST_ID_LEN
    assert events(served)[-1] == "usage"
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and bad_field(error) == "request_id"
