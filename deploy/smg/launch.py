#!/usr/bin/env python3
"""N asyncengine replicas behind the Shepherd Model Gateway (PyPI smg) on this host.

    python deploy/smg/launch.py --model DIR                  # 2 replicas, gateway on :30000
    python deploy/smg/launch.py --model DIR --replicas 4 --policy round_robin
    python deploy/smg/launch.py --model DIR --dry-run        # print the commands as JSON

Replica i serves gRPC on --grpc-port + i and metrics on --replica-metrics-port + i, with the
prefix cache's KV events on; the gateway (cache_aware by default) listens for OpenAI HTTP on
--port, exports its metrics on --metrics-port, tokenizes with --model's tokenizer and follows
the replicas' KV events and loads. Arguments after `--` go to every replica's `serve`. SIGINT
or SIGTERM stops the gateway, then drains the replicas (SIGTERM: they finish their requests).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

POLICIES = ("cache_aware", "round_robin", "power_of_two", "least_load", "prefix_hash")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the model directory every replica serves")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--host", default="127.0.0.1", help="where the gateway listens")
    p.add_argument("--port", type=int, default=30000, help="the gateway's OpenAI HTTP port")
    p.add_argument("--metrics-port", type=int, default=29000, help="the gateway's metrics")
    p.add_argument("--grpc-port", type=int, default=50051, help="replica 0's gRPC port")
    p.add_argument("--replica-metrics-port", type=int, default=9090, help="replica 0's metrics")
    p.add_argument("--policy", choices=POLICIES, default="cache_aware")
    p.add_argument("--block-size", type=int, default=16, help="the replicas' KV block size")
    p.add_argument("--run-dir", type=Path, default=Path("smg-run"), help="the logs go here")
    p.add_argument("--dry-run", action="store_true", help="print the commands, start nothing")
    p.add_argument("serve_args", nargs="*", help="after --: more flags for every replica")
    return p


def serve_commands(ns: argparse.Namespace) -> list[list[str]]:
    serve = shutil.which("asyncengine") or "asyncengine"
    return [
        [serve, "serve", "--model", ns.model, "--host", "127.0.0.1",
         "--port", str(ns.grpc_port + i), "--metrics-port", str(ns.replica_metrics_port + i),
         "--block-size", str(ns.block_size), "--enable-kv-events", *ns.serve_args]
        for i in range(ns.replicas)
    ]  # fmt: skip


def smg_command(ns: argparse.Namespace) -> list[str]:
    smg = shutil.which("smg", path=str(Path(sys.executable).parent)) or "smg"
    workers = [f"grpc://127.0.0.1:{ns.grpc_port + i}" for i in range(ns.replicas)]
    return [
        smg, "launch", "--host", ns.host, "--port", str(ns.port),
        "--prometheus-host", ns.host, "--prometheus-port", str(ns.metrics_port),
        "--policy", ns.policy, "--block-size", str(ns.block_size), "--model-path", ns.model,
        "--log-json", "--worker-urls", *workers,
    ]  # fmt: skip


def plan(ns: argparse.Namespace) -> dict[str, Any]:
    return {"replicas": serve_commands(ns), "gateway": smg_command(ns)}


def run(ns: argparse.Namespace) -> int:
    ns.run_dir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    commands = [*serve_commands(ns), smg_command(ns)]
    names = [*(f"replica{i}" for i in range(ns.replicas)), "smg"]
    for name, command in zip(names, commands):
        with open(ns.run_dir / f"{name}.log", "ab") as log:
            procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
    print(f"gateway: http://{ns.host}:{ns.port}/v1 (logs in {ns.run_dir})", flush=True)
    code = 0
    while not stopping:
        failed = [(n, p.returncode) for n, p in zip(names, procs) if p.poll() is not None]
        if failed:
            print(f"exited: {failed}", file=sys.stderr)
            code = 1
            break
        time.sleep(0.5)
    for proc in reversed(procs):  # the gateway first, so no new request reaches a draining replica
        if proc.poll() is None:
            proc.terminate()
            proc.wait(120)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    if ns.dry_run:
        print(json.dumps(plan(ns), indent=2))
        return 0
    return run(ns)


if __name__ == "__main__":
    sys.exit(main())
