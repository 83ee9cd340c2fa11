"""Prefix-aware routing: SMG cache_aware (KV events on) against SMG round_robin and HAProxy
leastconn, in front of the same two replicas, on a shared-prefix workload.

P prefixes of L tokens, Q questions each, sent interleaved (question q of every prefix, then
q+1) by C streaming OpenAI clients. Each replica's KV cache holds `--cache-fraction` of all the
prefixes' blocks (plus room for the running requests), so a policy that sends every prefix
everywhere makes each replica evict what it will need next; one that keeps each prefix on one
replica fits. Measured per mode: the replicas' own prefix-cache hit rate (prompt tokens found
cached / looked up, from their /metrics), output tokens/s, TTFT p50/p99 at the client.

    python benchmarks/gateway.py        # a small random model: 32 x 1024 tokens x 8, ~4 min
    python benchmarks/gateway.py --prefixes 8 --prefix-len 256 --questions 2   # a smoke run
    python benchmarks/gateway.py --prefix-len 2048 --json

Each mode gets prefixes of its own (same lengths, other words), so no mode finds another's
blocks. Everything shares this machine's cores: the gateways, the replicas and the client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
from loadbalancer import load_launcher
from machine import cpu_flags  # beside this file
from serving import SMALL_MODEL, free_ports, percentile

MODEL_NAME = "bench"
MODES = ["smg_cache_aware", "smg_round_robin", "haproxy_leastconn"]


def make_prompts(tokenizer: Any, ns: argparse.Namespace, seed: int) -> list[str]:
    """Interleaved prompts: each prefix (about `prefix_len` tokens of random words) + question."""
    rng = random.Random(seed)
    prefixes = []
    for _ in range(ns.prefixes):
        words: list[str] = []
        while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < ns.prefix_len:
            words += [f"w{rng.randrange(10**6)}" for _ in range(32)]
        ids = tokenizer.encode(" ".join(words), add_special_tokens=False)[: ns.prefix_len]
        prefixes.append(tokenizer.decode(ids))
    order = list(range(ns.prefixes))
    out = []
    for question in range(ns.questions):
        rng.shuffle(order)
        out += [f"{prefixes[p]} question {question} {rng.randrange(10**6)}?" for p in order]
    return out


def cache_counts(cluster: Any) -> tuple[float, float]:
    """(queries, hits) in prompt tokens, summed over the replicas' /metrics."""
    queries = hits = 0.0
    for replica in cluster.replicas:
        url = f"http://127.0.0.1:{replica.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith("asyncengine_prefix_cache_queries"):
                    queries += float(line.split()[-1])
                elif line.startswith("asyncengine_prefix_cache_hits"):
                    hits += float(line.split()[-1])
    return queries, hits


async def one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> tuple[float, int]:
    started, ttft, num = time.perf_counter(), None, 0
    stream = await client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            ttft = ttft if ttft is not None else time.perf_counter() - started
            num += 1
    return (ttft if ttft is not None else time.perf_counter() - started), num


async def closed_loop(base_url: str, prompts: list[str], ns: argparse.Namespace) -> dict[str, Any]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=600)
    queue = list(reversed(prompts))
    ttfts: list[float] = []
    num_tokens = 0

    async def worker() -> None:
        nonlocal num_tokens
        while queue:
            ttft, num = await one(client, queue.pop(), ns.max_tokens)
            ttfts.append(ttft)
            num_tokens += num

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(ns.concurrency)))
    wall_s = time.perf_counter() - started
    await client.close()
    return {
        "requests": len(ttfts),
        "output_tokens_per_s": round(num_tokens / wall_s, 1),
        "ttft_p50_ms": round(1000 * percentile(ttfts, 50), 1),
        "ttft_p99_ms": round(1000 * percentile(ttfts, 99), 1),
        "wall_s": round(wall_s, 1),
    }


