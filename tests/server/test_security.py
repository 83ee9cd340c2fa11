"""TLS, mutual TLS, bearer tokens and tenants, admission limits, Drain and Resume.

Each test builds a real server on loopback from `asyncengine serve` flags, in this process (the
engine loads in milliseconds once its imports are warm, a new process takes ~10 s), and talks
to it with real aio clients. The serve subprocess itself is covered by test_generation.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from structlog.testing import capture_logs

from asyncengine.engine.async_llm_engine import AsyncLLMEngine
from asyncengine.server import app
from asyncengine.server.auth import Tenants
from asyncengine.server.cli import build_parser, engine_args_from
from asyncengine.server.errors import UnauthenticatedError
from asyncengine.server.health import SERVICE_NAMES
from asyncengine.server.options import ServeOptions, check_options, serve_options_from
from asyncengine.server.state import ServerState
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
PERMISSION_DENIED = grpc.StatusCode.PERMISSION_DENIED
CACHED_PROMPT = list(range(100, 180))  # 80 tokens: five full blocks of 16


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


async def start_server(model: Path, *flags: str) -> tuple[app.FrontEnds, ServerState, str]:
    """A started server on the tiny model from `asyncengine serve` flags, and its target."""
    argv = ["serve", "--model", str(model), "--host", "127.0.0.1"]
    argv += ["--port", "0", "--device", "cpu", "--num-gpu-blocks-override", "512"]
    argv += ["--num-cpu-blocks-override", "16", "--drain-grace-period", "1.0", *flags]
    ns = build_parser().parse_args(argv)
    options = serve_options_from(ns)
    check_options(options)
    engine = AsyncLLMEngine.from_engine_args(engine_args_from(ns))
    server, state, port = await app.start(engine, options)
    return server, state, f"127.0.0.1:{port}"


@pytest.fixture
def serving(model_dir: Callable[..., Path]) -> Callable[..., Any]:
    """`async with serving(*serve_flags) as target`: a started server, stopped on exit."""

    @contextlib.asynccontextmanager
    async def serve(*flags: str) -> AsyncIterator[str]:
        server, state, target = await start_server(model_dir("llama"), *flags)
        try:
            yield target
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


async def outcome_of(call: Any) -> Any:
    """What an awaitable call returns, or the error it ends with."""
    try:
        return await call
    except grpc.aio.AioRpcError as error:
        return error


async def health_of(chan: Any, service: str = "") -> int:
    return (
        await health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(service=service))
    ).status


async def wait_for_health(chan: Any, status: int) -> None:
    """Poll readiness until it is `status` (a drain sets it before it starts waiting)."""

    async def poll() -> None:
        while await health_of(chan) != status:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), 10)


async def cached_tokens(chan: Any, token: str) -> int:
    """Usage.cached_tokens of CACHED_PROMPT sent with `token`."""
    call = stubs(chan)[0].GenerateStream(greedy_request(CACHED_PROMPT, 2), metadata=bearer(token))
    return (await read_rest(call))[-1].usage.cached_tokens


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
            for metadata in (
                None,
                bearer("wrong"),
                [("authorization", TOKENS[0])],
                bearer(CONTROL_TOKEN),
            ):
                error = await status_of(tokenize(target, metadata))
                assert error.code() == UNAUTHENTICATED
                assert detail(error, error_details_pb2.ErrorInfo).reason == "UNAUTHENTICATED"
            stream = generation.GenerateStream(greedy_request("x", 2))
            assert (await status_of(stream)).code() == UNAUTHENTICATED
            # Control takes its own token only (the Control token opens nothing else)
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


def test_the_worker_services_loads_and_kv_events_take_controls_token(serving: Any) -> None:
    """SMG's worker service: its loads, server facts and KV events show every tenant's work
    (KV events carry prompts' token ids), so with tenant tokens they take the Control token,
    as Control's own calls do. A tenant's token read another tenant's prompts from them."""
    from smg_grpc_proto import vllm_engine_pb2 as vpb
    from smg_grpc_proto import vllm_engine_pb2_grpc
    from smg_grpc_proto.generated import common_pb2

    flags = ["--auth-token", TOKENS[0], "--auth-token", TOKENS[1]]
    flags += ["--control-auth-token", CONTROL_TOKEN, "--enable-kv-events"]

    async def main() -> None:
        async with serving(*flags) as target, channel(target) as chan:
            worker = vllm_engine_pb2_grpc.VllmEngineStub(chan)
            calls = {
                "GetLoads": lambda md: worker.GetLoads(vpb.GetLoadsRequest(), metadata=md),
                "GetServerInfo": lambda md: worker.GetServerInfo(
                    vpb.GetServerInfoRequest(), metadata=md
                ),
                "SubscribeKvEvents": lambda md: _first(
                    worker.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), metadata=md)
                ),
            }
            for name, call in calls.items():
                error = await status_of(call(bearer(TOKENS[0])))
                assert error.code() == UNAUTHENTICATED, name
                await call(bearer(CONTROL_TOKEN))  # answers
            # a tenant still generates and reads the model through it
            info = await worker.GetModelInfo(vpb.GetModelInfoRequest(), metadata=bearer(TOKENS[0]))
            assert info.max_context_length > 0

    asyncio.run(main())


