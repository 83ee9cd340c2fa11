"""The Python client against a fake in-process server: events, retries, errors, balancing, TLS, CLI.

The fake implements the generated servicers with scripted behaviour (fail the next calls with a
given status, break a stream after a few deltas), so retry rules are checked exactly. The end to
end tests against `asyncengine serve` are in test_python_client_e2e.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from asyncengine_client import (
    Accepted,
    AsyncClient,
    Client,
    Delta,
    Finished,
    FinishReason,
    GenerateOptions,
    InvalidRequestError,
    OverloadedError,
    RetryPolicy,
    Tls,
    UnavailableError,
    Usage,
)
from asyncengine_client.options import balanced_target
from asyncengine_client.v1 import (
    control_pb2,
    control_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
)
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_status import rpc_status

FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff_s=0.01)


def rich_status(code: int, message: str, *details: object) -> status_pb2.Status:
    packed = []
    for detail in details:
        any_detail = any_pb2.Any()
        any_detail.Pack(detail)
        packed.append(any_detail)
    return status_pb2.Status(code=code, message=message, details=packed)


def overloaded(retry_delay_s: float | None = None) -> status_pb2.Status:
    if retry_delay_s is None:
        return rich_status(code_pb2.RESOURCE_EXHAUSTED, "queue full")
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(int(retry_delay_s * 1e9))
    retry_info = error_details_pb2.RetryInfo(retry_delay=delay)
    return rich_status(code_pb2.RESOURCE_EXHAUSTED, "queue full", retry_info)


UNAVAILABLE = rich_status(code_pb2.UNAVAILABLE, "replica down")


class FakeGeneration(generation_pb2_grpc.GenerationServicer):
    """Streams deltas " w0", " w1", ... (one token each); unary results are reversed prompts."""

    def __init__(self) -> None:
        self.num_calls = 0
        self.failures: list[status_pb2.Status] = []  # the next calls fail with these
        self.fail_after_deltas: int | None = None  # then UNAVAILABLE mid-stream
        self.metadata: list[dict[str, str]] = []
        self.lora_names: list[str] = []  # each generate call's

    def _admit(self, context: grpc.ServicerContext) -> None:
        self.num_calls += 1
        self.metadata.append(dict(context.invocation_metadata()))
        if self.failures:
            context.abort_with_status(rpc_status.to_status(self.failures.pop(0)))

    def GenerateStream(self, request, context):
        self._admit(context)
        self.lora_names.append(request.lora_name)
        num_tokens = request.stopping.max_new_tokens
        yield generation_pb2.GenerateResponse(
            accepted=generation_pb2.Accepted(request_id=request.request_id or "req-0")
        )
        for i in range(num_tokens):
            if i == self.fail_after_deltas:
                context.abort_with_status(rpc_status.to_status(UNAVAILABLE))
            delta = generation_pb2.Delta(
                text=f" w{i}", token_ids=[i], token_offset=i, completion_tokens=i + 1
            )
            yield generation_pb2.GenerateResponse(delta=delta)
        finished = generation_pb2.Finished(reason=generation_pb2.LENGTH)
        yield generation_pb2.GenerateResponse(finished=finished)
        usage = generation_pb2.Usage(prompt_tokens=3, completion_tokens=num_tokens)
        yield generation_pb2.GenerateResponse(usage=usage)

    def Generate(self, request, context):
        self._admit(context)
        self.lora_names.append(request.lora_name)
        if request.stopping.max_new_tokens > 100:
            violation = error_details_pb2.BadRequest.FieldViolation(
                field="stopping.max_new_tokens", description="too many"
            )
            status = rich_status(
                code_pb2.INVALID_ARGUMENT,
                "max_new_tokens too large",
                error_details_pb2.BadRequest(field_violations=[violation]),
            )
            context.abort_with_status(rpc_status.to_status(status))
        results = [
            generation_pb2.GenerateResult(
                request_id=f"req-{i}", text=p.text[::-1], finish_reason=generation_pb2.EOS
            )
            for i, p in enumerate(request.prompts)
        ]
        return generation_pb2.GenerateBatchResponse(results=results)

    def Tokenize(self, request, context):
        results = [
            generation_pb2.TokenizeResult(token_ids=[ord(c) for c in text], token_count=len(text))
            for text in request.texts
        ]
        return generation_pb2.TokenizeResponse(results=results)

    def Detokenize(self, request, context):
        texts = ["".join(chr(i) for i in seq.ids) for seq in request.sequences]
        return generation_pb2.DetokenizeResponse(texts=texts)


class FakeControl(control_pb2_grpc.ControlServicer):
    def __init__(self) -> None:
        self.adapters: dict[str, control_pb2.LoRAAdapter] = {}

    def Abort(self, request, context):
        aborted_ids = [i for i in request.request_ids if i != "gone"]
        return control_pb2.AbortResponse(aborted_ids=aborted_ids)

    def GetModelInfo(self, request, context):
        return control_pb2.ModelInfo(model_name="fake", max_context_length=128, eos_token_ids=[2])

    def GetServerInfo(self, request, context):
        return control_pb2.ServerInfo(version="0", load=control_pb2.LoadReport(running=1))

    def WatchLoad(self, request, context):
        for i in range(3):
            yield control_pb2.LoadReport(running=i, block_usage_ratio=i / 4)

    def LoadLoRA(self, request, context):
        adapter = control_pb2.LoRAAdapter(
            lora_name=request.lora_name,
            lora_id=len(self.adapters) + 1,
            lora_path=request.lora_path,
            base_model_name="fake",
        )
        self.adapters[request.lora_name] = adapter
        return adapter

    def UnloadLoRA(self, request, context):
        if request.lora_name not in self.adapters:
            context.abort(grpc.StatusCode.NOT_FOUND, f"LoRA adapter {request.lora_name!r}")
        return control_pb2.UnloadLoRAResponse(adapter=self.adapters.pop(request.lora_name))

    def ListLoRAs(self, request, context):
        return control_pb2.ListLoRAsResponse(adapters=list(self.adapters.values()))


@dataclasses.dataclass
class FakeServer:
    address: str
    generation: FakeGeneration
    health: health.HealthServicer
    server: grpc.Server


def start_fake_server(credentials: grpc.ServerCredentials | None = None) -> FakeServer:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    generation = FakeGeneration()
    generation_pb2_grpc.add_GenerationServicer_to_server(generation, server)
    control_pb2_grpc.add_ControlServicer_to_server(FakeControl(), server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    return FakeServer(f"127.0.0.1:{port}", generation, health_servicer, server)


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    server = start_fake_server()
    yield server
    server.server.stop(None)


def collect_async(coro_fn):
    """Run an `async def` returning a value, in a fresh event loop."""
    return asyncio.run(coro_fn())


# ---- events and results ----


def check_stream(events: list, num_tokens: int) -> None:
    assert isinstance(events[0], Accepted)
    assert isinstance(events[-2], Finished) and events[-2].reason is FinishReason.LENGTH
    assert isinstance(events[-1], Usage) and events[-1].completion_tokens == num_tokens
    deltas = [e for e in events if isinstance(e, Delta)]
    assert "".join(d.text for d in deltas) == "".join(f" w{i}" for i in range(num_tokens))
    assert [d.token_ids for d in deltas] == [[i] for i in range(num_tokens)]


def test_sync_stream_yields_typed_events_in_order(fake: FakeServer) -> None:
    with Client(fake.address) as client:
        events = list(client.generate_stream("hi", max_new_tokens=4, request_id="mine"))
    check_stream(events, 4)
    assert events[0].request_id == "mine"


def test_async_stream_yields_typed_events_in_order(fake: FakeServer) -> None:
    async def run() -> list:
        async with AsyncClient(fake.address) as client:
            return [e async for e in client.generate_stream("hi", max_new_tokens=4)]

    check_stream(collect_async(run), 4)


def test_unary_batch_keeps_prompt_order(fake: FakeServer) -> None:
    prompts = ["abc", "안녕하세요", "xyz"]
    with Client(fake.address) as client:
        completions = client.generate(prompts, max_new_tokens=2)

    async def run() -> list:
        async with AsyncClient(fake.address) as client:
            return await client.generate(prompts, max_new_tokens=2)

    for got in (completions, collect_async(run)):
        assert [c.text for c in got] == [p[::-1] for p in prompts]
        assert all(c.finish_reason is FinishReason.EOS for c in got)


def test_unknown_option_is_a_type_error_at_the_call(fake: FakeServer) -> None:
    with Client(fake.address) as client, pytest.raises(TypeError, match="max_tokens"):
        client.generate(["hi"], max_tokens=3)

    async def run() -> None:
        async with AsyncClient(fake.address) as client:
            client.generate_stream("hi", max_tokens=3)  # raises before any iteration

    with pytest.raises(TypeError, match="max_tokens"):
        collect_async(run)


@pytest.mark.parametrize(
    "option, value",
    [("max_new_tokens", -1), ("seed", -1), ("top_k", -2), ("n", 2**32), ("priority", 2**31),
     ("stop_token_ids", [3, -1]), ("logprobs", -1)],
)  # fmt: skip
def test_an_option_out_of_its_range_is_named_before_a_call(
    fake: FakeServer, option: str, value: object
) -> None:
    """Was protobuf's bare `ValueError: Value out of range: -1`, naming no option."""
    with Client(fake.address) as client, pytest.raises(InvalidRequestError) as caught:
        client.generate(["hi"], **{option: value})
    assert caught.value.field == option and option in str(caught.value)
    assert GenerateOptions(top_k=-1).top_k == 0  # vLLM's "no top-k", as the server takes it


