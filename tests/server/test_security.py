"""TLS, mutual TLS, bearer tokens, admission limits and Drain.

Each test builds a real server on loopback from `asyncengine serve` flags, in this process (the
engine loads in milliseconds once its imports are warm, a new process takes ~10 s), and talks
to it with real aio clients. The serve subprocess itself is covered by test_generation.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from asyncengine.engine.async_llm_engine import AsyncLLMEngine
from asyncengine.server import app
from asyncengine.server.cli import build_parser, engine_args_from
from asyncengine.server.options import check_options, serve_options_from
from asyncengine.v1 import control_pb2 as cpb
from asyncengine.v1 import generation_pb2 as pb

from .certs import Pem, issue, make_ca
from .utils import (
    NOT_SERVING,
    SERVING,
    bad_field,
    detail,
    events,
    greedy_request,
    read_rest,
    read_until,
    stubs,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TOKENS = ("alpha-token", "beta-token")
CONTROL_TOKEN = "ops-token"
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A CA with a server and a client certificate, and a rogue CA with a client of its own."""
    ca, rogue_ca = make_ca("test-ca"), make_ca("rogue-ca")
    server = issue(ca, "localhost", is_server=True)
    folder = tmp_path_factory.mktemp("pki")
    (folder / "ca.pem").write_bytes(ca[0].cert)
    (folder / "server.pem").write_bytes(server.cert)
    (folder / "server.key").write_bytes(server.key)
    return {
        "dir": folder,
        "ca": ca[0],
        "client": issue(ca, "client", is_server=False),
        "rogue": issue(rogue_ca, "rogue", is_server=False),
        "rogue_ca": rogue_ca[0],
    }


@pytest.fixture
def serving(model_dir: Callable[..., Path]) -> Callable[..., Any]:
    """`async with serving(*serve_flags) as target`: a started server, stopped on exit."""

    @contextlib.asynccontextmanager
    async def serve(*flags: str) -> AsyncIterator[str]:
        argv = ["serve", "--model", str(model_dir("llama")), "--host", "127.0.0.1"]
        argv += ["--port", "0", "--device", "cpu", "--num-gpu-blocks-override", "512"]
        argv += ["--num-cpu-blocks-override", "16", "--drain-grace-period", "1.0", *flags]
        ns = build_parser().parse_args(argv)
        options = serve_options_from(ns)
        check_options(options)
        engine = AsyncLLMEngine.from_engine_args(engine_args_from(ns))
        server, state, port = await app.start(engine, options)
        try:
            yield f"127.0.0.1:{port}"
        finally:
            assert await app.stop(server, state) == 0

    return serve


def channel(target: str, root: bytes | None = None, client: Pem | None = None) -> Any:
    if root is None:
        return grpc.aio.insecure_channel(target)
    credentials = grpc.ssl_channel_credentials(
        root, client.key if client else None, client.cert if client else None
    )
    return grpc.aio.secure_channel(target, credentials)


async def tokenize(target: str, metadata: Any = None, **credentials: Any) -> Any:
    async with channel(target, **credentials) as chan:
        request = pb.TokenizeRequest(texts=["안녕"])
        return await stubs(chan)[0].Tokenize(request, metadata=metadata, timeout=10)


async def status_of(call: Any) -> grpc.aio.AioRpcError:
    """The error a call (awaitable, or a stream to read) ends with."""
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await (read_rest(call) if hasattr(call, "read") else call)
    return error.value


def test_tls_accepts_trusting_clients_and_refuses_others(serving: Any, pki: dict[str, Any]) -> None:
    folder = pki["dir"]

    async def main() -> None:
        flags = ["--tls-cert", str(folder / "server.pem"), "--tls-key", str(folder / "server.key")]
        async with serving(*flags) as target:
            assert (await tokenize(target, root=pki["ca"].cert)).results[0].token_count > 0
            plaintext = await status_of(tokenize(target))
            untrusted = await status_of(tokenize(target, root=pki["rogue_ca"].cert))
        assert plaintext.code() == untrusted.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(main())


def test_mutual_tls_requires_a_client_certificate_from_the_ca(
    serving: Any, pki: dict[str, Any]
) -> None:
    folder = pki["dir"]
    flags = ["--tls-cert", str(folder / "server.pem"), "--tls-key", str(folder / "server.key")]
    flags += ["--tls-client-ca", str(folder / "ca.pem")]

    async def main() -> None:
        root = pki["ca"].cert
        async with serving(*flags) as target:
            reply = await tokenize(target, root=root, client=pki["client"])
            assert reply.results[0].token_count > 0
            anonymous = await status_of(tokenize(target, root=root))
            rogue = await status_of(tokenize(target, root=root, client=pki["rogue"]))
        assert anonymous.code() == rogue.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(main())


