#!/usr/bin/env python3
"""N `asyncengine serve` replicas behind HAProxy (haproxy.cfg beside this file), all on loopback.

    python deploy/loadbalancer/launch.py --replicas 2                  # the bundled model
    python deploy/loadbalancer/launch.py --replicas 3 -- --model DIR --max-num-seqs 64
    python deploy/loadbalancer/launch.py --serve-command "python -m asyncengine.testing serve \
        --fake-runner"                                                   # scripted tokens

Clients talk to the balancer: gRPC on --grpc-port (50051), the HTTP API on --http-port (8000)
when the replicas have one; HAProxy's stats page and /metrics are on --stats-port (8404).
Replica i (from 0) listens on --first-replica-port + 10 i (gRPC), + 1 (metrics), + 2 (HTTP).
Once HAProxy sees every replica up it prints one JSON line (addresses, pids, logs); Ctrl-C or
SIGTERM drains the replicas, then stops HAProxy. Logs go to --run-dir (a temporary directory).

Needs haproxy (Debian: `apt-get install haproxy`). Tests import `Cluster` from here.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "haproxy.cfg"
GRPC_BACKEND, HTTP_BACKEND = "grpc_replicas", "http_replicas"


def find_haproxy() -> str | None:
    """The haproxy binary; Debian installs it in /usr/sbin, which a user's PATH may lack."""
    return shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")


def default_serve_command() -> list[str]:
    script = shutil.which("asyncengine", path=str(Path(sys.executable).parent))
    if script:
        return [script, "serve"]
    return [sys.executable, "-m", "asyncengine.server.cli", "serve"]


def serve_has_http_port(serve_command: Sequence[str]) -> bool:
    """Whether this `asyncengine serve` has the OpenAI HTTP API (`--http-port`)."""
    result = subprocess.run([*serve_command, "--help"], capture_output=True, text=True, timeout=120)
    return "--http-port" in result.stdout


@dataclass
class Replica:
    """One `asyncengine serve` process and the ports it listens on."""

    name: str
    grpc_port: int
    metrics_port: int
    http_port: int | None
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    is_stopping: bool = False  # told to exit: its exit is no failure

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, signum: int) -> None:
        """SIGTERM drains it (exit 0 once its requests finish), SIGKILL is a crash."""
        assert self.proc is not None
        self.is_stopping = True
        self.proc.send_signal(signum)


