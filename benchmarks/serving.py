"""Serving benchmark: `asyncengine serve` under N concurrent streams, gRPC and HTTP/SSE.

Starts the server as a subprocess on loopback with --http-port (gRPC and the OpenAI API on
one engine), then for each concurrency runs a closed loop of N workers, each streaming one
request after another, over each protocol in turn: GenerateStream over grpc.aio, and
/v1/completions with stream=True (read as SSE lines, or with --http-client openai through the
official AsyncOpenAI client). It reports output tokens/s, requests/s, time to first token and
inter-token latency (p50, p99) as the client sees them.

    python benchmarks/serving.py --protocols grpc http --concurrency 1 16 64 256

    python benchmarks/serving.py                          # a small random model, N = 1, 16, 64
    python benchmarks/serving.py --model DIR --concurrency 1 8 --json
    python benchmarks/serving.py --fake-runner            # the server's own cost, no model

With --fake-runner the server scripts tokens instantly (`python -m asyncengine.testing serve
--fake-runner`), and
the same load also runs in-process through `AsyncLLMEngine` with the same fake runner: the ratio
of the two is what gRPC, the servicer and the client cost per token.

ITL: each Delta's gap since the previous one, spread evenly over the tokens it carries (deltas
merge tokens when the client is slower than the engine). Over HTTP a chunk says no token count
(only the final usage does): TTFT is the first chunk with text (`vllm bench serve` takes the
first chunk, text or not: a token whose character is incomplete is a chunk with no text), and
ITL the gaps between chunks with text. The client runs in this process and shares the machine with
the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from asyncengine.v1 import generation_pb2 as pb
from asyncengine.v1 import generation_pb2_grpc

R = TypeVar("R")
SMALL_MODEL: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip


@dataclass
class Sample:
    """What one request looked like from the client."""

    ttft_s: float
    e2e_s: float
    num_tokens: int
    itls: list[float] = field(default_factory=list)
    num_deltas: int = 0  # Delta messages (gRPC) or text chunks (HTTP) it came in


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports, held open together while chosen (one at a time, a port
    can come back twice). Not asyncengine.testing's: this module's clients never import torch."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


class Server:
    """`asyncengine serve` on 127.0.0.1; stderr to a log file shown if it fails."""

    def __init__(self, model: str, flags: list[str], log_dir: str) -> None:
        self.port, self.http_port = free_ports(2)
        self.log_path = Path(log_dir) / f"server-{self.port}.log"
        script = shutil.which("asyncengine", path=str(Path(sys.executable).parent))
        command = [script, "serve"] if script else [sys.executable, "-m", "asyncengine.server.cli",
                                                    "serve"]  # fmt: skip
        if "--fake-runner" in flags:  # the test hook lives in its own entry point
            command = [sys.executable, "-m", "asyncengine.testing", "serve"]
        command += ["--model", model, "--host", "127.0.0.1", "--port", str(self.port),
                    "--http-port", str(self.http_port), *flags]  # fmt: skip
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop())
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self._log, env=env)

    def wait_serving(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited:\n{self.log_path.read_text()[-3000:]}")
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise TimeoutError(self.log_path.read_text()[-3000:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)
        self._log.close()


def prompts(num: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(prompt_len)] for _ in range(num)]


async def one_request(
    stub: generation_pb2_grpc.GenerationStub, prompt: list[int], max_tokens: int
) -> Sample:
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingOptions(temperature=0.0),
        stopping=pb.StoppingOptions(max_new_tokens=max_tokens, ignore_eos=True),
    )
    started = time.perf_counter()
    first = last = None
    num_tokens = 0
    itls: list[float] = []
    num_deltas = 0
    async for msg in stub.GenerateStream(request):
        if msg.WhichOneof("event") != "delta":
            continue
        num_deltas += 1
        now = time.perf_counter()
        new = msg.delta.completion_tokens - num_tokens
        num_tokens = msg.delta.completion_tokens
        if first is None:
            first = now
        elif last is not None and new:
            itls += [(now - last) / new] * new
        last = now
    assert first is not None and last is not None and num_tokens == max_tokens, num_tokens
    return Sample(first - started, last - started, num_tokens, itls, num_deltas)


async def closed_loop(
    target: str, concurrency: int, reqs: list[list[int]], max_tokens: int
) -> dict[str, Any]:
    """`concurrency` workers stream `reqs` one after another; the figures of the run."""
    samples: list[Sample] = []
    queue = list(reversed(reqs))
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await one_request(stub, reqs[0], 4)  # connect and warm up

        async def worker() -> None:
            while queue:
                samples.append(await one_request(stub, queue.pop(), max_tokens))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall_s = time.perf_counter() - started
    return summarize(concurrency, samples, wall_s)


async def one_http_request(client: Any, model: str, prompt: list[int], max_tokens: int) -> Sample:
    """One streamed completion read as SSE lines and json.loads: what the protocol costs, less
    the `openai` client's typed objects per chunk (one_openai_request)."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
    }  # fmt: skip
    started = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    num_tokens = 0
    async with client.stream("POST", "/completions", json=body) as reply:
        assert reply.status_code == 200, await reply.aread()
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
            if not chunk["choices"] or not chunk["choices"][0]["text"]:
                continue
            now = time.perf_counter()
            if first is None:
                first = now
            elif last is not None:
                gaps.append(now - last)
            last = now
    assert first is not None and last is not None and num_tokens == max_tokens, num_tokens
    return Sample(first - started, last - started, num_tokens, gaps, len(gaps) + 1)