def test_tokenize_info_abort_health_and_load(fake: FakeServer) -> None:
    async def run() -> tuple:
        async with AsyncClient(fake.address) as client:
            loads = [load.running async for load in client.watch_load(10)]
            return await client.tokenize(["한국어"]), loads, await client.health()

    (tokenized,), loads, status = collect_async(run)
    assert tokenized.token_count == 3 and loads == [0, 1, 2] and status == "SERVING"
    with Client(fake.address) as client:
        assert client.detokenize([tokenized.token_ids]) == ["한국어"]
        assert client.abort(["a", "gone"]) == ["a"]
        info = client.model_info()
        assert (info.model_name, info.eos_token_ids, info.bos_token_id) == ("fake", [2], None)
        assert client.server_info().load.running == 1
        assert [load.block_usage_ratio for load in client.watch_load()] == [0, 0.25, 0.5]
        fake.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert client.health() == "NOT_SERVING"


def test_lora_adapters_are_loaded_listed_used_by_name_and_unloaded(fake: FakeServer) -> None:
    async def run() -> tuple:
        async with AsyncClient(fake.address) as client:
            loaded = await client.load_lora("sql", "/adapters/sql")
            listed = await client.list_loras()
            events = [
                e async for e in client.generate_stream("Hi", max_new_tokens=1, lora_name="sql")
            ]
            return loaded, listed, events, await client.unload_lora("sql")

    loaded, listed, events, unloaded = collect_async(run)
    assert (loaded.lora_name, loaded.lora_id, loaded.lora_path) == ("sql", 1, "/adapters/sql")
    assert listed == [loaded] and unloaded == loaded and isinstance(events[-1], Usage)
    with Client(fake.address) as client:
        client.load_lora("chat", "/adapters/chat")
        assert [a.lora_name for a in client.list_loras()] == ["chat"]
        client.generate(["Hi"], max_new_tokens=1, lora_name="chat")
        client.generate(["Hi"], max_new_tokens=1)
        assert client.unload_lora("chat").base_model_name == "fake"
        with pytest.raises(InvalidRequestError) as missing:
            client.unload_lora("chat")
        assert missing.value.code is grpc.StatusCode.NOT_FOUND
    assert fake.generation.lora_names == ["sql", "chat", ""]