@dataclass
class Cluster:
    """Replicas and HAProxy on 127.0.0.1; `with Cluster(...) as cluster:` starts and stops them.

    `replica_ports` is one (grpc, metrics, http or None) per replica. The replicas get
    `serve_command --host 127.0.0.1 --port ... --metrics-port ... [--http-port ...]` and then
    `serve_flags`.
    """

    replica_ports: Sequence[tuple[int, int, int | None]]
    grpc_port: int
    http_port: int
    stats_port: int
    run_dir: Path
    serve_command: Sequence[str] = field(default_factory=default_serve_command)
    serve_flags: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)
    replicas: list[Replica] = field(init=False, default_factory=list)
    haproxy: subprocess.Popen[bytes] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        self.replicas = [
            Replica(f"replica{i + 1}", grpc, metrics, http, self.run_dir / f"replica{i + 1}.log")
            for i, (grpc, metrics, http) in enumerate(self.replica_ports)
        ]

    @property
    def target(self) -> str:
        """The balancer's gRPC address."""
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def has_http(self) -> bool:
        return all(r.http_port is not None for r in self.replicas)

    def servers_config(self) -> str:
        """The servers file for haproxy.cfg: each replica in both backends, same name."""
        grpc = [f"    server {r.name} 127.0.0.1:{r.grpc_port}" for r in self.replicas]
        http = [
            f"    server {r.name} 127.0.0.1:{r.http_port}"
            for r in self.replicas
            if r.http_port is not None
        ]
        return "\n".join(
            [
                f"# {len(self.replicas)} replicas on loopback, written by {Path(__file__).name}",
                f"backend {GRPC_BACKEND} from asyncengine_grpc",
                *grpc,
                f"backend {HTTP_BACKEND} from asyncengine_http",
                *http,
                "",
            ]
        )

    def start(self) -> None:
        haproxy = find_haproxy()
        if haproxy is None:
            raise RuntimeError("haproxy is not installed (Debian: apt-get install haproxy)")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for replica in self.replicas:
            self.start_replica(replica)
        servers = self.run_dir / "servers.cfg"
        servers.write_text(self.servers_config())
        env = {
            **os.environ,
            "ASYNCENGINE_LB_GRPC_BIND": f"127.0.0.1:{self.grpc_port}",
            "ASYNCENGINE_LB_HTTP_BIND": f"127.0.0.1:{self.http_port}",
            "ASYNCENGINE_LB_STATS_BIND": f"127.0.0.1:{self.stats_port}",
        }
        with open(self.run_dir / "haproxy.log", "wb") as log:
            # -db: stay in the foreground, so this process owns it and sees it exit
            command = [haproxy, "-db", "-f", str(CONFIG), "-f", str(servers)]
            self.haproxy = subprocess.Popen(command, stdout=log, stderr=log, env=env)

    def start_replica(self, replica: Replica) -> None:
        """(Re)start one replica on its ports; HAProxy puts it back once its check passes."""
        command = [
            *self.serve_command,
            "--host",
            "127.0.0.1",
            "--port",
            str(replica.grpc_port),
            "--metrics-port",
            str(replica.metrics_port),
        ]
        if replica.http_port is not None:
            command += ["--http-port", str(replica.http_port)]
        replica.is_stopping = False
        with open(replica.log_path, "ab") as log:
            replica.proc = subprocess.Popen(
                [*command, *self.serve_flags],
                stdout=subprocess.DEVNULL,
                stderr=log,
                env={**os.environ, **self.env},
            )

    def server_stats(self) -> dict[tuple[str, str], dict[str, str]]:
        """HAProxy's own view: {(backend, server): its row of the stats CSV (status, scur, ...)}."""
        url = f"http://127.0.0.1:{self.stats_port}/stats;csv"
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode().removeprefix("# ")
        rows = csv.DictReader(io.StringIO(text))
        return {
            (r["pxname"], r["svname"]): r
            for r in rows
            if r["svname"] not in ("FRONTEND", "BACKEND")
        }

    def status(self, backend: str = GRPC_BACKEND) -> dict[str, str]:
        """{server name: UP, DOWN, ...} in one backend, as HAProxy sees it now."""
        return {
            name: row["status"] for (px, name), row in self.server_stats().items() if px == backend
        }

    def wait_status(
        self, wanted: dict[str, str], backend: str = GRPC_BACKEND, timeout_s: float = 180.0
    ) -> None:
        """Poll HAProxy until these servers are in these states (e.g. {"replica1": "DOWN"})."""
        deadline = time.monotonic() + timeout_s
        seen: dict[str, str] = {}
        while time.monotonic() < deadline:
            self.check_running()
            try:
                seen = self.status(backend)
            except OSError:  # HAProxy's stats port is not open yet
                seen = {}
            if all(seen.get(name) == state for name, state in wanted.items()):
                return
            time.sleep(0.05)
        raise TimeoutError(f"{backend}: wanted {wanted}, HAProxy says {seen}\n{self.logs()}")

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Until HAProxy sees every replica up (gRPC, and HTTP where the replicas serve it)."""
        self.wait_status({r.name: "UP" for r in self.replicas}, GRPC_BACKEND, timeout_s)
        if self.has_http:
            self.wait_status({r.name: "UP" for r in self.replicas}, HTTP_BACKEND, timeout_s)

    def check_running(self) -> None:
        """Raise if HAProxy exited, or a replica that nobody stopped did."""
        if self.haproxy is not None and self.haproxy.poll() is not None:
            raise RuntimeError(f"haproxy exited with {self.haproxy.returncode}\n{self.logs()}")
        for r in self.replicas:
            if r.proc is not None and not r.is_stopping and r.proc.poll() is not None:
                raise RuntimeError(f"{r.name} exited with {r.proc.returncode}\n{self.logs()}")

    def logs(self, tail_chars: int = 3000) -> str:
        paths = [self.run_dir / "haproxy.log", *(r.log_path for r in self.replicas)]
        return "\n".join(
            f"--- {p.name}\n{p.read_text()[-tail_chars:]}" for p in paths if p.exists()
        )

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM (a drain) to every replica still running, then stop HAProxy."""
        running = [r for r in self.replicas if r.is_running]
        for replica in running:
            replica.signal(signal.SIGTERM)
        for replica in running:
            assert replica.proc is not None
            try:
                replica.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                replica.proc.kill()
                replica.proc.wait()
        if self.haproxy is not None and self.haproxy.poll() is None:
            self.haproxy.terminate()
            self.haproxy.wait(10)

    def describe(self) -> dict[str, Any]:
        return {
            "grpc": self.target,
            "http": f"127.0.0.1:{self.http_port}" if self.has_http else None,
            "stats": f"http://127.0.0.1:{self.stats_port}/stats",
            "metrics": f"http://127.0.0.1:{self.stats_port}/metrics",
            "haproxy_log": str(self.run_dir / "haproxy.log"),
            "replicas": [
                {
                    "name": r.name,
                    "pid": r.proc.pid if r.proc else None,
                    "grpc": r.target,
                    "metrics_port": r.metrics_port,
                    "http_port": r.http_port,
                    "log": str(r.log_path),
                }
                for r in self.replicas
            ],
        }

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        epilog="Arguments after -- go to every replica's `asyncengine serve`.",
    )
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--grpc-port", type=int, default=50051, help="the balancer's gRPC port")
    parser.add_argument("--http-port", type=int, default=8000, help="the balancer's HTTP port")
    parser.add_argument("--stats-port", type=int, default=8404, help="HAProxy stats, /metrics")
    parser.add_argument("--first-replica-port", type=int, default=50100)
    parser.add_argument(
        "--replica-http",
        choices=("auto", "yes", "no"),
        default="auto",
        help="give each replica --http-port (auto: if `serve --help` has it)",
    )
    parser.add_argument("--serve-command", help="how to run a replica (default: asyncengine serve)")
    parser.add_argument("--run-dir", help="logs and servers.cfg (default: a temporary directory)")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    ns, serve_flags = parser.parse_known_args(argv)
    serve_flags = [f for f in serve_flags if f != "--"]
    if find_haproxy() is None:
        print("haproxy is not installed (Debian: apt-get install haproxy)", file=sys.stderr)
        return 2
    serve_command = shlex.split(ns.serve_command) if ns.serve_command else default_serve_command()
    has_http = ns.replica_http == "yes" or (
        ns.replica_http == "auto" and serve_has_http_port(serve_command)
    )
    ports = [
        (
            ns.first_replica_port + 10 * i,
            ns.first_replica_port + 10 * i + 1,
            ns.first_replica_port + 10 * i + 2 if has_http else None,
        )
        for i in range(ns.replicas)
    ]
    run_dir = Path(ns.run_dir or tempfile.mkdtemp(prefix="asyncengine-lb-"))
    stop_requested = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    cluster = Cluster(
        ports, ns.grpc_port, ns.http_port, ns.stats_port, run_dir, serve_command, serve_flags
    )
    with cluster:
        cluster.wait_ready(ns.ready_timeout)
        print(json.dumps(cluster.describe()), flush=True)
        while not stop_requested:
            if cluster.haproxy is not None and cluster.haproxy.poll() is not None:
                print(f"haproxy exited\n{cluster.logs()}", file=sys.stderr)
                return 1
            time.sleep(0.2)
        print("draining the replicas", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