async def one_openai_request(client: Any, model: str, prompt: list[int], max_tokens: int) -> Sample:
    """The same through the official `openai` client (--http-client openai)."""
    started = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    num_tokens = 0
    async for chunk in stream:
        if chunk.usage is not None:
            num_tokens = chunk.usage.completion_tokens
        if not chunk.choices or not chunk.choices[0].text:
            continue
        now = time.perf_counter()
        if first is None:
            first = now
        elif last is not None:
            gaps.append(now - last)
        last = now
    assert first is not None and last is not None and num_tokens == max_tokens, num_tokens
    return Sample(first - started, last - started, num_tokens, gaps, len(gaps) + 1)


async def closed_loop_http(
    base_url: str, concurrency: int, reqs: list[list[int]], max_tokens: int, http_client: str
) -> dict[str, Any]:
    """The same closed loop over the OpenAI API (SSE): one connection per stream, as HTTP/1.1
    has it (gRPC multiplexes every stream over one HTTP/2 connection)."""
    import openai

    try:
        import httpx2 as httpx  # what openai >= 2 speaks through
    except ImportError:
        import httpx  # type: ignore[no-redef]

    samples: list[Sample] = []
    queue = list(reversed(reqs))
    limits = httpx.Limits(max_connections=concurrency + 8)
    async with (
        httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as raw,
        openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0) as client,
    ):
        model = (await client.models.list()).data[0].id
        one, target = (
            (one_openai_request, client) if http_client == "openai" else (one_http_request, raw)
        )
        await one(target, model, reqs[0], 4)  # connect and warm up

        async def worker() -> None:
            while queue:
                samples.append(await one(target, model, queue.pop(), max_tokens))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall_s = time.perf_counter() - started
    return summarize(concurrency, samples, wall_s)


def summarize(concurrency: int, samples: list[Sample], wall_s: float) -> dict[str, Any]:
    ttfts = [s.ttft_s for s in samples]
    itls = [x for s in samples for x in s.itls]
    tokens = sum(s.num_tokens for s in samples)
    return {
        "concurrency": concurrency,
        "requests": len(samples),
        "output_tokens": tokens,
        "wall_s": round(wall_s, 3),
        "tokens_per_s": round(tokens / wall_s, 1),
        "requests_per_s": round(len(samples) / wall_s, 2),
        "ttft_p50_ms": round(percentile(ttfts, 50) * 1000, 2),
        "ttft_p99_ms": round(percentile(ttfts, 99) * 1000, 2),
        "itl_p50_ms": round(percentile(itls, 50) * 1000, 3),
        "itl_p99_ms": round(percentile(itls, 99) * 1000, 3),
        "e2e_p50_ms": round(percentile([s.e2e_s for s in samples], 50) * 1000, 1),
        "deltas_per_request": round(sum(s.num_deltas for s in samples) / len(samples), 2),
    }