# ---- retries and errors ----


def test_retry_waits_the_servers_retry_delay_then_succeeds(fake: FakeServer) -> None:
    fake.generation.failures = [overloaded(retry_delay_s=0.1)]
    with Client(fake.address) as client:
        start = time.monotonic()
        events = list(client.generate_stream("hi", max_new_tokens=2))
        assert time.monotonic() - start >= 0.1
    check_stream(events, 2)
    assert fake.generation.num_calls == 2

    fake.generation.failures = [overloaded(retry_delay_s=0.1)]

    async def run() -> list:
        async with AsyncClient(fake.address) as client:
            return await client.generate(["ab"])

    assert [c.text for c in collect_async(run)] == ["ba"]
    assert fake.generation.num_calls == 4


def test_resource_exhausted_without_retry_info_is_not_retried(fake: FakeServer) -> None:
    fake.generation.failures = [overloaded()]
    with Client(fake.address) as client, pytest.raises(OverloadedError) as caught:
        client.generate(["hi"])
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert caught.value.retry_delay_s is None
    assert fake.generation.num_calls == 1


def test_retry_delay_past_the_timeout_gives_up_at_once(fake: FakeServer) -> None:
    fake.generation.failures = [overloaded(retry_delay_s=30)]
    with Client(fake.address) as client, pytest.raises(OverloadedError) as caught:
        client.generate(["hi"], timeout=5)
    assert caught.value.retry_delay_s == 30
    assert fake.generation.num_calls == 1


