"""What the HTTP API shares with gRPC (admission, bearer tokens, drain, metrics) and how it
fails: OpenAI's error shape naming the param, 401, 404, 429 with Retry-After, 503 while
draining; disconnects free everything; /health, /version, /tokenize, /detokenize, /metrics;
and `asyncengine serve --http-port` as a process, stopped by SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving_http import ServerThread, http_server
from structlog.testing import capture_logs

from asyncengine.server.cli import build_parser
from asyncengine.server.options import check_options, serve_options_from
from asyncengine.v1 import control_pb2 as cpb
from asyncengine.v1 import control_pb2_grpc, generation_pb2_grpc
from asyncengine.v1 import generation_pb2 as pb

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def get(url: str, **headers: str) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def post(url: str, body: Any, **headers: str) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **headers}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def metric(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise KeyError(name)


def finished(served: ServerThread) -> dict[str, float]:
    """asyncengine_requests_finished_total by reason, scraped from --metrics-port."""
    assert served.state.metrics is not None
    _, _, text = get(f"http://127.0.0.1:{served.state.metrics.port}/metrics")
    reasons = ("stop", "length", "cancelled", "deadline", "aborted", "error")
    name = "asyncengine_requests_finished_total"
    return {reason: metric(text.decode(), name, reason=reason) for reason in reasons}


def num_stalled(served: ServerThread) -> float:
    assert served.state.metrics is not None
    _, _, text = get(f"http://127.0.0.1:{served.state.metrics.port}/metrics")
    return metric(text.decode(), "asyncengine_stalled_streams_total")


@pytest.fixture(scope="module")
def fake(model_dir, core: tuple[str, ...]) -> Iterator[ServerThread]:
    """Scripted tokens (no forward): a server whose cost is the server's own. Steps take 5 ms
    more, so long requests are still running when a test acts on them; a stream nobody reads
    for 0.5 s is cut off."""
    flags = ("--metrics-port", "0", "--max-num-seqs", "256", "--stall-timeout", "0.5", *core)
    with http_server(model_dir("llama"), *flags, fake_runner=True, step_delay_s=0.005) as served:
        yield served


@pytest.fixture(scope="module")
def guarded(model_dir, core: tuple[str, ...]) -> Iterator[ServerThread]:
    """An admission limit of 2 (max_num_seqs 1 plus 1 queued), bearer tokens (`alpha`, and
    `beta` of the group `team`) and a body limit of 1000 bytes; scripted tokens, slowed."""
    flags = (
        "--max-num-seqs", "1", "--max-queued-requests", "1", "--retry-after", "2.5",
        "--max-message-size", "1000", "--auth-token", "alpha", "--auth-token", "team:beta",
        *core,
    )  # fmt: skip
    with http_server(model_dir("llama"), *flags, fake_runner=True, step_delay_s=0.005) as served:
        yield served


def test_errors_are_openai_shaped_and_name_the_param(fake: ServerThread) -> None:
    client = fake.client()
    cases: list[tuple[dict[str, Any], str]] = [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 5000}, "max_tokens"),  # past the context
        ({"logprobs": 21}, "logprobs"),
        ({"stop": ["x" * 300]}, "stop"),
        ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"prompt": [[1, 2], [999999]]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "x" * 70000}, "prompt"),
        ({"extra_body": {"stop_token_ids": [999999]}}, "stop_token_ids"),
        ({"extra_body": {"top_k": -5}}, "top_k"),
        # past the context, with no max_tokens to refuse first
        ({"max_tokens": None, "extra_body": {"min_tokens": 10**9}}, "min_tokens"),
        ({"temperature": "hot"}, "temperature"),  # not a number: pydantic's own check
        ({"suffix": "!"}, "suffix"),
    ]
    for overrides, param in cases:
        kwargs = {"model": fake.model, "prompt": "Hello", **overrides}
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(**kwargs)
        body = raised.value.body
        assert raised.value.status_code == 400
        assert body["param"] == param, (overrides, body)
        assert body["type"] == "invalid_request_error" and body["message"]
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="gpt-4", prompt="Hello")
    assert raised.value.body["code"] == "model_not_found"
    # the whole error object, as OpenAI writes it, on the wire
    status, body = post(fake.base_url + "/v1/completions", {"prompt": "hi", "n": 0})
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"].startswith("n: ")
    status, body = post(fake.base_url + "/v1/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = post(fake.base_url + "/v1/nothing-here", {})
    assert status == 404 and "error" in body
    fake.assert_nothing_left()


def test_errors_carry_the_types_and_codes_openai_wrappers_match(fake: ServerThread) -> None:
    client = fake.client()
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-4", prompt="Hello")
    assert missing.value.status_code == 404
    assert missing.value.body["type"] == "invalid_request_error"
    assert missing.value.body["code"] == "model_not_found"
    for extra in ({"max_tokens": 5000}, {"max_tokens": None, "extra_body": {"min_tokens": 10**9}}):
        with pytest.raises(openai.BadRequestError) as overflow:
            client.completions.create(**{"model": fake.model, "prompt": "Hello", **extra})
        assert overflow.value.body["code"] == "context_length_exceeded", extra
        assert "maximum context length is" in overflow.value.body["message"]
    status, body = post(fake.base_url + "/v1/completions", b'{"prompt": "hi", ')
    assert status == 400 and body["error"]["param"] is None
    assert body["error"]["message"].startswith("the body is not a valid JSON object")
    messages = [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "hi"}]
    status, body = post(fake.base_url + "/v1/chat/completions", {"messages": messages})
    assert status == 400 and body["error"]["param"] == "messages.1.role"


def test_models_retrieve_gives_the_served_model_and_404_for_another(fake: ServerThread) -> None:
    client = fake.client()
    model = client.models.retrieve(fake.model)
    assert (model.id, model.object, model.owned_by) == (fake.model, "model", "asyncengine")
    assert model.created == client.models.list().data[0].created
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4")
    assert missing.value.body["code"] == "model_not_found"


def test_the_model_is_served_under_its_directory_name_and_its_path_still_works(
    fake: ServerThread,
) -> None:
    path = str(fake.engine_args.model)
    name = Path(path).name  # model_dir's directory: model-llama0 or so
    client = fake.client()
    assert [m.id for m in client.models.list().data] == [name]
    assert client.models.retrieve(path).id == name  # the path is an alias of the name
    for model in (name, path):
        assert client.completions.create(model=model, prompt="Hi", max_tokens=1).model == name
    with grpc.insecure_channel(f"127.0.0.1:{fake.grpc_port}") as channel:
        info = control_pb2_grpc.ControlStub(channel).GetModelInfo(cpb.GetModelInfoRequest())
    assert info.model_name == name
    assert fake.state.metrics is not None
    _, _, text = get(f"http://127.0.0.1:{fake.state.metrics.port}/metrics")
    assert metric(text.decode(), "asyncengine_info", model=name, model_path=path) == 1


def test_a_body_over_the_message_size_is_refused_unread(guarded: ServerThread) -> None:
    url = guarded.base_url + "/v1/completions"
    status, body = post(url, {"prompt": "x" * 2000}, Authorization="Bearer alpha")
    assert status == 413 and body["error"]["code"] == "request_too_large"
    status, _ = post(url, {"prompt": "x", "max_tokens": 2}, Authorization="Bearer alpha")
    assert status == 200


def test_the_routes_http_mode_routers_probe(fake: ServerThread) -> None:
    """SMG's HTTP mode and sglang-router read the model, the server and its load here."""
    url = fake.base_url
    for path in ("/get_model_info", "/model_info"):
        status, _, body = get(url + path)
        model = json.loads(body)
        assert status == 200 and model["is_generation"] is True
        assert model["max_context_length"] > 0 and model["tokenizer_path"], model
    for path in ("/get_server_info", "/server_info"):
        status, _, body = get(url + path)
        server = json.loads(body)
        assert status == 200 and server["is_paused"] is False and server["block_size"] > 0
    for path in ("/get_load", "/v1/loads", "/loads"):
        status, _, body = get(url + path)
        (load,) = json.loads(body)["loads"]
        assert status == 200 and load["max_total_num_tokens"] > 0, load
        assert load["num_running_reqs"] == 0 and load["token_usage"] == 0