async def in_process(
    model: str, concurrency: int, reqs: list[list[int]], max_tokens: int, max_num_seqs: int
) -> dict[str, Any]:
    """The same closed loop through AsyncLLMEngine with the fake runner: no gRPC at all."""
    from asyncengine import EngineArgs, SamplingParams
    from asyncengine.testing import fake_engine

    args = EngineArgs(model=model, device="cpu", max_num_seqs=max_num_seqs,
                      num_gpu_blocks_override=4096, num_cpu_blocks_override=0)  # fmt: skip
    engine = fake_engine(args)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    queue, tokens, ids = list(reqs), 0, iter(range(10**9))

    async def worker() -> None:
        nonlocal tokens
        while queue:
            async for out in engine.generate(queue.pop(), params, request_id=f"r{next(ids)}"):  # noqa: B007
                pass
            tokens += len(out.outputs[0].token_ids)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall_s = time.perf_counter() - started
    await engine.shutdown()
    return {"concurrency": concurrency, "in_process_tokens_per_s": round(tokens / wall_s, 1)}


def measure(
    protocol: str, target: str, n: int, reqs: list[list[int]], max_tokens: int, http_client: str
) -> dict[str, Any]:
    """One closed loop over `protocol`."""
    if protocol == "grpc":
        return asyncio.run(closed_loop(target, n, reqs, max_tokens))
    return asyncio.run(closed_loop_http(target, n, reqs, max_tokens, http_client))


def _in_process(*args: Any) -> dict[str, Any]:
    return asyncio.run(in_process(*args))


def fresh(fn: Callable[..., R], *args: Any) -> R:
    """`fn(*args)` in a new interpreter: a client never shares its process with what an earlier
    one left running (grpc's poller threads, an engine's), which skews the next by 2-4x."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(fn, *args).result()


class Floor:
    """benchmarks/grpc_floor.py on 127.0.0.1: bare grpc.aio, `num_deltas` Deltas a request."""

    def __init__(self, num_deltas: int) -> None:
        (self.port,) = free_ports(1)
        script = Path(__file__).with_name("grpc_floor.py")
        command = [sys.executable, str(script), "--port", str(self.port), "--deltas",
                   str(num_deltas)]  # fmt: skip
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert self.proc.stdout is not None and self.proc.stdout.readline() == b"serving\n"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def run(ns: argparse.Namespace, model: str, log_dir: str) -> list[dict[str, Any]]:
    max_num_seqs = max(ns.concurrency)
    flags = ["--device", "cpu", "--dtype", "float32", "--torch-threads", str(ns.threads),
             "--max-num-seqs", str(max_num_seqs), "--max-queued-requests", "0",
             "--max-model-len", str(ns.prompt_len + ns.max_tokens + 16),
             "--log-level", "WARNING"]  # fmt: skip
    if ns.fake_runner:
        flags.append("--fake-runner")
    from transformers import AutoConfig

    vocab_size = int(AutoConfig.from_pretrained(model).vocab_size)
    rows = []
    local: dict[int, dict[str, Any]] = {}  # the in-process run of each concurrency
    for engine in ns.engine:
        mode = [] if engine == "process" else ["--no-engine-process"]
        server = Server(model, flags + mode, log_dir)
        try:
            server.wait_serving()
            for i, n in enumerate(ns.concurrency):
                reqs = prompts(ns.requests_per_stream * n, ns.prompt_len, vocab_size, ns.seed + i)
                if ns.fake_runner and n not in local:
                    local[n] = fresh(_in_process, model, n, reqs, ns.max_tokens, max_num_seqs)
                for protocol in ns.protocols:
                    target = f"127.0.0.1:{server.port}"
                    if protocol == "http":
                        target = f"http://127.0.0.1:{server.http_port}/v1"
                    row = {"protocol": protocol, "engine": engine,
                           **best_of(ns.repeat, protocol, target, n, reqs, ns)}  # fmt: skip
                    rows.append(against_in_process(row, local))
        finally:
            server.stop()
    if ns.floor:
        rows += floor_rows(ns, rows, vocab_size, local)
    return rows


def best_of(
    repeat: int, protocol: str, target: str, n: int, reqs: list[list[int]], ns: argparse.Namespace
) -> dict[str, Any]:
    """The fastest of `repeat` closed loops, each client in a fresh process (least disturbed)."""
    runs = [
        fresh(measure, protocol, target, n, reqs, ns.max_tokens, ns.http_client)
        for _ in range(repeat)
    ]
    return max(runs, key=lambda r: r["tokens_per_s"])


def floor_rows(
    ns: argparse.Namespace,
    rows: list[dict[str, Any]],
    vocab_size: int,
    local: dict[int, dict[str, Any]],
) -> list[dict[str, Any]]:
    """The same closed loops against bare grpc.aio sending as many Deltas per request as the
    first engine's gRPC rows received: what no Python gRPC server can beat here."""
    floor = []
    for i, n in enumerate(ns.concurrency):
        served = next(r for r in rows if r["protocol"] == "grpc" and r["concurrency"] == n)
        num_deltas = max(1, round(served["deltas_per_request"]))
        reqs = prompts(ns.requests_per_stream * n, ns.prompt_len, vocab_size, ns.seed + i)
        server = Floor(num_deltas)
        try:
            target = f"127.0.0.1:{server.port}"
            row = {"protocol": "grpc", "engine": f"floor ({num_deltas} deltas)",
                   **best_of(ns.repeat, "grpc", target, n, reqs, ns)}  # fmt: skip
        finally:
            server.stop()
        floor.append(against_in_process(row, local))
    return floor