def test_attempts_are_bounded(fake: FakeServer) -> None:
    fake.generation.failures = [UNAVAILABLE] * 10
    with Client(fake.address, retry=FAST_RETRY) as client, pytest.raises(UnavailableError):
        list(client.generate_stream("hi", max_new_tokens=2))
    assert fake.generation.num_calls == 3


def test_stream_is_not_retried_after_partial_output(fake: FakeServer) -> None:
    fake.generation.fail_after_deltas = 2
    received: list = []
    with Client(fake.address, retry=FAST_RETRY) as client, pytest.raises(UnavailableError):
        received.extend(client.generate_stream("hi", max_new_tokens=5))
    assert [e.text for e in received if isinstance(e, Delta)] == [" w0", " w1"]
    assert fake.generation.num_calls == 1

    async def run() -> None:
        received.clear()
        async with AsyncClient(fake.address, retry=FAST_RETRY) as client:
            async for event in client.generate_stream("hi", max_new_tokens=5):
                received.append(event)

    with pytest.raises(UnavailableError):
        collect_async(run)
    assert [e.text for e in received if isinstance(e, Delta)] == [" w0", " w1"]
    assert fake.generation.num_calls == 2


def test_bad_request_names_the_field_and_is_not_retried(fake: FakeServer) -> None:
    with Client(fake.address) as client, pytest.raises(InvalidRequestError) as caught:
        client.generate(["hi"], max_new_tokens=1000)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.field == "stopping.max_new_tokens"
    assert fake.generation.num_calls == 1


def test_bearer_token_is_sent_as_metadata(fake: FakeServer) -> None:
    with Client(fake.address, token="s3cret") as client:
        client.generate(["hi"])
    assert fake.generation.metadata[-1]["authorization"] == "Bearer s3cret"


# ---- balancing, TLS ----


def test_round_robin_spreads_calls_and_skips_a_drained_replica() -> None:
    servers = [start_fake_server(), start_fake_server()]
    try:
        with Client([s.address for s in servers]) as client:
            # calls go only to replicas already connected and healthy: wait for both
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not all(s.generation.num_calls for s in servers):
                client.generate(["hi"])
            for server in servers:
                server.generation.num_calls = 0
            for _ in range(6):
                client.generate(["hi"])
            assert [s.generation.num_calls for s in servers] == [3, 3]
            servers[1].health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:  # the health Watch update is asynchronous
                before = servers[1].generation.num_calls
                for _ in range(4):
                    client.generate(["hi"])
                if servers[1].generation.num_calls == before:
                    break
            assert servers[1].generation.num_calls == before
    finally:
        for server in servers:
            server.server.stop(None)


def test_several_addresses_become_one_balanced_target() -> None:
    assert balanced_target(["localhost:1", "10.0.0.2:2"]) == "ipv4:127.0.0.1:1,10.0.0.2:2"
    assert balanced_target(["[::1]:1", "[::1]:2"]) == "ipv6:[::1]:1,[::1]:2"
    with pytest.raises(ValueError, match="host:port"):
        balanced_target(["no-port"])