def test_health_version_tokenize_detokenize_metrics(fake: ServerThread) -> None:
    url = fake.base_url
    assert get(url + "/health")[0] == 200
    status, _, body = get(url + "/version")
    assert status == 200 and json.loads(body)["version"]
    status, encoded = post(url + "/tokenize", {"prompt": "Hello 🍕", "return_token_strs": True})
    assert status == 200 and encoded["count"] == len(encoded["tokens"]) > 1
    assert len(encoded["token_strs"]) == encoded["count"]
    status, decoded = post(url + "/detokenize", {"tokens": encoded["tokens"]})
    assert status == 200 and decoded["prompt"] == "Hello 🍕"
    status, body = post(url + "/detokenize", {"tokens": [999999]})
    assert status == 400 and body["error"]["param"] == "tokens"
    fake.client().completions.create(model=fake.model, prompt="Hello", max_tokens=5)
    # one registry: the HTTP port's /metrics and --metrics-port's agree
    _, _, over_http = get(url + "/metrics")
    assert fake.state.metrics is not None
    _, _, over_metrics_port = get(f"http://127.0.0.1:{fake.state.metrics.port}/metrics")
    name = "asyncengine_requests_finished_total"
    assert metric(over_http.decode(), name, reason="length") >= 1
    assert metric(over_http.decode(), name, reason="length") == metric(
        over_metrics_port.decode(), name, reason="length"
    )


