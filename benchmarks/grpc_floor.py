"""The gRPC floor: the server's CPU per request against bare grpc.aio sending the same messages.

The floor is a bare grpc.aio Generation servicer that runs no engine at all: each
GenerateStream call gets what asyncengine's server sends for a request (Accepted, `--deltas`
Delta messages carrying the tokens, Finished and Usage). Nothing is validated, admitted,
scheduled or logged, so it is what grpc.aio and protobuf alone cost per request on this machine:
no server written in Python with grpc.aio does a request on less CPU with that many messages.

    python benchmarks/grpc_floor.py                            # N = 16, 64, 256; 2 rounds
    python benchmarks/grpc_floor.py --concurrency 256 --rounds 3 --json
    python benchmarks/grpc_floor.py --port 50100 --deltas 12   # serve the floor until killed
    python benchmarks/grpc_floor.py --step-delay 0.002         # steps as long as a model's

Each round runs, for each concurrency N, a closed loop of N streams of 64-token requests
(benchmarks/serving.py's client, in a process of its own) against `asyncengine serve
--fake-runner` (scripted tokens, the engine in its own process), then against the floor sending
as many Deltas per request as the server did; rounds alternate the two. It reports CPU
seconds per request of the server's process (the gRPC front end: what issue 27 bounds at 1.5x
the floor's), of its engine process beside it, and of the floor's process, read from /proc
around the timed loop: two shared cores distort wall time, far less the CPU a request takes.
benchmarks/serving.py --floor starts the floor too, for its throughput rows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import grpc
from machine import cpu_flags  # beside this file

from asyncengine.v1 import generation_pb2 as pb
from asyncengine.v1 import generation_pb2_grpc

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class FloorServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, num_deltas: int) -> None:
        self.num_deltas = max(1, num_deltas)

    async def GenerateStream(self, request: pb.GenerateRequest, context: Any) -> None:
        max_tokens = request.stopping.max_new_tokens or 16
        num_prompt = len(request.token_ids.ids)
        await context.write(
            pb.GenerateResponse(accepted=pb.Accepted(request_id="floor", prompt_tokens=num_prompt))
        )
        sent = 0
        for i in range(self.num_deltas):
            upto = max_tokens * (i + 1) // self.num_deltas
            ids = list(range(sent, upto))
            delta = pb.Delta(
                sequence_number=i + 1,
                token_offset=sent,
                text="ab" * len(ids),
                completion_tokens=upto,
            )
            sent = upto
            await context.write(pb.GenerateResponse(delta=delta))
        await context.write(pb.GenerateResponse(finished=pb.Finished(reason=pb.LENGTH)))
        usage = pb.Usage(prompt_tokens=num_prompt, completion_tokens=max_tokens)
        await context.write(pb.GenerateResponse(usage=usage))


async def serve(port: int, num_deltas: int) -> None:
    server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServicer_to_server(FloorServicer(num_deltas), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("serving", flush=True)
    await server.wait_for_termination()


# -- the comparison ---------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU of one process (its threads; not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def engine_pid(server_pid: int) -> int | None:
    """The server's engine process: its child spawned by multiprocessing (None with
    --no-engine-process; the resource tracker is a child too)."""
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    return None


def timed_loop(
    target: str, pids: dict[str, int], n: int, reqs: list[list[int]], max_tokens: int
) -> dict[str, Any]:
    """serving.py's closed loop with the CPU each of `pids` spent during it (in the client's
    process, so neither its start nor its warm-up request counts)."""
    import serving  # beside this file

    async def main() -> dict[str, Any]:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            await serving.one_request(stub, reqs[0], 4)  # connect and warm up
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        row = await serving.closed_loop(target, n, reqs, max_tokens)
        used = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
        row["cpu_ms_per_request"] = {
            name: round(1000 * cpu_s / (row["requests"] + 1), 3) for name, cpu_s in used.items()
        }  # the loop's own warm-up request counts: it ran inside the window
        return row

    return asyncio.run(main())


def start_server(model: str, flags: list[str], log_path: Path) -> tuple[Any, str]:
    """`asyncengine serve --fake-runner` on a port of its own; the process and its target."""
    import serving

    server = serving.Server(model, ["--fake-runner", *flags], str(log_path))
    server.wait_serving()
    return server, f"127.0.0.1:{server.port}"


def run_round(
    ns: argparse.Namespace, model: str, tmp: str, vocab_size: int, deltas: dict[int, float]
) -> list[dict[str, Any]]:
    """The server at each concurrency, then the floor sending as many Deltas per request."""
    import serving

    flags = ["--device", "cpu", "--dtype", "float32", "--torch-threads", "1",
             "--max-num-seqs", str(max(ns.concurrency)), "--max-queued-requests", "0",
             "--max-model-len", str(ns.prompt_len + ns.max_tokens + 16),
             "--log-level", ns.log_level, "--step-delay", str(ns.step_delay)]  # fmt: skip
    rows = []
    server, target = start_server(model, flags, Path(tmp))
    try:
        pids = {"server": server.proc.pid}
        child = engine_pid(server.proc.pid)
        if child is not None:
            pids["engine"] = child
        for i, n in enumerate(ns.concurrency):
            reqs = serving.prompts(ns.requests_per_stream * n, ns.prompt_len, vocab_size, i)
            row = serving.fresh(timed_loop, target, pids, n, reqs, ns.max_tokens)
            deltas[n] = row["deltas_per_request"]
            rows.append({"server": "asyncengine", **row})
    finally:
        server.stop()
    for i, n in enumerate(ns.concurrency):
        reqs = serving.prompts(ns.requests_per_stream * n, ns.prompt_len, vocab_size, i)
        floor = serving.Floor(max(1, round(deltas[n])))
        try:
            target = f"127.0.0.1:{floor.port}"
            row = serving.fresh(timed_loop, target, {"server": floor.proc.pid}, n, reqs,
                                ns.max_tokens)  # fmt: skip
            rows.append({"server": "floor", **row})
        finally:
            floor.stop()
    return rows


def summary(rows: list[dict[str, Any]], concurrency: list[int]) -> list[dict[str, Any]]:
    """Per concurrency: medians over the rounds, and the server / floor ratio of each round."""
    out = []
    for n in concurrency:
        ours = [r for r in rows if r["server"] == "asyncengine" and r["concurrency"] == n]
        floor = [r for r in rows if r["server"] == "floor" and r["concurrency"] == n]
        ratios = [
            a["cpu_ms_per_request"]["server"] / b["cpu_ms_per_request"]["server"]
            for a, b in zip(ours, floor)
        ]

        def med(rs: list[dict[str, Any]], key: str) -> float | None:
            values = [r["cpu_ms_per_request"][key] for r in rs if key in r["cpu_ms_per_request"]]
            return round(statistics.median(values), 3) if values else None

        def median_of(rs: list[dict[str, Any]], key: str) -> float:
            return round(statistics.median(r[key] for r in rs), 2)

        out.append({
            "concurrency": n, "server_cpu_ms": med(ours, "server"),
            "engine_cpu_ms": med(ours, "engine"), "floor_cpu_ms": med(floor, "server"),
            "ratio": round(statistics.median(ratios), 2), "ratios": [round(r, 2) for r in ratios],
            "deltas_per_request": median_of(ours, "deltas_per_request"),
            "server_tokens_per_s": round(median_of(ours, "tokens_per_s")),
            "floor_tokens_per_s": round(median_of(floor, "tokens_per_s")),
        })  # fmt: skip
    return out


def compare(ns: argparse.Namespace) -> None:
    import serving
    from transformers import AutoConfig

    from asyncengine.testing import make_random_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        shape = {"vocab_size": 4096, "max_position_embeddings": 2048, **serving.SMALL_MODEL}
        model = str(make_random_model(model_dir, "llama", **shape))
        vocab_size = int(AutoConfig.from_pretrained(model).vocab_size)
        rows: list[dict[str, Any]] = []
        deltas: dict[int, float] = {}
        for index in range(ns.rounds):
            for row in run_round(ns, model, tmp, vocab_size, deltas):
                rows.append({"round": index + 1, **row})
                print(json.dumps(rows[-1]), file=sys.stderr)
    table = summary(rows, ns.concurrency)
    machine = {"cpu": f"{platform.processor() or platform.machine()} ({cpu_flags()})",
               "cores": os.cpu_count(), "load_average": os.getloadavg()}  # fmt: skip
    if ns.json:
        config = {k: v for k, v in vars(ns).items() if k not in ("json", "port", "deltas")}
        print(json.dumps({"config": config, **machine, "summary": table, "runs": rows}, indent=2))
        return
    print(f"server CPU per {ns.max_tokens}-token request (fake runner) against bare grpc.aio "
          f"sending as many messages; {ns.rounds} rounds, medians")  # fmt: skip
    print(f"CPU {machine['cpu']}, {machine['cores']} cores, load average at the end "
          f"{' '.join(f'{x:.1f}' for x in machine['load_average'])}")  # fmt: skip
    head = ["N", "deltas/req", "server ms", "engine ms", "floor ms", "server/floor",
            "per round", "server tok/s", "floor tok/s"]  # fmt: skip
    print("  ".join(f"{h:>12}" for h in head))
    for r in table:
        cells = [r["concurrency"], r["deltas_per_request"], r["server_cpu_ms"],
                 r["engine_cpu_ms"] or "-", r["floor_cpu_ms"],
                 f"{r['ratio']:.2f}x", ",".join(f"{x:.2f}" for x in r["ratios"]),
                 r["server_tokens_per_s"], r["floor_tokens_per_s"]]  # fmt: skip
        print("  ".join(f"{c:>12}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, help="only serve the floor on this port")
    parser.add_argument("--deltas", type=int, default=12, help="Delta messages per request")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256])
    # /proc counts CPU in clock ticks (10 ms): with 4 requests a stream the floor's process
    # spent 3 ticks at 16 streams on a quiet machine; 32 make it 14 or more
    parser.add_argument("--requests-per-stream", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    # the fake runner steps in microseconds, so a stream's tokens go out in one or a few
    # Deltas; a model's step takes milliseconds, and each token is a Delta of its own
    parser.add_argument(
        "--step-delay", type=float, default=0.0, help="seconds every engine step takes more"
    )
    parser.add_argument("--log-level", default="INFO", help="the server's (INFO: as deployed)")
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args()
    if ns.port is not None:
        import uvloop  # as `asyncengine serve` runs

        uvloop.run(serve(ns.port, ns.deltas))
        return
    sys.path.insert(0, str(Path(__file__).parent))  # serving.py, for the spawned clients too
    compare(ns)


if __name__ == "__main__":
    main()