def against_in_process(row: dict[str, Any], local: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """`row` with the in-process rate of its concurrency and its ratio to it (when measured),
    echoed to stderr as it comes."""
    measured = local.get(row["concurrency"])
    if measured is not None:
        in_process = measured["in_process_tokens_per_s"]
        row["in_process_tokens_per_s"] = in_process
        row["server_share"] = round(row["tokens_per_s"] / in_process, 3)
    print(json.dumps(row), file=sys.stderr)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF model directory (default: a random small Llama)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument(
        "--protocols",
        nargs="+",
        choices=["grpc", "http"],
        default=["grpc", "http"],
        help="gRPC GenerateStream and/or the OpenAI API's SSE (default: both)",
    )
    parser.add_argument(
        "--http-client",
        choices=["sse", "openai"],
        default="sse",
        help="read HTTP streams as SSE lines (default) or through the official openai client",
    )
    parser.add_argument("--requests-per-stream", type=int, default=4)
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs per row; the fastest is kept (busy machines)"
    )
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    parser.add_argument("--fake-runner", action="store_true")
    parser.add_argument(
        "--engine",
        nargs="+",
        choices=["process", "inline"],
        default=["process"],
        help="where the server steps the engine: its own process (the default) or the "
        "server's event loop (--no-engine-process); one server each, rows side by side",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also run the loops against bare grpc.aio (benchmarks/grpc_floor.py) sending as "
        "many Deltas per request as the server did: the most a Python gRPC server can deliver",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = ns.model
        if model is None:
            from asyncengine.testing import make_random_model

            model = str(make_random_model(Path(tmp) / "model", "llama", vocab_size=4096,
                                          max_position_embeddings=2048, **SMALL_MODEL))  # fmt: skip
        rows = run(ns, model, tmp)
    config = {k: v for k, v in vars(ns).items() if k != "json"}
    if ns.json:
        print(json.dumps({"config": config, "results": rows}, indent=2))
        return
    mode = "fake runner" if ns.fake_runner else "model"
    print(f"asyncengine serve ({mode}), {ns.prompt_len}-token prompts, {ns.max_tokens} tokens each")
    head = ["protocol", "engine", "N", "tok/s", "req/s", "TTFT p50", "TTFT p99", "ITL p50",
            "ITL p99", "deltas/req"]  # fmt: skip
    keys = ["protocol", "engine", "concurrency", "tokens_per_s", "requests_per_s",
            "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
            "deltas_per_request"]  # fmt: skip
    if ns.fake_runner:
        head += ["in-proc tok/s", "server/in-proc"]
        keys += ["in_process_tokens_per_s", "server_share"]
    print("  ".join(f"{h:>12}" for h in head) + "   (ms)")
    for row in rows:
        print("  ".join(f"{row.get(k, '-'):>12}" for k in keys))


if __name__ == "__main__":
    main()