def test_request_ids_come_from_x_request_id(fake: ServerThread) -> None:
    client = fake.client()
    reply = client.completions.with_raw_response.create(
        model=fake.model, prompt="Hi", max_tokens=3, extra_headers={"x-request-id": "job-42"}
    )
    assert reply.headers["x-request-id"] == "job-42"
    assert reply.parse().id == "cmpl-job-42"

    async def twice() -> list[Any]:
        async with fake.async_client() as aclient:
            first = await aclient.completions.create(
                model=fake.model, prompt="Hi", max_tokens=1500, stream=True,
                extra_headers={"x-request-id": "same"},
            )  # fmt: skip
            await first.__anext__()
            try:
                await aclient.completions.create(
                    model=fake.model, prompt="Hi", extra_headers={"x-request-id": "same"}
                )
            except openai.APIStatusError as exc:
                return [exc.status_code, exc.body]
            finally:
                await first.close()
            return []

    status, body = asyncio.run(twice())
    assert status == 409 and body["code"] == "duplicate_request_id"
    fake.assert_nothing_left()


def test_one_log_line_per_request_of_one_shape_for_both_protocols(fake: ServerThread) -> None:
    """The server core logs every request, whichever protocol brought it: the same fields, in
    the same words (the engine's finish reasons), with the protocol as a field."""
    with capture_logs() as logs:
        fake.client().completions.create(
            model=fake.model, prompt="Hi", max_tokens=3, extra_headers={"x-request-id": "line-h"}
        )
        with grpc.insecure_channel(f"127.0.0.1:{fake.grpc_port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(
                request_id="line-g", text="Hi", stopping=pb.StoppingOptions(max_new_tokens=3)
            )
            list(stub.GenerateStream(request, timeout=30))
        fake.wait_idle()
    lines = {line["request_id"]: line for line in logs if line["event"] == "request_finished"}
    http, grpc_line = lines["line-h"], lines["line-g"]
    assert set(http) == set(grpc_line)
    assert {"time_to_first_token_s", "total_s", "preemptions", "prompt_tokens"} <= set(http)
    assert (http["protocol"], grpc_line["protocol"]) == ("http", "grpc")
    for line in (http, grpc_line):
        assert (line["finish_reason"], line["completion_tokens"]) == ("LENGTH", 3), line
        assert line["time_to_first_token_s"] > 0


