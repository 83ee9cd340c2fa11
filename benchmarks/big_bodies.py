"""Big bodies against a running server: the canary's worst gap while each one arrives (issue 24).

Each body of issue 24's table is built and sent by a process of its own (`attack`), so what is
measured is the server: a canary stream in this process records its gaps between messages while
the body is sent, read and refused. Bodies are sent over raw sockets (HTTP) or a gRPC channel
made for the one call. `measure(...)` is the reusable part (soak.py's big-body phase may call it).

    asyncengine serve --model M --http-port 8000 &
    python benchmarks/big_bodies.py --target 127.0.0.1:50051 --http 127.0.0.1:8000 [--json]
    python benchmarks/big_bodies.py --attack http_nested --http 127.0.0.1:8000   # one body
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


# name -> (protocol, body builder): a small control, then what issue 24 measured, each refused
BODIES: dict[str, tuple[str, Callable[[], bytes]]] = {
    "http_small": ("http", lambda: _json({"prompt": "x", "max_tokens": 1})),  # the control
    "http_nested": ("http", lambda: _json({"prompt": [list(range(100))] * 100_000})),
    "http_nested_3e4": ("http", lambda: _json({"prompt": [list(range(100))] * 33_000})),
    "http_ids": ("http", lambda: _json({"prompt": list(range(1_000_000))})),
    "http_text": ("http", lambda: _json({"prompt": "a" * 63_000_000})),
    # the largest body the default --max-message-size (8 MiB) reads: a text over its bound
    "http_text_8m": ("http", lambda: _json({"prompt": "a" * ((8 << 20) - 16)})),
    # the same size as a client with ensure_ascii sends non-ASCII text: escapes to decode
    "http_text_escaped": ("http", lambda: json.dumps({"prompt": "\u00e9" * 10_000_000}).encode()),
    "http_logit_bias": (
        "http",
        lambda: _json({"prompt": "x", "logit_bias": {str(i): 1.0 for i in range(100_000)}}),
    ),
    "http_stop": ("http", lambda: _json({"prompt": "x", "stop": ["ab"] * 1_000_000})),
    # the tests' sizes: main's stall well over a loaded machine's noise
    "http_logit_bias_1e6": (
        "http",
        lambda: _json({"prompt": "x", "logit_bias": {str(i): 1.0 for i in range(1_000_000)}}),
    ),
    "http_stop_3e6": ("http", lambda: _json({"prompt": "x", "stop": ["ab"] * 3_000_000})),
    "grpc_ids": ("grpc", lambda: _grpc_ids()),
    "grpc_ids_60m": ("grpc", lambda: _grpc_ids(60_000_000)),  # main's stall well over noise
}


def send_http(address: str, path: str, body: bytes, timeout_s: float = 60) -> int:
    """POST `body` over a plain socket (blocking I/O: no event loop, the GIL mostly free);
    the response's status, or 0 when the server closed before answering."""
    host, port = address.rsplit(":", 1)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        with contextlib.suppress(OSError):  # refused before the end: the answer may be there
            sock.sendall(head + body)
        reply = b""
        try:
            while b"\r\n" not in reply:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                reply += chunk
        except OSError:
            pass
    parts = reply.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def _grpc_ids(num_ids: int = 15_000_000) -> bytes:
    from asyncengine.v1 import generation_pb2 as pb

    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * num_ids)).SerializeToString()


def send_grpc(target: str, method: str, message: bytes, timeout_s: float = 60) -> int:
    """Call a server-streaming `method` with `message` as it is (already serialized); the
    status code's number (0: OK)."""
    import grpc

    options = [("grpc.max_send_message_length", 1 << 30)]
    with grpc.insecure_channel(target, options=options) as channel:
        call = channel.unary_stream(method)  # no serializers: bytes in, bytes out
        try:
            for _ in call(message, timeout=timeout_s):
                pass
        except grpc.RpcError as exc:
            return int(exc.code().value[0])
    return 0


def attack(name: str, http: str | None, target: str | None) -> dict[str, Any]:
    """Send one body (in this process); its status and how long it took."""
    protocol, build = BODIES[name]
    body = build()
    print(json.dumps({"sending": name}), flush=True)  # the measured window starts here
    began = time.perf_counter()
    if protocol == "grpc":
        assert target, "a gRPC body needs --target"
        status = send_grpc(target, "/asyncengine.v1.Generation/GenerateStream", body)
    else:
        assert http, "an HTTP body needs --http"
        status = send_http(http, "/v1/completions", body)
    return {"body": name, "status": status, "took_s": time.perf_counter() - began}


async def _canary(
    target: str, ready: asyncio.Event, stop: asyncio.Event, gaps: list[float], num_tokens: int
):
    import grpc

    from asyncengine.v1 import generation_pb2 as pb
    from asyncengine.v1 import generation_pb2_grpc

    request = pb.GenerateRequest(
        text="the canary sings",
        sampling=pb.SamplingOptions(temperature=0.0),
        stopping=pb.StoppingOptions(max_new_tokens=num_tokens, ignore_eos=True),
    )
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        while not stop.is_set():
            call = stub.GenerateStream(request, timeout=120)
            last = None
            async for _ in call:
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                    if len(gaps) >= 20:
                        ready.set()
                last = now
                if stop.is_set():
                    call.cancel()
                    break


async def measure(
    name: str, target: str, http: str | None, canary_tokens: int = 900
) -> dict[str, Any]:
    """The canary's worst and median gap (on gRPC `target`) while another process sends `name`
    (`canary_tokens` per canary stream: prompt + them must fit the server's context)."""
    ready, stop = asyncio.Event(), asyncio.Event()
    gaps: list[float] = []
    canary = asyncio.create_task(_canary(target, ready, stop, gaps, canary_tokens))
    await asyncio.wait_for(ready.wait(), 60)
    argv = [sys.executable, __file__, "--attack", name, "--target", target]
    proc = await asyncio.create_subprocess_exec(
        *argv, *(["--http", http] if http else []), stdout=subprocess.PIPE
    )
    assert proc.stdout is not None
    await proc.stdout.readline()  # built: gaps count from here, not the attacker's imports
    num_before = len(gaps)
    out, _ = await proc.communicate()
    await asyncio.sleep(0.3)  # the canary streams on past the end of the call
    stop.set()
    await asyncio.wait_for(canary, 60)
    result = json.loads(out)
    during = gaps[max(0, num_before - 1) :] or gaps
    result.update(worst_gap_s=max(during), median_gap_s=statistics.median(gaps))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="the server's gRPC address (the canary's)")
    parser.add_argument("--http", help="the server's HTTP address (host:port)")
    parser.add_argument("--attack", help="send one body and print its status (as JSON)")
    tests_only = (
        "http_nested_3e4", "http_text_escaped", "http_logit_bias_1e6", "http_stop_3e6",
        "grpc_ids_60m",
    )  # fmt: skip
    table = [name for name in BODIES if name not in tests_only]
    parser.add_argument("--bodies", default=",".join(table), help=f"of {', '.join(BODIES)}")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.attack:
        print(json.dumps(attack(args.attack, args.http, args.target)))
        return
    rows = [asyncio.run(measure(n, args.target, args.http)) for n in args.bodies.split(",")]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'body':18} {'status':>6} {'took s':>7} {'worst gap ms':>13} {'median ms':>10}")
    for row in rows:
        print(
            f"{row['body']:18} {row['status']:>6} {row['took_s']:7.2f} "
            f"{row['worst_gap_s'] * 1000:13.1f} {row['median_gap_s'] * 1000:10.1f}"
        )


if __name__ == "__main__":
    main()
