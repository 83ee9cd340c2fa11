"""Request bytes that do not parse get INVALID_ARGUMENT naming the field, and one WARNING line.

Raw bytes go through the channel untouched (`request_serializer=lambda b: b`), so the server's
own request deserializer meets them. The server here is this module's own: the shared "main"
server of conftest.py is ended by test_generation.py's last test, which sorts before this file.
It runs with bearer tokens, so the tests also see that a caller without one learns nothing about
parsing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from asyncengine.v1 import control_pb2 as cpb
from asyncengine.v1 import generation_pb2 as pb

from .utils import (
    SERVING,
    ServerProcess,
    bad_field,
    check_stream_shape,
    detail,
    greedy_request,
    stubs,
)

TOKEN, CONTROL_TOKEN = "tenant-token", "ops-token"
GENERATE_STREAM = "/asyncengine.v1.Generation/GenerateStream"
GENERATE = "/asyncengine.v1.Generation/Generate"
TOKENIZE = "/asyncengine.v1.Generation/Tokenize"
ABORT = "/asyncengine.v1.Control/Abort"
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"  # streams through context.write, not `yield`
STREAMING = (GENERATE_STREAM, HEALTH_WATCH)
PLACEHOLDER = "@@@@"
NOT_UTF8 = b"\xff\xfe\xfd\xfc"  # as long as PLACEHOLDER, so every length prefix stays right


def with_bad_utf8(message: Any) -> bytes:
    """`message` serialized, its one PLACEHOLDER string turned into invalid UTF-8."""
    data = message.SerializeToString()
    assert data.count(PLACEHOLDER.encode()) == 1
    return data.replace(PLACEHOLDER.encode(), NOT_UTF8)


def bearer(method: str) -> list[tuple[str, str]]:
    token = CONTROL_TOKEN if method.startswith("/asyncengine.v1.Control/") else TOKEN
    return [("authorization", f"Bearer {token}")]


STOPS = ["end", PLACEHOLDER]
PROMPTS = [pb.Prompt(text="ok"), pb.Prompt(text=PLACEHOLDER)]
# (method, request bytes, the field the error must name)
CASES = {
    "request_id": (
        GENERATE_STREAM,
        with_bad_utf8(pb.GenerateRequest(text="hi", request_id=PLACEHOLDER)),
        "request_id",
    ),
    "stop_string": (
        GENERATE_STREAM,
        with_bad_utf8(pb.GenerateRequest(text="hi", stopping=pb.StoppingOptions(stop=STOPS))),
        "stopping.stop[1]",
    ),
    "batch_prompt": (
        GENERATE,
        with_bad_utf8(pb.GenerateBatchRequest(prompts=PROMPTS)),
        "prompts[1].text",
    ),
    "tokenize_text": (TOKENIZE, with_bad_utf8(pb.TokenizeRequest(texts=[PLACEHOLDER])), "texts[0]"),
    "control_abort": (
        ABORT,
        with_bad_utf8(cpb.AbortRequest(request_ids=["a", PLACEHOLDER])),
        "request_ids[1]",
    ),
    "health_watch": (
        HEALTH_WATCH,
        with_bad_utf8(health_pb2.HealthCheckRequest(service=PLACEHOLDER)),
        "service",
    ),
    # the last field's length prefix promises 3 bytes more than arrive
    "truncated": (
        GENERATE_STREAM,
        pb.GenerateRequest(text="hi", request_id="abcdef").SerializeToString()[:-3],
        "request_id",
    ),
    # not even a whole first tag
    "garbage": (TOKENIZE, b"\xff\xff\xff", "(message)"),
}


@pytest.fixture(scope="module")
def server(model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log_path: Path = tmp_path_factory.mktemp("server-malformed") / "server.log"
    flags = ["--auth-token", TOKEN, "--control-auth-token", CONTROL_TOKEN, "--max-model-len", "256"]
    flags += ["--num-gpu-blocks-override", "64", "--num-cpu-blocks-override", "8"]
    server = ServerProcess(model_dir("llama"), log_path, *flags)
    try:
        server.wait_serving()
        yield server
    finally:
        assert server.stop() == 0, server.log()[-4000:]


def send_raw(
    server: ServerProcess, method: str, data: bytes, metadata: Any = None
) -> grpc.RpcError:
    """Send `data` as the request of `method` (with a valid token unless `metadata` is given);
    the error the call ends with."""
    metadata = bearer(method) if metadata is None else metadata
    with server.channel() as channel, pytest.raises(grpc.RpcError) as error:
        if method in STREAMING:
            rpc = channel.unary_stream(method, request_serializer=lambda b: b)
            list(rpc(data, metadata=metadata, timeout=30))
        else:
            channel.unary_unary(method, request_serializer=lambda b: b)(
                data, metadata=metadata, timeout=30
            )
    return error.value


def records_after(server: ServerProcess, offset: int) -> list[dict[str, Any]]:
    """The log records written after the first `offset` characters (JSON lines only: a
    traceback would fail here)."""
    return [json.loads(line) for line in server.log()[offset:].splitlines() if line.strip()]


def tokenize_works(server: ServerProcess) -> None:
    with server.channel() as channel:
        reply = stubs(channel)[0].Tokenize(
            pb.TokenizeRequest(texts=["hello"]), metadata=bearer(TOKENIZE), timeout=30
        )
    assert reply.results[0].token_count > 0


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_request_is_invalid_argument_naming_the_field(
    server: ServerProcess, case: str
) -> None:
    method, data, field = CASES[case]
    offset = len(server.log())
    error = send_raw(server, method, data)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert bad_field(error) == field
    info = detail(error, error_details_pb2.ErrorInfo)
    assert (info.reason, info.domain, dict(info.metadata)) == (
        "INVALID_ARGUMENT",
        "asyncengine",
        {"field": field},
    )
    records = records_after(server, offset)
    warnings = [r for r in records if r["level"] == "warning"]
    assert [(r["event"], r["method"], r["field"]) for r in warnings] == [
        ("malformed_request", method, field)
    ], records
    assert not [r for r in records if r["level"] in ("error", "critical") or "exception" in r]
    tokenize_works(server)


def test_caller_without_a_token_is_unauthenticated_before_any_parsing(
    server: ServerProcess,
) -> None:
    method, data, _ = CASES["request_id"]
    offset = len(server.log())
    error = send_raw(server, method, data, metadata=[])
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED, error
    assert detail(error, error_details_pb2.ErrorInfo).reason == "UNAUTHENTICATED"
    assert not [r for r in records_after(server, offset) if r["event"] == "malformed_request"]


def test_well_formed_stream_still_runs_after_malformed_calls(server: ServerProcess) -> None:
    for method, data, _ in CASES.values():
        send_raw(server, method, data)
    with server.channel() as channel:
        request = greedy_request("Hello, my name is", max_new_tokens=4)
        responses = list(
            stubs(channel)[0].GenerateStream(request, metadata=bearer(GENERATE_STREAM))
        )
    check_stream_shape(responses)
    assert responses[-1].usage.completion_tokens == 4
    with server.channel() as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        assert next(watch).status == SERVING
        watch.cancel()