def test_bearer_tokens_are_the_grpc_ones(guarded: ServerThread) -> None:
    served = guarded
    for key in ("wrong", "none"):
        with pytest.raises(openai.AuthenticationError) as raised:
            served.client(api_key=key).completions.create(model=served.model, prompt="Hi")
        assert raised.value.status_code == 401
        assert raised.value.body["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        served.client(api_key="wrong").models.list()
    for key in ("alpha", "beta"):
        reply = served.client(api_key=key).completions.create(
            model=served.model, prompt="Hi", max_tokens=2
        )
        assert reply.usage.completion_tokens == 2
    # probes and scrapers carry no token (--auth-metrics puts /metrics behind Control's)
    for path in ("/health", "/version", "/metrics"):
        assert get(served.base_url + path)[0] == 200
    # and gRPC takes the same tokens
    with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = pb.TokenizeRequest(texts=["Hi"])
        stub.Tokenize(request, metadata=[("authorization", "Bearer beta")], timeout=10)
        with pytest.raises(grpc.RpcError) as rpc:
            stub.Tokenize(request, metadata=[("authorization", "Bearer no")], timeout=10)
        assert rpc.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_admission_is_one_limit_for_grpc_and_http(guarded: ServerThread) -> None:
    served = guarded  # its steps are slowed: the two admitted requests still run at the 429

    async def main() -> tuple[int, dict[str, str], dict[str, Any]]:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{served.grpc_port}")
        grpc_call = generation_pb2_grpc.GenerationStub(channel).GenerateStream(
            pb.GenerateRequest(text="Hi", stopping=pb.StoppingOptions(max_new_tokens=1000)),
            metadata=[("authorization", "Bearer alpha")],
        )
        await grpc_call.read()  # Accepted: it holds one slot
        async with served.async_client(api_key="alpha") as client:
            stream = await client.completions.create(
                model=served.model, prompt="Hi", max_tokens=1000, stream=True
            )
            # its headers came back: it is admitted (queued behind gRPC's), the other slot
            try:
                await client.completions.create(model=served.model, prompt="Hi")
            except openai.RateLimitError as exc:
                return exc.status_code, dict(exc.response.headers), exc.body
            finally:
                await stream.close()
                grpc_call.cancel()
                await channel.close()
        raise AssertionError("admitted past the limit")

    status, headers, body = asyncio.run(main())
    assert status == 429 and headers["retry-after"] == "3"  # whole seconds, rounded up
    assert body["type"] == "rate_limit_error" and body["code"] == "overloaded"
    served.assert_nothing_left()


def test_draining_turns_health_and_requests_503(fake: ServerThread) -> None:
    served = fake
    client = served.client()

    async def drain_during_a_stream() -> tuple[list[str | None], str, int]:
        async with served.async_client() as aclient:
            stream = await aclient.completions.create(
                model=served.model, prompt="Hi", max_tokens=1000, stream=True
            )
            first = await stream.__anext__()
            drained = asyncio.wrap_future(
                asyncio.run_coroutine_threadsafe(served.state.drain(0.3), served.loop)
            )
            finishes = [first.choices[0].finish_reason]
            async for chunk in stream:
                finishes += [c.finish_reason for c in chunk.choices]
            health = await asyncio.to_thread(get, served.base_url + "/health")
            return finishes, json.loads(health[2])["error"]["code"], await drained

    try:
        finishes, health_code, num_aborted = asyncio.run(drain_during_a_stream())
        # the stream in flight got the drain's grace, then its end: finish_reason "abort"
        assert finishes[-1] == "abort" and num_aborted == 1
        assert health_code == "draining"
        assert get(served.base_url + "/health")[0] == 503
        with pytest.raises(openai.InternalServerError) as raised:
            client.completions.create(model=served.model, prompt="Hi")
        assert raised.value.status_code == 503 and raised.value.body["code"] == "draining"
    finally:
        resumed = served.call(served.state.resume())  # the next tests need it serving
    assert resumed
    assert get(served.base_url + "/health")[0] == 200
    client.completions.create(model=served.model, prompt="Hi", max_tokens=2)
    served.assert_nothing_left()


def test_disconnected_streams_free_everything(fake: ServerThread) -> None:
    """200 SSE streams, a third of them dropped mid-stream: none keeps running."""
    served = fake
    before = finished(served)

    async def main() -> list[int]:
        async with served.async_client(timeout=60) as client:

            async def one(i: int) -> int:
                is_dropped = i % 3 == 0
                stream = await client.completions.create(
                    model=served.model,
                    prompt=f"stream {i}",
                    max_tokens=1500 if is_dropped else 40,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                num_chunks = 0
                async for _chunk in stream:
                    num_chunks += 1
                    if is_dropped and num_chunks == 3:
                        await stream.close()  # the connection goes: a disconnect
                        break
                return num_chunks

            return await asyncio.gather(*(one(i) for i in range(200)))

    counts = asyncio.run(main())
    assert counts.count(3) >= 67 and len(counts) == 200
    served.assert_nothing_left()
    # the dropped ones were aborted (cancelled), not run out to their 1500 tokens
    after = finished(served)
    assert after["cancelled"] - before["cancelled"] == 67
    assert after["length"] - before["length"] == 133


def test_a_client_that_leaves_a_whole_response_aborts_it(fake: ServerThread) -> None:
    before = finished(fake)
    with pytest.raises(openai.APITimeoutError):
        fake.client(timeout=0.5).completions.create(model=fake.model, prompt="Hi", max_tokens=1500)
    fake.assert_nothing_left()  # within a step, not after 7.5 s of generating
    assert finished(fake)["cancelled"] - before["cancelled"] == 1


def test_a_stream_nobody_reads_is_cut_off_after_the_stall_time(fake: ServerThread) -> None:
    served = fake  # a stall time of 0.5 s; steps of 5 ms more, so the generation (>= 7.5 s)
    # outlasts the stall, which it would not with tokens scripted as fast as the loop goes
    before, stalled_before = finished(served), num_stalled(served)
    # ~20 MB of events: more than the kernel's socket buffers take in unread
    body = json.dumps(
        {"prompt": "Hi", "max_tokens": 1500, "n": 48, "stream": True, "ignore_eos": True}
    ).encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", served.http_port))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )  # and never read a byte
        deadline = time.monotonic() + 30
        while not served.run(lambda: bool(served.state.flights)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        served.wait_idle(timeout=60)
    assert num_stalled(served) - stalled_before == 1
    assert finished(served)["cancelled"] - before["cancelled"] == 1
    served.assert_nothing_left()


def test_serve_with_http_port_runs_and_stops_on_sigterm(model_dir, tmp_path: Path) -> None:
    ports = []
    for _ in range(2):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    grpc_port, http_port = ports
    log = tmp_path / "serve.log"
    command = [
        sys.executable, "-m", "asyncengine.testing", "serve", "--fake-runner",
        "--model", str(model_dir("llama")), "--host", "127.0.0.1", "--port", str(grpc_port),
        "--http-port", str(http_port), "--device", "cpu", "--torch-threads", "1",
    ]  # fmt: skip
    with open(log, "w") as stderr:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if get(f"http://127.0.0.1:{http_port}/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none", max_retries=0
        )
        model = client.models.list().data[0].id
        reply = client.completions.create(model=model, prompt="Hi", max_tokens=4)
        assert reply.usage.completion_tokens == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    events = [r.get("event") for r in records]
    assert "http_serving" in events and "server_stopped" in events


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--http-port", "70000"), "--http-port must be in"),
        (("--http-port", "9000", "--port", "9000"), "--http-port must differ"),
        (("--http-port", "9100", "--metrics-port", "9100"), "--http-port must differ"),
        (("--chat-template", "/no/such/template.jinja"), "--chat-template"),
        (("--auth-metrics", "--auth-token", "t"), "--auth-metrics needs --control-auth-token"),
    ],
)
def test_bad_http_flags_are_refused_naming_the_flag(flags: tuple[str, ...], message: str) -> None:
    ns = build_parser().parse_args(["serve", "--model", "m", *flags])
    with pytest.raises(ValueError, match=message):
        check_options(serve_options_from(ns))
    assert serve_options_from(build_parser().parse_args(["serve"])).http_port is None