def start_smg(cluster: Any, policy: str, run_dir: Path) -> tuple[subprocess.Popen[bytes], int]:
    port, metrics_port = free_ports(2)
    command = [
        str(Path(sys.executable).parent / "smg"), "launch", "--host", "127.0.0.1",
        "--port", str(port), "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(metrics_port), "--policy", policy, "--log-level", "warn",
        "--worker-urls", *(f"grpc://{r.target}" for r in cluster.replicas),
    ]  # fmt: skip
    with open(run_dir / f"smg-{policy}.log", "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    return proc, port


def wait_answering(base_url: str, timeout_s: float = 180.0) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=30)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.completions.create(model=MODEL_NAME, prompt="warm up", max_tokens=2)
            return
        except (openai.APIError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def run_mode(mode: str, cluster: Any, prompts: list[str], ns: argparse.Namespace) -> dict[str, Any]:
    proc = None
    if mode == "haproxy_leastconn":
        base_url = f"http://127.0.0.1:{cluster.http_port}/v1"
    else:
        proc, port = start_smg(cluster, mode.removeprefix("smg_"), cluster.run_dir)
        base_url = f"http://127.0.0.1:{port}/v1"
    try:
        wait_answering(base_url)
        time.sleep(1.0)  # both workers registered (and subscribed) before the clock starts
        before = cache_counts(cluster)
        row = asyncio.run(closed_loop(base_url, prompts, ns))
        queries, hits = (a - b for a, b in zip(cache_counts(cluster), before))
        return {"mode": mode, "hit_rate": round(hits / queries, 3) if queries else 0.0, **row}
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)


def run(ns: argparse.Namespace, model: str, run_dir: Path) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    launch = load_launcher()
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt_blocks = -(-(ns.prefix_len + 64 + ns.max_tokens) // ns.block_size)
    prefix_blocks = ns.prefixes * (ns.prefix_len // ns.block_size)
    num_blocks = int(ns.cache_fraction * prefix_blocks) + ns.concurrency * prompt_blocks
    flags = ["--model", model, "--device", "cpu", "--dtype", "float32",
             "--torch-threads", str(ns.threads), "--max-num-seqs", str(ns.concurrency),
             "--max-model-len", str(prompt_blocks * ns.block_size),
             "--block-size", str(ns.block_size), "--num-gpu-blocks-override", str(num_blocks),
             "--served-model-name", MODEL_NAME, "--enable-kv-events",
             "--log-level", "WARNING"]  # fmt: skip
    free = iter(free_ports(3 * ns.replicas + 3))
    ports = [(next(free), next(free), next(free)) for _ in range(ns.replicas)]
    env = {"OMP_NUM_THREADS": str(ns.threads)}
    cluster = launch.Cluster(
        ports, next(free), next(free), next(free), run_dir, serve_flags=flags, env=env
    )
    rows = []
    with cluster:
        cluster.wait_ready()
        for i, mode in enumerate(ns.modes):
            row = run_mode(mode, cluster, make_prompts(tokenizer, ns, ns.seed + i), ns)
            row["kv_blocks_per_replica"] = num_blocks
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF model directory (default: a random small Llama)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--prefixes", type=int, default=32)
    parser.add_argument("--prefix-len", type=int, default=1024, help="tokens per prefix")
    parser.add_argument("--questions", type=int, default=8, help="requests per prefix")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument(
        "--cache-fraction", type=float, default=0.6,
        help="each replica's cache, as a fraction of all prefixes' blocks",
    )  # fmt: skip
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="each replica's torch threads")
    parser.add_argument("--modes", nargs="+", default=MODES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = ns.model
        if model is None:
            from asyncengine.testing import make_random_model

            model = str(make_random_model(Path(tmp) / "model", "llama", vocab_size=4096,
                                          max_position_embeddings=4096, **SMALL_MODEL))  # fmt: skip
        rows = run(ns, model, Path(tmp) / "run")
    config = {**{k: v for k, v in vars(ns).items() if k != "json"}, "cpu_flags": cpu_flags()}
    base = next((r for r in rows if r["mode"] == "smg_round_robin"), None)
    for row in rows:
        if base is not None and base["hit_rate"]:
            row["hit_rate_vs_rr"] = round(row["hit_rate"] / base["hit_rate"], 2)
    if ns.json:
        print(json.dumps({"config": config, "results": rows}, indent=2))
        return
    print(f"{ns.replicas} replicas, {ns.prefixes} prefixes x {ns.prefix_len} tokens x "
          f"{ns.questions} questions, {ns.max_tokens} tokens out, {ns.concurrency} streams, "
          f"cache {ns.cache_fraction} of the prefixes per replica; "
          f"CPU flags: {config['cpu_flags']}")  # fmt: skip
    head = ["mode", "hit rate", "vs rr", "out tok/s", "TTFT p50", "TTFT p99", "wall s"]
    keys = ["mode", "hit_rate", "hit_rate_vs_rr", "output_tokens_per_s", "ttft_p50_ms",
            "ttft_p99_ms", "wall_s"]  # fmt: skip
    print(f"{head[0]:>18}" + "".join(f"{h:>11}" for h in head[1:]) + "   (ms)")
    for row in rows:
        print(f"{row['mode']:>18}" + "".join(f"{row.get(k, '-')!s:>11}" for k in keys[1:]))


if __name__ == "__main__":
    main()