async def _first(stream: Any) -> Any:
    async for item in stream:
        stream.cancel()
        return item
    return None


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


def test_control_is_off_when_only_tenant_tokens_are_set(serving: Any) -> None:
    """With --auth-token and no --control-auth-token, no token opens Control: no tenant drains."""

    async def main() -> None:
        with capture_logs() as logs:
            async with serving("--auth-token", TOKENS[0]) as target, channel(target) as chan:
                generation, control = stubs(chan)
                info = cpb.GetServerInfoRequest()
                refusals = [
                    await status_of(control.GetServerInfo(info, metadata=metadata))
                    for metadata in (bearer(TOKENS[0]), None, bearer("wrong"))
                ]
                for call in (
                    control.Drain(cpb.DrainRequest(), metadata=bearer(TOKENS[0])),
                    control.Resume(cpb.ResumeRequest(), metadata=bearer(TOKENS[0])),
                    control.WatchLoad(cpb.WatchLoadRequest(), metadata=bearer(TOKENS[0])),
                ):
                    refusals.append(await status_of(call))
                status = await health_of(chan)
                stream = generation.GenerateStream(
                    greedy_request("x", 2), metadata=bearer(TOKENS[0])
                )
                served = await read_rest(stream)
        for error in refusals:
            assert error.code() == PERMISSION_DENIED, error
            assert detail(error, error_details_pb2.ErrorInfo).reason == "CONTROL_DISABLED"
            assert "start the server with --control-auth-token" in error.details()
        assert status == SERVING  # the refused Drain did nothing
        assert events(served)[-1] == "usage"
        warnings = [r for r in logs if r["event"] == "control_disabled"]
        assert len(warnings) == 1 and warnings[0]["log_level"] == "warning", warnings
        assert "--control-auth-token" in warnings[0]["fix"]

    asyncio.run(main())


def test_resume_undoes_a_drain_within_its_grace_period(serving: Any) -> None:
    async def main() -> None:
        async with serving() as target, channel(target) as chan:
            generation, control = stubs(chan)
            idle_resume = await control.Resume(cpb.ResumeRequest())
            long = generation.GenerateStream(greedy_request([7, 9], None, request_id="long"))
            await read_until(long, "delta")
            drain = control.Drain(cpb.DrainRequest(grace_period_ms=60_000))
            await wait_for_health(chan, NOT_SERVING)
            refused = await status_of(generation.GenerateStream(greedy_request("x", 2)))
            resumed = await control.Resume(cpb.ResumeRequest())
            drained = await asyncio.wait_for(drain, 10)  # long before its 60 s grace period
            statuses = [await health_of(chan, name) for name in ("", *SERVICE_NAMES)]
            served = await read_rest(generation.GenerateStream(greedy_request("x", 2)))
            await read_until(long, "delta")  # the drain aborted nothing: still generating
            await control.Abort(cpb.AbortRequest(request_ids=["long"]))
            long_end = await read_rest(long)
            info = await control.GetServerInfo(cpb.GetServerInfoRequest())
        assert not idle_resume.was_draining
        assert refused.code() == grpc.StatusCode.UNAVAILABLE
        assert resumed.was_draining and drained.aborted == 0
        assert statuses == [SERVING] * (1 + len(SERVICE_NAMES))
        assert events(served)[0] == "accepted" and events(served)[-1] == "usage"
        assert long_end[-2].finished.reason == pb.CANCELLED
        assert not info.draining

    asyncio.run(main())


