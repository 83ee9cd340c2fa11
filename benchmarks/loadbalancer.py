"""Throughput through HAProxy (deploy/loadbalancer/) against direct calls to the same replicas.

One run starts N replicas and HAProxy with deploy/loadbalancer/launch.py, then for each
concurrency runs the same closed loop (serving.py's: N workers, each streaming one request after
another) twice: `direct`, one gRPC channel that balances over the replicas itself (round_robin,
the setup for clients that can), and `haproxy`, one channel to the balancer. The split column is
what each replica's own /metrics counted.

    python benchmarks/loadbalancer.py                         # a small random model, 2 replicas
    python benchmarks/loadbalancer.py --fake-runner           # scripted tokens: the proxy's cost
    python benchmarks/loadbalancer.py --model DIR --replicas 3 --concurrency 8 32 --json

Everything shares this machine's cores: HAProxy, the replicas and the client.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
from serving import SMALL_MODEL, Sample, free_ports, one_request, prompts, summarize

from asyncengine.v1 import generation_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]


def load_launcher() -> Any:
    path = ROOT / "deploy" / "loadbalancer" / "launch.py"
    spec = importlib.util.spec_from_file_location("asyncengine_lb_launch", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def finished(cluster: Any) -> list[int]:
    """Requests each replica has finished by length (its own /metrics)."""
    counts = []
    for replica in cluster.replicas:
        url = f"http://127.0.0.1:{replica.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            lines = reply.read().decode().splitlines()
        key = 'asyncengine_requests_finished_total{reason="length"}'
        (line,) = [x for x in lines if x.startswith(key)]
        counts.append(int(float(line.split()[-1])))
    return counts


async def closed_loop(
    target: str, options: list[tuple[str, Any]], concurrency: int, reqs: list[list[int]],
    max_tokens: int, cluster: Any,
) -> dict[str, Any]:  # fmt: skip
    samples: list[Sample] = []
    queue = list(reversed(reqs))
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        # connect (to every replica, for round_robin) before the clock starts
        await asyncio.gather(*(one_request(stub, reqs[0], 4) for _ in range(4)))

        async def worker() -> None:
            while queue:
                samples.append(await one_request(stub, queue.pop(), max_tokens))

        before = await asyncio.to_thread(finished, cluster)
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall_s = time.perf_counter() - started
        split = [a - b for a, b in zip(await asyncio.to_thread(finished, cluster), before)]
    return {**summarize(concurrency, samples, wall_s), "split": "/".join(map(str, split))}


def run(ns: argparse.Namespace, model: str, run_dir: Path) -> list[dict[str, Any]]:
    launch = load_launcher()
    if launch.find_haproxy() is None:
        raise SystemExit("haproxy is not installed (Debian: apt-get install haproxy)")
    flags = ["--model", model, "--device", "cpu", "--dtype", "float32",
             "--torch-threads", str(ns.threads), "--max-num-seqs", str(max(ns.concurrency)),
             "--max-model-len", str(ns.prompt_len + ns.max_tokens + 16),
             "--log-level", "WARNING"]  # fmt: skip
    command = launch.default_serve_command()
    if ns.fake_runner:
        command = [sys.executable, "-m", "asyncengine.testing", "serve", "--fake-runner"]
    free = iter(free_ports(2 * ns.replicas + 3))
    ports = [(next(free), next(free), None) for _ in range(ns.replicas)]
    cluster = launch.Cluster(ports, next(free), next(free), next(free), run_dir,
                             serve_command=command, serve_flags=flags,
                             env={"OMP_NUM_THREADS": str(ns.threads)})  # fmt: skip
    from transformers import AutoConfig

    vocab_size = int(AutoConfig.from_pretrained(model).vocab_size)
    direct_target = "ipv4:" + ",".join(r.target for r in cluster.replicas)
    modes = {
        "direct": (direct_target, [("grpc.lb_policy_name", "round_robin")]),
        "haproxy": (cluster.target, []),
    }
    rows = []
    with cluster:
        cluster.wait_ready()
        for i, n in enumerate(ns.concurrency):
            reqs = prompts(ns.requests_per_stream * n, ns.prompt_len, vocab_size, ns.seed + i)
            for mode, (target, options) in modes.items():
                row = asyncio.run(closed_loop(target, options, n, reqs, ns.max_tokens, cluster))
                row = {"mode": mode, **row}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF model directory (default: a random small Llama)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--requests-per-stream", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="each replica's torch threads")
    parser.add_argument("--fake-runner", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = ns.model
        if model is None:
            from asyncengine.testing import make_random_model

            model = str(make_random_model(Path(tmp) / "model", "llama", vocab_size=4096,
                                          max_position_embeddings=2048, **SMALL_MODEL))  # fmt: skip
        rows = run(ns, model, Path(tmp) / "run")
    config = {k: v for k, v in vars(ns).items() if k != "json"}
    direct = {r["concurrency"]: r for r in rows if r["mode"] == "direct"}
    for row in rows:
        row["vs_direct"] = round(
            row["tokens_per_s"] / direct[row["concurrency"]]["tokens_per_s"], 3
        )
    if ns.json:
        print(json.dumps({"config": config, "results": rows}, indent=2))
        return
    what = "fake runner" if ns.fake_runner else "model"
    print(f"{ns.replicas} replicas ({what}), {ns.prompt_len}-token prompts, "
          f"{ns.max_tokens} tokens each; direct = client-side round_robin")  # fmt: skip
    head = ["N", "mode", "tok/s", "vs direct", "req/s", "TTFT p50", "TTFT p99", "ITL p50",
            "ITL p99", "split"]  # fmt: skip
    keys = ["concurrency", "mode", "tokens_per_s", "vs_direct", "requests_per_s", "ttft_p50_ms",
            "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "split"]  # fmt: skip
    print("  ".join(f"{h:>10}" for h in head) + "   (ms)")
    for row in rows:
        print("  ".join(f"{row[k]:>10}" for k in keys))


if __name__ == "__main__":
    main()