def make_certs(folder: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, EC keys."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=ca")
    for name, extra in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "")):
        openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        (folder / f"{name}.ext").write_text(extra + "\n")
        openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext",
        )  # fmt: skip


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_mtls(tmp_path: Path) -> None:
    make_certs(tmp_path)
    read = lambda name: (tmp_path / name).read_bytes()  # noqa: E731
    credentials = grpc.ssl_server_credentials(
        [(read("server.key"), read("server.pem"))],
        root_certificates=read("ca.pem"),
        require_client_auth=True,
    )
    server = start_fake_server(credentials)
    try:
        tls = Tls.from_files(tmp_path / "ca.pem", tmp_path / "client.pem", tmp_path / "client.key")
        with Client(server.address, tls=tls) as client:
            assert [c.text for c in client.generate(["tls"])] == ["slt"]
        no_client_cert = Tls(root_cert=read("ca.pem"))
        client = Client(server.address, tls=no_client_cert, retry=FAST_RETRY)
        with client, pytest.raises(UnavailableError):
            client.generate(["tls"], timeout=5)
    finally:
        server.server.stop(None)


# ---- packaging ----


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "asyncengine_client.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=30)


def test_cli_streams_and_checks_health(fake: FakeServer) -> None:
    out = run_cli("generate", "hi", "--stream", "--max-new-tokens", "3", "--target", fake.address)
    assert out.returncode == 0, out.stderr
    assert out.stdout == " w0 w1 w2\n"
    assert "[length]" in out.stderr
    fake.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    out = run_cli("health", "--target", fake.address)
    assert (out.returncode, out.stdout) == (1, "NOT_SERVING\n")


def test_cli_interrupted_exits_130_without_a_traceback(
    fake: FakeServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C during `generate --stream` printed a KeyboardInterrupt traceback."""
    from asyncengine_client import cli

    def interrupted(client: Client, ns: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_generate", interrupted)
    assert cli.main(["generate", "hi", "--stream", "--target", fake.address]) == 130
    assert "Traceback" not in capsys.readouterr().err


def test_cli_heads_each_of_several_completions_streamed_or_not(fake: FakeServer) -> None:
    prompts = ["first prompt", "second " + "x" * 60]
    headers = ["==> prompt 1: 'first prompt' <==", f"==> prompt 2: 'second {'x' * 50}...' <=="]
    out = run_cli(
        "generate", *prompts, "--stream", "--max-new-tokens", "2", "--target", fake.address
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [headers[0], " w0 w1", "", headers[1], " w0 w1"]
    out = run_cli("generate", *prompts, "--target", fake.address)  # unary: reversed prompts
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        headers[0],
        prompts[0][::-1],
        "",
        headers[1],
        prompts[1][::-1],
    ]


def test_client_imports_neither_torch_nor_the_server() -> None:
    check = (
        "import sys, asyncengine_client, asyncengine_client.cli; "
        "assert not {'torch', 'transformers', 'asyncengine'} & set(sys.modules), sys.modules"
    )
    subprocess.run([sys.executable, "-c", check], check=True, timeout=30)


# what grpc (C core) reported for a stream whose replica was SIGKILLed behind each balancer
# (docs/operations.md, "Death"), and a status of the server's own that must keep its type
LOST_STREAMS = [
    (grpc.StatusCode.UNKNOWN, "Stream removed (Data frame with END_STREAM flag received)"),
    (
        grpc.StatusCode.INTERNAL,
        "Stream removed (RST_STREAM (Received RST_STREAM with error code 2))",
    ),
    (
        grpc.StatusCode.CANCELLED,
        "Stream removed (RST_STREAM (Received RST_STREAM with error code 8))",
    ),
]


@pytest.mark.parametrize(("code", "details"), LOST_STREAMS)
def test_a_stream_lost_behind_a_balancer_is_unavailable_whatever_the_balancer_said(
    code: grpc.StatusCode, details: str
) -> None:
    from asyncengine_client.errors import STREAM_LOST, error_from_rpc

    lost = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
    error = error_from_rpc(lost)
    assert isinstance(error, UnavailableError) and error.reason == STREAM_LOST
    assert error.code == code  # what grpc said stays visible


def test_a_status_the_server_sent_is_never_taken_for_a_lost_stream_whatever_its_words() -> None:
    from asyncengine_client.errors import AsyncEngineError, error_from_rpc

    words = "Stream removed (a server's message may say anything)"
    status = status_pb2.Status(code=code_pb2.INTERNAL, message=words)
    trailers = grpc.aio.Metadata(*rpc_status.to_status(status).trailing_metadata)
    failed = grpc.aio.AioRpcError(
        grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), trailers, status.message
    )
    error = error_from_rpc(failed)
    assert type(error) is AsyncEngineError and error.reason is None