def test_resume_cannot_undo_a_shutdown(model_dir: Callable[..., Path]) -> None:
    """The drain that SIGTERM starts (app.stop) is final."""

    async def main() -> None:
        # a grace period far shorter than the ~2000 tokens the long stream would run
        grace = ("--drain-grace-period", "0.3")
        server, state, target = await start_server(model_dir("llama"), *grace)
        async with channel(target) as chan:
            generation, control = stubs(chan)
            long = generation.GenerateStream(greedy_request([7, 9], None))
            await read_until(long, "delta")
            reading = asyncio.create_task(read_rest(long))  # keeps reading, as a live client does
            stopping = asyncio.create_task(app.stop(server, state))
            try:
                await wait_for_health(chan, NOT_SERVING)
                # outcomes, not raises: a Resume that reopens lets the stop finish at once
                refused = await outcome_of(control.Resume(cpb.ResumeRequest()))
                status = await outcome_of(health_of(chan))
            finally:  # a failure here must not leave the server and its engine running
                exit_code = await asyncio.wait_for(stopping, 30)
            long_end = await outcome_of(reading)
        assert isinstance(refused, grpc.aio.AioRpcError), f"Resume reopened: {refused}"
        assert refused.code() == grpc.StatusCode.UNAVAILABLE
        assert detail(refused, error_details_pb2.ErrorInfo).reason == "DRAINING"
        assert status == NOT_SERVING
        assert long_end[-2].finished.reason == pb.ABORTED_BY_SERVER
        assert exit_code == 0

    asyncio.run(main())


def test_tenants_share_no_cached_prompts_unless_grouped(serving: Any) -> None:
    """A prefix-cache hit must not tell one tenant what another sent (Usage.cached_tokens)."""
    flags = ["--auth-token", TOKENS[0], "--auth-token", TOKENS[1]]
    flags += ["--auth-token", "team:gamma-token", "--auth-token", "team:delta-token"]

    async def main() -> None:
        async with serving(*flags) as target, channel(target) as chan:
            alpha_first = await cached_tokens(chan, TOKENS[0])
            beta = await cached_tokens(chan, TOKENS[1])
            alpha_again = await cached_tokens(chan, TOKENS[0])
            gamma = await cached_tokens(chan, "gamma-token")
            delta = await cached_tokens(chan, "delta-token")  # gamma's group-mate
            whole_value = await status_of(tokenize(target, bearer("team:gamma-token")))
        assert alpha_first == 0
        assert beta == 0, "beta's prompt hit alpha's cached blocks"
        assert alpha_again > 0
        assert gamma == 0 and delta > 0
        assert whole_value.code() == UNAUTHENTICATED  # GROUP:TOKEN accepts TOKEN alone

    asyncio.run(main())


def test_tenants_name_each_bare_token_apart_and_each_group_once() -> None:
    tenants = Tenants.from_options(
        ServeOptions(auth_tokens=("alpha-token", "beta-token", "team:g1", "team:g2", "ops:o1"))
    )
    alpha, beta, g1, g2, o1 = (
        tenants.identity(bearer(t)) for t in ("alpha-token", "beta-token", "g1", "g2", "o1")
    )
    assert alpha is not None and beta is not None and alpha != beta
    # a short sha256 digest: the token itself never becomes a cache key
    assert 8 <= len(alpha) < 64 and hashlib.sha256(b"alpha-token").hexdigest().startswith(alpha)
    assert tenants.identity(bearer("alpha-token")) == alpha  # stable
    assert g1 == g2 == "group:team" and o1 == "group:ops"
    for metadata in (None, bearer("team:g1"), bearer("unknown")):  # the interceptor admits none
        with pytest.raises(UnauthenticatedError):
            tenants.identity(metadata)
    # auth off for Generation: no tenant, whatever the call carries
    assert Tenants.from_options(ServeOptions()).identity(bearer("alpha-token")) is None
    assert Tenants.from_options(ServeOptions(control_auth_tokens=("ops",))).identity(None) is None


@pytest.mark.parametrize(
    ("tokens", "control_tokens", "message"),
    [
        ((":s3cret",), (), "non-empty GROUP"),
        (("team:",), (), "non-empty GROUP"),
        (("a:s3cret", "b:s3cret"), (), "different groups"),
        (("s3cret", "a:s3cret"), (), "different groups"),
        (("team:s3cret",), ("s3cret",), "must differ"),
    ],
)
def test_check_options_refuses_ambiguous_tokens(
    tokens: tuple[str, ...], control_tokens: tuple[str, ...], message: str
) -> None:
    options = ServeOptions(auth_tokens=tokens, control_auth_tokens=control_tokens)
    with pytest.raises(ValueError, match=message) as caught:
        check_options(options)
    assert "s3cret" not in str(caught.value)  # messages get logged: they never quote a token
