"""Replicas behind HAProxy, with the shipped config (deploy/loadbalancer/haproxy.cfg) and the
shipped launcher (deploy/loadbalancer/launch.py), on loopback: the split over sequential calls, a
SIGTERM drain that moves new load off a replica before it exits, a replica SIGKILLed under 100
streams, the HTTP API; and the Kubernetes manifests of the same (deploy/kubernetes/loadbalancer/).

The replicas run the tests' tiny model for real (float32) as `asyncengine serve` subprocesses, so
a stream's text through the balancer is held to the text its prompt gets alone. HAProxy is
Debian's package: .ci/run installs it; elsewhere these tests skip, saying so, without it.
"""

from __future__ import annotations

import asyncio
import http.client
import importlib.util
import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import kubernetes_validate
import pytest
import yaml
from asyncengine_client import UnavailableError
from asyncengine_client.errors import error_from_rpc
from grpc_health.v1 import health_pb2

from asyncengine.server.cli import build_parser
from asyncengine.testing import free_ports
from asyncengine.v1 import generation_pb2 as pb
from asyncengine.v1 import generation_pb2_grpc

from .conftest import parse_metrics, value
from .test_deploy import K8S_VERSIONS
from .utils import greedy_request

ROOT = Path(__file__).resolve().parents[2]
LB_DIR = ROOT / "deploy" / "loadbalancer"
KUBE_LB = ROOT / "deploy" / "kubernetes" / "loadbalancer"
REPLICA_HEADER = "x-asyncengine-replica"  # set by haproxy.cfg: the server that took the call
# distinct prompts (token ids of the test model's 512), cycled over the streams
PROMPTS = [[3 + 7 * i, 40 + i, 100 + 5 * i] for i in range(10)]
NUM_STREAMS = 100
STREAM_TOKENS = 64