def test_bearer_tokens_guard_every_service_but_health(serving: Any) -> None:
    flags = ["--auth-token", TOKENS[0], "--auth-token", TOKENS[1]]
    flags += ["--control-auth-token", CONTROL_TOKEN]

    async def main() -> None:
        async with serving(*flags) as target, channel(target) as chan:
            generation, control = stubs(chan)
            for token in TOKENS:
                assert (await tokenize(target, bearer(token))).results[0].token_count > 0
            for metadata in (None, bearer("wrong"), [("authorization", TOKENS[0])]):
                error = await status_of(tokenize(target, metadata))
                assert error.code() == UNAUTHENTICATED
                assert detail(error, error_details_pb2.ErrorInfo).reason == "UNAUTHENTICATED"
            stream = generation.GenerateStream(greedy_request("x", 2))
            assert (await status_of(stream)).code() == UNAUTHENTICATED
            # Control takes its own token only
            info = cpb.GetServerInfoRequest()
            denied = control.GetServerInfo(info, metadata=bearer(TOKENS[0]))
            assert (await status_of(denied)).code() == UNAUTHENTICATED
            assert (await control.GetServerInfo(info, metadata=bearer(CONTROL_TOKEN))).version
            # health stays open for probes; reflection (a bidi stream) needs a token
            health = health_pb2_grpc.HealthStub(chan)
            assert (await health.Check(health_pb2.HealthCheckRequest())).status == SERVING
            reflection = reflection_pb2_grpc.ServerReflectionStub(chan)
            ask = reflection_pb2.ServerReflectionRequest(list_services="")
            refused = reflection.ServerReflectionInfo(iter([ask]))
            assert (await status_of(refused)).code() == UNAUTHENTICATED
            allowed = reflection.ServerReflectionInfo(iter([ask]), metadata=bearer(TOKENS[1]))
            (reply,) = [r async for r in allowed]
            assert len(reply.list_services_response.service) >= 2

    asyncio.run(main())


def test_admission_limit_gives_resource_exhausted_with_retry_info(serving: Any) -> None:
    """max-num-seqs 2 + max-queued-requests 1: a fourth request is refused, not queued."""
    flags = ["--max-num-seqs", "2", "--max-queued-requests", "1", "--retry-after", "0.5"]

    async def main() -> None:
        async with serving(*flags) as target, channel(target) as chan:
            generation, control = stubs(chan)
            ids = [f"long-{i}" for i in range(3)]
            calls = [
                generation.GenerateStream(greedy_request([5, 6], None, request_id=i)) for i in ids
            ]
            for call in calls:
                await read_until(call, "accepted")
            refused = await status_of(generation.GenerateStream(greedy_request("x", 2)))
            batch = pb.GenerateBatchRequest(prompts=[pb.Prompt(text="x")])
            refused_batch = await status_of(generation.Generate(batch))
            reply = await control.Abort(cpb.AbortRequest(request_ids=ids))
            ends = [await read_rest(call) for call in calls]
            after = await read_rest(generation.GenerateStream(greedy_request("x", 2)))
        for error in (refused, refused_batch):
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            retry = detail(error, error_details_pb2.RetryInfo)
            assert retry.retry_delay.ToMilliseconds() == 500
        assert sorted(reply.aborted_ids) == ids
        for end in ends:
            assert end[-2].finished.reason == pb.CANCELLED and events(end)[-1] == "usage"
        assert events(after)[-1] == "usage"

    asyncio.run(main())


def test_drain_finishes_short_requests_aborts_long_ones_and_stops_admission(
    serving: Any,
) -> None:
    async def main() -> None:
        async with serving() as target, channel(target) as chan:
            generation, control = stubs(chan)
            short = generation.GenerateStream(greedy_request([7, 8], 20))
            long = generation.GenerateStream(greedy_request([7, 9], None))  # ~2000 tokens
            heads = [await read_until(call, "delta") for call in (short, long)]
            drain = control.Drain(cpb.DrainRequest(grace_period_ms=1000))  # the call starts now
            ends = [await read_rest(call) for call in (short, long)]
            drained = await drain
            refused = await status_of(generation.GenerateStream(greedy_request("x", 2)))
            info = await control.GetServerInfo(cpb.GetServerInfoRequest())
            health = health_pb2_grpc.HealthStub(chan)
            status = (await health.Check(health_pb2.HealthCheckRequest(service=""))).status
        short_end, long_end = (h + e for h, e in zip(heads, ends))
        assert short_end[-2].finished.reason == pb.LENGTH
        assert long_end[-2].finished.reason == pb.ABORTED_BY_SERVER
        assert events(short_end)[-1] == events(long_end)[-1] == "usage"
        assert drained.aborted == 1
        assert refused.code() == grpc.StatusCode.UNAVAILABLE
        assert detail(refused, error_details_pb2.ErrorInfo).reason == "DRAINING"
        assert info.draining and info.load.running == 0
        assert info.load.gpu_blocks_free == info.load.gpu_blocks_total
        assert status == NOT_SERVING

    asyncio.run(main())


def test_prompt_larger_than_the_kv_cache_is_refused_before_acceptance(serving: Any) -> None:
    async def main() -> None:
        async with serving("--num-gpu-blocks-override", "4") as target, channel(target) as chan:
            generation, _ = stubs(chan)
            call = generation.GenerateStream(greedy_request([5] * 65, 2))  # the cache holds 64
            error = await status_of(call)
            fits = await read_rest(generation.GenerateStream(greedy_request([5] * 30, 2)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad_field(error) == "token_ids"
        assert events(fits)[0] == "accepted" and events(fits)[-1] == "usage"

    asyncio.run(main())