def load_launcher() -> Any:
    spec = importlib.util.spec_from_file_location("asyncengine_lb_launch", LB_DIR / "launch.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


launch = load_launcher()


@pytest.fixture(scope="module")
def haproxy() -> str:
    path = launch.find_haproxy()
    if path is None:
        pytest.skip("haproxy is not installed (apt-get install haproxy; .ci/run installs it)")
    return str(path)


@pytest.fixture
def cluster(haproxy: str, model_dir: Callable[..., Path], tmp_path: Path) -> Iterator[Any]:
    """`cluster(http=False)`: 2 replicas of the tiny model behind HAProxy, every one UP."""
    started: list[Any] = []

    def make(*, http: bool = False) -> Any:
        free = iter(free_ports(9))
        ports = [(next(free), next(free), next(free) if http else None) for _ in range(2)]
        flags = ["--model", str(model_dir("llama")), "--device", "cpu", "--dtype", "float32",
                 "--torch-threads", "1", "--drain-grace-period", "30"]  # fmt: skip
        made = launch.Cluster(
            ports, next(free), next(free), next(free), tmp_path / f"cluster{len(started)}",
            serve_flags=flags, env={"OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        started.append(made)
        made.start()
        made.wait_ready()
        return made

    yield make
    for made in started:
        made.stop()


@dataclass
class Stream:
    """One GenerateStream as its caller saw it; `code` is None while it runs."""

    prompt: int
    replica: str | None = None
    text: str = ""
    num_deltas: int = 0
    finish_reason: int | None = None
    code: grpc.StatusCode | None = None
    details: str = ""
    error: grpc.aio.AioRpcError | None = None
    started_at: float = 0.0


async def run_stream(
    stub: generation_pb2_grpc.GenerationStub, stream: Stream, max_new_tokens: int
) -> Stream:
    stream.started_at = time.monotonic()
    call = stub.GenerateStream(greedy_request(PROMPTS[stream.prompt], max_new_tokens), timeout=60)
    try:
        stream.replica = (await call.initial_metadata()).get(REPLICA_HEADER)
        async for response in call:
            kind = response.WhichOneof("event")
            if kind == "delta":
                stream.text += response.delta.text
                stream.num_deltas += 1
            elif kind == "finished":
                stream.finish_reason = response.finished.reason
        stream.code = grpc.StatusCode.OK
    except grpc.aio.AioRpcError as error:
        stream.code, stream.details = error.code(), error.details() or ""
        stream.error = error
        # an error before any message comes as trailers alone: the header is among them
        stream.replica = stream.replica or error.trailing_metadata().get(REPLICA_HEADER)
    return stream


def texts_alone(target: str, max_new_tokens: int) -> list[str]:
    """Each prompt's text streamed alone, straight from one replica."""

    async def main() -> list[str]:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            texts = []
            for i in range(len(PROMPTS)):
                stream = await run_stream(stub, Stream(i), max_new_tokens)
                assert stream.code == grpc.StatusCode.OK, stream
                texts.append(stream.text)
            return texts

    return asyncio.run(main())


def finished_by_length(cluster: Any) -> dict[str, int]:
    """Each replica's own count of requests that ran to max_new_tokens (its /metrics)."""
    counts = {}
    for replica in cluster.replicas:
        url = f"http://127.0.0.1:{replica.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            samples = parse_metrics(reply.read().decode())
        counts[replica.name] = int(
            value(samples, "asyncengine_requests_finished_total", reason="length")
        )
    return counts


def is_cut_off(stream: Stream) -> bool:
    """A clear end for a stream whose replica died under it: UNAVAILABLE, or what grpc makes of
    HAProxy 2.6 closing the client's stream with END_STREAM and no trailers (UNKNOWN, 'Stream
    removed'; grpc-go says INTERNAL). Never OK, never a deadline. No per-call balancer Debian
    packages gives UNAVAILABLE here: docs/operations.md ("Death") has what each one gives."""
    if stream.code == grpc.StatusCode.UNAVAILABLE:
        return True
    return stream.code == grpc.StatusCode.UNKNOWN and "Stream removed" in stream.details


def test_the_split_is_even_and_a_sigterm_drain_moves_new_load_off_before_exit(
    cluster: Any,
) -> None:
    lb = cluster()
    first, second = lb.replicas

    async def sequential(num: int) -> list[Stream]:
        async with grpc.aio.insecure_channel(lb.target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            return [await run_stream(stub, Stream(i % len(PROMPTS)), 4) for i in range(num)]

    before = finished_by_length(lb)
    streams = asyncio.run(sequential(100))
    after = finished_by_length(lb)
    assert {s.code for s in streams} == {grpc.StatusCode.OK}
    by_header = Counter(s.replica for s in streams)
    by_metrics = {name: after[name] - before[name] for name in after}
    # within 10% of even: 45..55 each, by HAProxy's header and by the replicas' own counters
    assert by_header == by_metrics, (by_header, by_metrics)
    assert all(45 <= n <= 55 for n in by_metrics.values()), by_metrics

    drain = asyncio.run(drain_under_load(lb))
    # the long streams on the draining replica ran to the end in its grace period; exit 0
    assert [(s.code, s.finish_reason) for s in drain["held"]] == [
        (grpc.StatusCode.OK, pb.FinishReason.LENGTH)
    ] * 2, drain["held"]
    assert first.proc.wait(60) == 0
    t_term, t_down = drain["t_term"], drain["t_down"]
    assert t_down - t_term < 5, "HAProxy took more than 5 s to see the drain"
    # new load left it before it exited: the calls made once HAProxy saw it draining all went
    # to the other replica while the drained one was still running
    moved = [s for s in drain["traffic"] if s.started_at > t_down]
    assert len(moved) >= 10 and drain["was_running"], drain
    assert {(s.code, s.replica) for s in moved} == {(grpc.StatusCode.OK, second.name)}
    # before HAProxy saw it, a call that reached it was refused (nothing accepted, retryable)
    for s in drain["traffic"]:
        assert s.code == grpc.StatusCode.OK or (
            s.code == grpc.StatusCode.UNAVAILABLE and s.replica == first.name
        ), s


async def drain_under_load(lb: Any) -> dict[str, Any]:
    """SIGTERM replica1 while two long streams hold it in its drain and a caller keeps sending
    short calls through the balancer; when HAProxy took it out and what the calls saw."""
    first = lb.replicas[0]
    traffic: list[Stream] = []
    async with (
        grpc.aio.insecure_channel(first.target) as direct,
        grpc.aio.insecure_channel(lb.target) as balanced,
    ):
        held = [Stream(i) for i in range(2)]
        direct_stub = generation_pb2_grpc.GenerationStub(direct)
        held_tasks = [asyncio.create_task(run_stream(direct_stub, s, 1500)) for s in held]
        while not all(s.num_deltas for s in held):
            await asyncio.sleep(0.01)
        stub = generation_pb2_grpc.GenerationStub(balanced)
        t_down: float | None = None

        async def send() -> None:
            while t_down is None or sum(s.started_at > t_down for s in traffic) < 10:
                traffic.append(await run_stream(stub, Stream(len(traffic) % len(PROMPTS)), 4))

        sender = asyncio.create_task(send())
        await asyncio.sleep(0.3)
        t_term = time.monotonic()
        first.signal(signal.SIGTERM)
        await asyncio.to_thread(lb.wait_status, {first.name: "DOWN"})
        t_down = time.monotonic()
        await sender
        was_running = first.is_running
        await asyncio.gather(*held_tasks)
    return {"held": held, "traffic": traffic, "t_term": t_term, "t_down": t_down,
            "was_running": was_running}  # fmt: skip


def test_a_replica_killed_under_100_streams(cluster: Any) -> None:
    lb = cluster()
    victim, survivor = lb.replicas
    alone = texts_alone(victim.target, STREAM_TOKENS)

    async def main() -> tuple[list[Stream], int, list[Stream]]:
        async with grpc.aio.insecure_channel(lb.target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            streams = [Stream(i % len(PROMPTS)) for i in range(NUM_STREAMS)]
            tasks, killed_after = [], 0
            for i, stream in enumerate(streams):
                tasks.append(asyncio.create_task(run_stream(stub, stream, STREAM_TOKENS)))
                await asyncio.sleep(0.005)
                mid_stream = [s for s in streams[:i] if s.replica == victim.name
                              and s.num_deltas and s.code is None]  # fmt: skip
                if not killed_after and i >= 30 and len(mid_stream) >= 3:
                    victim.signal(signal.SIGKILL)
                    killed_after = i + 1
            # every stream ends, one way or the other, well inside its 60 s deadline
            await asyncio.wait_for(asyncio.gather(*tasks), 90)
            await asyncio.to_thread(lb.wait_status, {victim.name: "DOWN"})
            later = [Stream(i % len(PROMPTS)) for i in range(20)]
            await asyncio.gather(*(run_stream(stub, s, STREAM_TOKENS) for s in later))
            return streams, killed_after, later

    streams, killed_after, later = asyncio.run(main())
    assert 0 < killed_after <= 90, "the kill should land mid-load"
    cut = [s for s in streams if s.code != grpc.StatusCode.OK]
    for s in streams:
        if s.code == grpc.StatusCode.OK:
            assert (s.finish_reason, s.text) == (pb.FinishReason.LENGTH, alone[s.prompt]), s
        else:  # cut off on the killed replica, after a prefix of its text
            assert is_cut_off(s) and s.replica in (None, victim.name), s
            assert alone[s.prompt].startswith(s.text), s
            # and the project's client says it plainly: the replica is gone, send it again
            assert s.error is not None
            assert isinstance(error_from_rpc(s.error), UnavailableError), s
    assert cut, "no stream was in flight on the killed replica"
    # the calls made after the kill never saw it: refused connections were sent to the survivor
    launched_after = streams[killed_after:]
    assert {(s.code, s.replica) for s in launched_after} == {(grpc.StatusCode.OK, survivor.name)}
    # and once HAProxy has it down, new requests all succeed on the survivor, same text
    assert [(s.code, s.replica, s.text) for s in later] == [
        (grpc.StatusCode.OK, survivor.name, alone[s.prompt]) for s in later
    ]
    assert victim.proc.wait(10) == -signal.SIGKILL
    print(f"killed after {killed_after} streams; {len(cut)} cut off:",
          Counter((s.code.name if s.code else None, s.details) for s in cut))  # fmt: skip


def serve_has_http_port() -> bool:
    try:
        build_parser().parse_args(["serve", "--http-port", "0"])
    except SystemExit:
        return False
    return True


class Http:
    """Plain HTTP/1.1 to the balancer's HTTP port: status, the replica header, the body."""

    def __init__(self, port: int) -> None:
        self.port = port

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, str | None, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            payload = None if body is None else json.dumps(body)
            conn.request(method, path, payload, {"content-type": "application/json"})
            reply = conn.getresponse()
            return reply.status, reply.getheader(REPLICA_HEADER), reply.read()
        finally:
            conn.close()


@pytest.mark.skipif(
    not serve_has_http_port(), reason="asyncengine serve has no --http-port yet (issue 14)"
)
def test_the_http_api_through_the_balancer(cluster: Any) -> None:
    lb = cluster(http=True)
    first, second = lb.replicas
    api = Http(lb.http_port)
    status, _, body = api.call("GET", "/v1/models")
    assert status == 200, body
    model = json.loads(body)["data"][0]["id"]
    request = {"model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0}
    replies = [api.call("POST", "/v1/completions", request) for _ in range(20)]
    assert {status for status, _, _ in replies} == {200}
    texts = {json.loads(body)["choices"][0]["text"] for _, _, body in replies}
    assert len(texts) == 1  # greedy: the same text from either replica
    split = Counter(replica for _, replica, _ in replies)
    assert set(split) == {first.name, second.name} and all(9 <= n <= 11 for n in split.values())
    status, replica, body = api.call("POST", "/v1/completions", {**request, "stream": True})
    assert status == 200 and replica in (first.name, second.name)
    events = [line for line in body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 2, body

    # GET /health is 503 while a replica drains: HAProxy takes it out of the HTTP backend too
    async def hold_and_drain() -> list[tuple[int, str | None, bytes]]:
        async with grpc.aio.insecure_channel(first.target) as direct:
            stub = generation_pb2_grpc.GenerationStub(direct)
            held = Stream(0)
            task = asyncio.create_task(run_stream(stub, held, 1500))
            while not held.num_deltas:
                await asyncio.sleep(0.01)
            first.signal(signal.SIGTERM)
            await asyncio.to_thread(lb.wait_status, {first.name: "DOWN"}, launch.HTTP_BACKEND)
            moved = [await asyncio.to_thread(api.call, "POST", "/v1/completions", request)
                     for _ in range(5)]  # fmt: skip
            assert first.is_running
            await task
            assert held.code == grpc.StatusCode.OK
            return moved

    moved = asyncio.run(hold_and_drain())
    assert [(status, replica) for status, replica, _ in moved] == [(200, second.name)] * 5
    assert first.proc.wait(60) == 0


# -- the shipped files ----------------------------------------------------------------------


def manifests() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(KUBE_LB.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def by_kind(kind: str) -> dict[str, Any]:
    (doc,) = [d for d in manifests() if d["kind"] == kind]
    return doc


def haproxy_check(haproxy: str, *configs: str, tmp_path: Path) -> None:
    paths = []
    for i, text in enumerate(configs):
        paths += ["-f", str(tmp_path / f"{i}.cfg")]
        (tmp_path / f"{i}.cfg").write_text(text)
    env = {"POD_NAMESPACE": "default", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([haproxy, "-c", *paths], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[WARNING]" not in result.stdout + result.stderr, result.stdout + result.stderr


def test_the_shipped_configs_are_valid_and_kubernetes_uses_the_same_one(
    haproxy: str, tmp_path: Path
) -> None:
    config = (LB_DIR / "haproxy.cfg").read_text()
    haproxy_check(haproxy, config, (LB_DIR / "servers.example.cfg").read_text(), tmp_path=tmp_path)
    data = by_kind("ConfigMap")["data"]
    assert data == {"haproxy.cfg": config, "servers.cfg": (KUBE_LB / "servers.cfg").read_text()}
    haproxy_check(haproxy, config, data["servers.cfg"], tmp_path=tmp_path)
    for doc in manifests():
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
    # enough server slots for the autoscaler's ceiling, found through the headless Service
    hpa = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "hpa.yaml").read_text())
    headless = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "service.yaml").read_text())
    for line in data["servers.cfg"].splitlines():
        if line.strip().startswith("server-template"):
            _, _, slots, address, *_ = line.split()
            assert int(slots) >= hpa["spec"]["maxReplicas"]
            assert address.startswith(f'"{headless["metadata"]["name"]}.${{POD_NAMESPACE}}.svc')
    # the balancer's pods, ports and probes agree with its Service and its config
    deployment, service = by_kind("Deployment"), by_kind("Service")
    pod = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)
    for name, env_var in (("grpc", "GRPC"), ("http", "HTTP"), ("stats", "STATS")):
        assert f'bind "${{ASYNCENGINE_LB_{env_var}_BIND-:{ports[name]}}}"' in config
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert "monitor-uri /healthz" in config
    assert by_kind("PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= (
        pod["metadata"]["labels"].items()
    )


def test_the_health_check_bytes_are_a_grpc_health_check_of_readiness() -> None:
    """haproxy.cfg's tcp-check sends one HTTP/2 exchange written out by hand: decode it."""
    lines = [line.split() for line in (LB_DIR / "haproxy.cfg").read_text().splitlines()]
    sent = b"".join(bytes.fromhex(words[2]) for words in lines
                    if words[:2] == ["tcp-check", "send-binary"])  # fmt: skip
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    assert sent.startswith(preface)
    frames = []
    rest = sent[len(preface) :]
    while rest:
        length, kind, flags = int.from_bytes(rest[:3], "big"), rest[3], rest[4]
        stream_id = int.from_bytes(rest[5:9], "big")
        frames.append((kind, flags, stream_id, rest[9 : 9 + length]))
        rest = rest[9 + length :]
    settings, headers, data = frames
    assert settings == (0x4, 0, 0, b"")
    assert headers[:3] == (0x1, 0x4, 1)  # HEADERS, END_HEADERS, stream 1
    assert hpack_literals(headers[3]) == [
        (":method", "POST"), (":scheme", "http"), (":path", "/grpc.health.v1.Health/Check"),
        (":authority", "lb"), ("content-type", "application/grpc"), ("te", "trailers"),
    ]  # fmt: skip
    message = health_pb2.HealthCheckRequest(service="").SerializeToString()
    assert data == (0x0, 0x1, 1, b"\0" + len(message).to_bytes(4, "big") + message)
    # what the check accepts: stream 1's DATA frame holding HealthCheckResponse(SERVING)
    serving = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
    body = serving.SerializeToString()
    reply = len(body) + 5
    expected = reply.to_bytes(3, "big") + b"\0\0" + (1).to_bytes(4, "big") + b"\0"
    expected += len(body).to_bytes(4, "big") + body
    (expect,) = [w for w in lines if w[:4] == ["tcp-check", "expect", "min-recv", "0"]]
    assert expect[4:6] == ["binary", expected.hex()]


# HPACK's static table, the entries the check uses (RFC 7541, appendix A)
_STATIC = {1: (":authority", ""), 3: (":method", "POST"), 4: (":path", "/"),
           6: (":scheme", "http"), 31: ("content-type", "")}  # fmt: skip


def hpack_literals(block: bytes) -> list[tuple[str, str]]:
    """Decode the HPACK forms the check uses: indexed fields and literals without indexing
    (no Huffman coding), as RFC 7541 sections 6.1 and 6.2.2 define them."""
    fields, i = [], 0

    def string() -> str:
        nonlocal i
        assert not block[i] & 0x80, "Huffman coded"
        length = block[i]
        i += 1 + length
        return block[i - length : i].decode()

    while i < len(block):
        first = block[i]
        if first & 0x80:  # indexed header field
            fields.append(_STATIC[first & 0x7F])
            i += 1
            continue
        assert first & 0xF0 == 0, f"not a literal without indexing: {first:#x}"
        index = first & 0x0F
        i += 1
        if index == 0x0F:  # the 4-bit prefix overflows into the next byte
            index += block[i]
            i += 1
        name = _STATIC[index][0] if index else string()
        fields.append((name, string()))
    return fields
