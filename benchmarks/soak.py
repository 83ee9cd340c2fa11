"""Soak: `asyncengine serve` under streams that end badly, readers that stall and hostile requests.

Starts the server on loopback with a small admission limit (8 running + 32 queued), then runs
rounds of streams of which a third end early, at random points: the client cancels, a short
deadline passes, the channel is closed, or a child process holding streams is SIGKILLed. Each
round also opens stalled readers: streams of many tokens with logprobs whose client reads two
messages and then never again (the HTTP/2 window fills, the handler blocks on its write).

After each round, once the engine is idle, it reports what must come back:
  * leaked KV blocks: LoadReport total - free, device and CPU (idle prefix-cache blocks count as
    free, so this is 0 on a healthy server);
  * stuck admission slots: LoadReport.admitted, and a probe that opens as many streams as the
    server admits (max_num_seqs + max_queued_requests) and counts the refused ones;
  * the server's RSS, each stream's final status per way of ending, and which stalled readers
    the server ended (after `serve --stall-timeout`, passed when the server has that flag);
    each stalled reader then reads again, so a status queued behind its buffered messages
    shows, and a stream the server never ended just finishes OK.

Each round then sends issue 24's big bodies (HTTP and gRPC, each from a process of its own)
and a burst of 2,000 streams opened at once, while a canary streams; after each, the same
measure. After the last round a canary stream runs while an 8 MiB text prompt and a request
with 1,000,000 stop strings are sent: both must be refused fast (RESOURCE_EXHAUSTED past the
default --max-message-size, INVALID_ARGUMENT). The canary's worst gap should stay within 100 ms
of its normal gap in every phase (reported), and RSS flat over the last 5 rounds (reported).
Exits 1 if blocks leaked, admission slots are stuck, a stream ended CANCELLED that nobody
cancelled, or a refusal counted past the admission limit.

    python benchmarks/soak.py --model default      # the bundled model, 10 rounds of 150 streams
    python benchmarks/soak.py --fake-runner        # scripted tokens: the server's own paths
    python benchmarks/soak.py --rounds 1 --streams 60 --json
    python benchmarks/soak.py --rounds 2 --streams 0 --stalled 0 --big-bodies "" --no-hostile
                                                   # the burst phase alone, twice
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from soak_phases import STREAM_METHOD, big_body_phase, burst_phase, hostile_phase, words
from soak_report import ENDINGS, failures, goals, print_report

from asyncengine import default_model
from asyncengine.v1 import control_pb2, control_pb2_grpc, generation_pb2_grpc
from asyncengine.v1 import generation_pb2 as pb

# issue 24's table (benchmarks/big_bodies.py's default) after a small control body
BIG_BODIES = "http_small,http_nested,http_ids,http_text,http_logit_bias,http_stop,grpc_ids"
# a child that holds streams until it is SIGKILLed; it imports only grpc, so it starts fast,
# and sends the request bytes it is given, so it needs no generated code
CHILD = r"""
import asyncio, base64, sys, grpc
async def main(target, requests):
    channel = grpc.aio.insecure_channel(target)
    method = channel.unary_stream(sys.argv[2])
    async def one(i, request):
        seen = 0
        try:
            async for _ in method(request):
                seen += 1
                if seen == 2:
                    print("started", i, flush=True)
        except grpc.aio.AioRpcError as exc:
            print("ended", i, exc.code().name, flush=True)
            return
        print("ended", i, "OK", flush=True)
    await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    await asyncio.sleep(600)  # until the SIGKILL
asyncio.run(main(sys.argv[1], [base64.b64decode(x) for x in sys.stdin.read().split()]))
"""


@dataclass
class Plan:
    """One stream of a round: how it ends and what it asks for."""

    ending: str
    request: pb.GenerateRequest
    num_reads: int = 0  # cancel / close: messages read before ending it
    deadline_s: float = 120.0


@dataclass
class Stalled:
    """A reader that read two messages and stopped: the server should end it (stall time)."""

    call: Any
    channel: grpc.aio.Channel
    stalled_at: float
    ended_at: float | None = None
    status: str = "still open"


@dataclass
class Shape:
    """What the server admits and holds, from GetModelInfo."""

    vocab_size: int
    num_slots: int  # max_num_seqs + max_queued_requests


# -- the server -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve_command(fake_runner: bool = False) -> list[str]:
    if fake_runner:  # the test hook has its own entry point; `asyncengine serve` lacks the flag
        return [sys.executable, "-m", "asyncengine.testing", "serve"]
    script = shutil.which("asyncengine", path=str(Path(sys.executable).parent))
    return (
        [script, "serve"] if script else [sys.executable, "-m", "asyncengine.server.cli", "serve"]
    )


def serve_flags(ns: argparse.Namespace, help_text: str) -> list[str]:
    max_model_len = max(ns.stall_tokens, ns.canary_tokens) + 128
    flags = ["--device", "cpu", "--dtype", "float32", "--torch-threads", "1",
             "--max-num-seqs", str(ns.max_num_seqs),
             "--max-queued-requests", str(ns.max_queued_requests),
             "--max-model-len", str(max_model_len),
             "--num-gpu-blocks-override", str(ns.gpu_blocks),
             "--num-cpu-blocks-override", str(ns.cpu_blocks),
             "--drain-grace-period", "5", "--log-level", "INFO"]  # fmt: skip
    if "--stall-timeout" in help_text:
        flags += ["--stall-timeout", str(ns.stall_timeout)]
    if ns.fake_runner:
        flags.append("--fake-runner")
    if ns.no_engine_process:
        flags.append("--no-engine-process")
    return flags


def start_server(
    model: str, flags: list[str], log_path: Path
) -> tuple[subprocess.Popen[bytes], int, int]:
    """The server, its gRPC port and its HTTP port (the big bodies go to both)."""
    port, http_port = free_port(), free_port()
    command = [*serve_command("--fake-runner" in flags), "--model", model, "--host", "127.0.0.1",
               "--port", str(port), "--http-port", str(http_port)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*command, *flags], stdout=subprocess.DEVNULL, stderr=log, env=env)
    return proc, port, http_port


async def wait_serving(proc: subprocess.Popen[bytes], target: str, log_path: Path) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + 180
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{log_path.read_text()[-3000:]}")
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(log_path.read_text()[-3000:])


def rss_mib(pid: int) -> dict[str, float]:
    """The server's resident memory now and at its peak (VmRSS, VmHWM), its processes summed:
    the server, its engine process and any workers of that (the peak is the sum of each
    process's own peak, an upper bound of theirs together)."""
    totals = {"VmRSS": 0.0, "VmHWM": 0.0}
    for each in (pid, *descendants(pid)):
        try:
            status = Path(f"/proc/{each}/status").read_text()
        except FileNotFoundError:  # ended meanwhile
            continue
        for line in status.splitlines():
            key, _, value = line.partition(":")
            if key in totals:
                totals[key] += int(value.split()[0]) / 1024
    return {"rss_mib": round(totals["VmRSS"], 1), "peak_rss_mib": round(totals["VmHWM"], 1)}


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (from each process's parent id in /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def log_summary(log_path: Path) -> dict[str, Any]:
    """Counts of what the server logged: levels, leak warnings, tracebacks, finish reasons."""
    levels: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    events: Counter[str] = Counter()
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            levels["non-json"] += 1
            continue
        levels[str(record.get("level", "?"))] += 1
        if record.get("event") == "request_finished":
            reasons[str(record.get("finish_reason"))] += 1
        elif record.get("level") in ("warning", "error", "critical"):
            events[str(record.get("event"))[:60]] += 1
    return {"levels": dict(levels), "finish_reasons": dict(reasons), "warnings": dict(events)}


# -- requests ---------------------------------------------------------------------------------


def make_request(
    rng: random.Random, shape: Shape, max_new_tokens: int, text_share: float = 0.2, **response: Any
) -> Any:
    """A stream request: a shared 32-token prefix (prefix cache) + a random tail, or some text."""
    prefix = random.Random(rng.randrange(4)).choices(range(3, shape.vocab_size), k=32)
    request = pb.GenerateRequest(
        sampling=pb.SamplingOptions(
            temperature=rng.choice([0.0, 1.0]), n=rng.choice([1] * 9 + [2])
        ),
        stopping=pb.StoppingOptions(max_new_tokens=max_new_tokens, ignore_eos=True),
        response=pb.ResponseOptions(**response),
    )
    if rng.random() < text_share:
        request.text = words(rng, rng.randint(4, 40))
    else:
        tail = rng.choices(range(3, shape.vocab_size), k=rng.randint(4, 48))
        request.token_ids.ids.extend(prefix + tail)
    return request


def plan_round(rng: random.Random, ns: argparse.Namespace, shape: Shape) -> list[Plan]:
    """`--streams` plans, a third of them ended early, split evenly over the four ways."""
    num_early = ns.streams // 3
    endings = ["complete"] * (ns.streams - num_early)
    endings += [ENDINGS[1 + i % 4] for i in range(num_early)]
    plans = []
    for ending in endings:
        max_new_tokens = rng.randint(16, ns.max_tokens)
        text_share = 0.2
        if ending == "sigkill":  # long, so that the kill lands mid-stream
            max_new_tokens, text_share = ns.stall_tokens, 0.0
        plan = Plan(ending, make_request(rng, shape, max_new_tokens, text_share))
        plan.num_reads = rng.randint(2, max(2, max_new_tokens // 3))
        if ending == "deadline":
            plan.deadline_s = rng.uniform(0.02, ns.max_deadline)
        plans.append(plan)
    rng.shuffle(plans)
    return plans


# -- the streams of a round -------------------------------------------------------------------


async def run_stream(plan: Plan, stub: Any, target: str) -> str:
    """Drive one stream to its planned end; returns the status the client saw."""
    channel = grpc.aio.insecure_channel(target) if plan.ending == "close" else None
    if channel is not None:
        stub = generation_pb2_grpc.GenerationStub(channel)
    call = stub.GenerateStream(plan.request, timeout=plan.deadline_s)
    num_read = 0
    try:
        while True:
            msg = await call.read()
            if msg is grpc.aio.EOF:
                return "OK"
            num_read += 1
            if num_read >= plan.num_reads and plan.ending == "cancel":
                call.cancel()
                return "CANCELLED"
            if num_read >= plan.num_reads and channel is not None:
                await channel.close()
                return f"closed: {(await call.code()).name}"
    except grpc.aio.AioRpcError as exc:
        return str(exc.code().name)
    except asyncio.CancelledError:
        return "CANCELLED"
    finally:
        if channel is not None:
            await channel.close()


async def run_child(plans: list[Plan], target: str, rng: random.Random) -> list[str]:
    """Open `plans` in a child process and SIGKILL it once every stream is mid-stream."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, target, STREAM_METHOD,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    payload = b"\n".join(base64.b64encode(p.request.SerializeToString()) for p in plans)
    proc.stdin.write(payload)
    await proc.stdin.drain()
    proc.stdin.close()
    status: dict[int, str] = {}
    deadline = time.monotonic() + 60
    while len(status) < len(plans) and time.monotonic() < deadline:
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), deadline - time.monotonic())
        except asyncio.TimeoutError:
            break
        if not line:
            break
        what, index, *code = line.decode().split()
        if what == "ended" or int(index) not in status:
            status[int(index)] = code[0] if code else "killed mid-stream"
    await asyncio.sleep(rng.uniform(0, 0.05))
    proc.send_signal(signal.SIGKILL)
    await proc.wait()
    return [status.get(i, "killed before streaming") for i in range(len(plans))]


async def run_streams(
    plans: list[Plan], ns: argparse.Namespace, target: str
) -> list[tuple[str, str]]:
    """In-process plans on `--concurrency` workers; sigkill plans in children, meanwhile."""
    rng = random.Random(ns.seed)
    local = [p for p in plans if p.ending != "sigkill"]
    killed = [p for p in plans if p.ending == "sigkill"]
    statuses: list[tuple[Plan, str]] = []
    channels = [grpc.aio.insecure_channel(target) for _ in range(4)]
    stubs = [generation_pb2_grpc.GenerationStub(c) for c in channels]
    queue = list(reversed(local))

    async def worker(i: int) -> None:
        while queue:
            plan = queue.pop()
            statuses.append((plan, await run_stream(plan, stubs[i % len(stubs)], target)))

    async def children() -> None:
        per_child = max(1, ns.kill_streams_per_child)
        for start in range(0, len(killed), per_child):
            group = killed[start : start + per_child]
            await asyncio.sleep(rng.uniform(0, 1))
            statuses.extend(zip(group, await run_child(group, target, rng)))

    await asyncio.gather(children(), *(worker(i) for i in range(ns.concurrency)))
    for channel in channels:
        await channel.close()
    return [(plan.ending, status) for plan, status in statuses]


async def open_stalled(
    num: int, ns: argparse.Namespace, shape: Shape, target: str
) -> list[Stalled]:
    """`num` readers, each on its own connection, that read two messages and then stop."""
    rng = random.Random(ns.seed + 1)

    async def one() -> Stalled:
        # no BDP probing: the window stays near HTTP/2's 64 KiB, as with a fixed-window client
        # (with probing, grpc's client buffers ~4 MB of a stream before its window fills)
        channel = grpc.aio.insecure_channel(target, options=[("grpc.http2.bdp_probe", 0)])
        request = make_request(
            rng, shape, ns.stall_tokens, text_share=0.0, logprobs=20, return_token_ids=True
        )
        request.sampling.n = 1
        call = generation_pb2_grpc.GenerationStub(channel).GenerateStream(request)
        reader = Stalled(call, channel, time.monotonic())
        try:
            for _ in range(2):
                await call.read()
        except grpc.aio.AioRpcError as exc:
            reader.ended_at, reader.status = time.monotonic(), f"refused: {exc.code().name}"
            return reader
        reader.stalled_at = time.monotonic()

        def ended(done_call: Any) -> None:
            reader.ended_at = time.monotonic()

        call.add_done_callback(ended)
        return reader

    return list(await asyncio.gather(*(one() for _ in range(num))))


async def settle_stalled(readers: list[Stalled], wait_until: float) -> list[dict[str, Any]]:
    """Wait for the server to end the stalled readers (until `wait_until`); what each got."""
    while time.monotonic() < wait_until and not all(r.call.done() for r in readers):
        await asyncio.sleep(0.2)
    out: list[dict[str, Any]] = []
    for reader in readers:
        if reader.status != "still open":
            out.append({"status": reader.status})
        elif reader.call.done() and reader.ended_at is not None:
            code = await reader.call.code()
            out.append(
                {"status": code.name, "after_s": round(reader.ended_at - reader.stalled_at, 1)}
            )
        else:
            out.append({"status": "still open"})
    return out


async def resume_stalled(readers: list[Stalled], timeout_s: float) -> list[tuple[str, int]]:
    """Read each stalled stream again: the status queued behind its buffered messages, if any
    (or OK if the server never ended it), and how many messages came first."""

    async def one(reader: Stalled) -> tuple[str, int]:
        num_read, deadline = 0, time.monotonic() + timeout_s
        try:
            while True:
                msg = await asyncio.wait_for(reader.call.read(), deadline - time.monotonic())
                if msg is grpc.aio.EOF:
                    return "OK", num_read
                num_read += 1
        except grpc.aio.AioRpcError as exc:
            return str(exc.code().name), num_read
        except asyncio.TimeoutError:
            return "silent", num_read
        finally:
            reader.call.cancel()
            await reader.channel.close()

    return list(await asyncio.gather(*(one(r) for r in readers)))


class LoadWatch:
    """The highest load figures seen while a round runs (admitted shows whether it is filled)."""

    def __init__(self, control: Any) -> None:
        self.peak: Counter[str] = Counter()
        self._task = asyncio.create_task(self._poll(control))

    async def _poll(self, control: Any) -> None:
        while True:
            reply = await control.GetServerInfo(control_pb2.GetServerInfoRequest(), timeout=10)
            for key in ("admitted", "running", "waiting", "swapped"):
                self.peak[key] = max(self.peak[key], getattr(reply.load, key))
            await asyncio.sleep(0.25)

    async def stop(self) -> dict[str, int]:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        return {f"peak_{k}": v for k, v in self.peak.items()}


# -- what the server holds --------------------------------------------------------------------


async def wait_idle(control: Any, timeout_s: float) -> tuple[Any, bool]:
    """The load once nothing is running, waiting or swapped (three polls in a row)."""
    deadline, num_quiet = time.monotonic() + timeout_s, 0
    while True:
        load = (await control.GetServerInfo(control_pb2.GetServerInfoRequest(), timeout=10)).load
        num_quiet = num_quiet + 1 if load.running + load.waiting + load.swapped == 0 else 0
        if num_quiet >= 3:
            return load, True
        if time.monotonic() > deadline:
            return load, False
        await asyncio.sleep(0.1)


async def probe_slots(target: str, shape: Shape, num_tokens: int) -> int:
    """Open as many long streams as the server admits; how many it accepted (then cancel all)."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[5, 6, 7, 8]),
            stopping=pb.StoppingOptions(max_new_tokens=num_tokens, ignore_eos=True),
        )
        calls = [stub.GenerateStream(request, timeout=30) for _ in range(shape.num_slots)]

        async def first(call: Any) -> bool:
            try:
                return (await call.read()) is not grpc.aio.EOF
            except grpc.aio.AioRpcError:
                return False

        accepted = await asyncio.gather(*(first(c) for c in calls))
        for call in calls:
            call.cancel()
    return sum(accepted)


async def measure(
    control: Any, target: str, shape: Shape, pid: int, ns: argparse.Namespace
) -> dict[str, Any]:
    """Leaked blocks, stuck slots and RSS, once the engine is idle."""
    load, is_idle = await wait_idle(control, ns.idle_timeout)
    num_accepted = await probe_slots(target, shape, ns.stall_tokens)
    return {
        "idle": is_idle,
        "leaked_gpu_blocks": load.gpu_blocks_total - load.gpu_blocks_free,
        "leaked_cpu_blocks": load.cpu_blocks_total - load.cpu_blocks_free,
        "admitted": load.admitted,
        "stuck_slots": shape.num_slots - num_accepted,
        "slots": shape.num_slots,
        **rss_mib(pid),
    }


# -- rounds -----------------------------------------------------------------------------------


async def run_round(index: int, ns: argparse.Namespace, env: dict[str, Any]) -> dict[str, Any]:
    """One round: stalled readers, the planned streams, then what the server still holds."""
    shape, target = env["shape"], env["target"]
    rng = random.Random(ns.seed * 1000 + index)
    started = time.monotonic()
    watch = LoadWatch(env["control"])
    readers = await open_stalled(ns.stalled, ns, shape, target)
    statuses = await run_streams(plan_round(rng, ns, shape), ns, target)
    wall_s = time.monotonic() - started
    peaks = await watch.stop()
    stall_wait = ns.stall_wait if ns.stall_wait is not None else ns.stall_timeout + 10
    wait_until = min((r.stalled_at for r in readers), default=0) + stall_wait
    stalled = await settle_stalled(readers, wait_until)
    figures = await measure(env["control"], target, shape, env["pid"], ns)
    for entry, (status, num_read) in zip(stalled, await resume_stalled(readers, ns.resume_s)):
        entry.update(on_reading_again=status, messages_then=num_read)
    by_ending: dict[str, Counter[str]] = {e: Counter() for e in ENDINGS}
    for ending, status in statuses:
        by_ending[ending][status] += 1
    # seen: the client had a status while it stalled; ended: the server had ended the stream
    # (a status seen, or one queued behind the buffered messages), rather than finishing it OK
    num_seen = sum(s["status"] != "still open" for s in stalled)
    num_ended = sum(s["status"] not in ("still open", "OK") or
                    s["on_reading_again"] not in ("OK", "silent") for s in stalled)  # fmt: skip
    row = {"round": index + 1, "streams": len(statuses), "wall_s": round(wall_s, 1), **figures,
           **peaks, "stalled_seen": num_seen, "stalled_ended": num_ended, "stalled": stalled,
           "statuses": {e: dict(c) for e, c in by_ending.items() if c},
           **await watched_phases(ns, env)}  # fmt: skip
    print(json.dumps(row), file=sys.stderr)
    return row


async def watched_phases(ns: argparse.Namespace, env: dict[str, Any]) -> dict[str, Any]:
    """The big bodies, then the burst, each followed by what the server still holds."""
    out: dict[str, Any] = {}
    control, target, shape, pid = env["control"], env["target"], env["shape"], env["pid"]
    if ns.big_bodies:
        names = ns.big_bodies.split(",")
        out["big_bodies"] = await big_body_phase(target, env["http"], names, ns.canary_tokens)
        out["after_big_bodies"] = await measure(control, target, shape, pid, ns)
    if ns.burst_streams:
        out["burst"] = await burst_phase(target, ns)
        out["after_burst"] = await measure(control, target, shape, pid, ns)
    return out


async def soak(ns: argparse.Namespace, model: str, log_path: Path) -> dict[str, Any]:
    help_text = subprocess.run([*serve_command(), "--help"], capture_output=True, text=True).stdout
    flags = serve_flags(ns, help_text)
    proc, port, http_port = start_server(model, flags, log_path)
    target = f"127.0.0.1:{port}"
    report: dict[str, Any] = {
        "serve_flags": flags,
        "has_stall_timeout": "--stall-timeout" in help_text,
    }
    try:
        await wait_serving(proc, target, log_path)
        async with grpc.aio.insecure_channel(target) as channel:
            control = control_pb2_grpc.ControlStub(channel)
            info = await control.GetModelInfo(control_pb2.GetModelInfoRequest(), timeout=10)
            shape = Shape(info.vocab_size, info.max_num_seqs + info.max_queued_requests)
            env = {"shape": shape, "target": target, "control": control, "pid": proc.pid,
                   "http": f"127.0.0.1:{http_port}"}  # fmt: skip
            report["rounds"] = [await run_round(i, ns, env) for i in range(ns.rounds)]
            if not ns.no_hostile:
                report["hostile"] = await hostile_phase(target, ns)
                report["after_hostile"] = await measure(control, target, shape, proc.pid, ns)
    except grpc.aio.AioRpcError as exc:  # the server died or hung: say so, with its log
        report["error"] = f"{exc.code().name}: {exc.details()}"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        report["server_exit_code"] = proc.returncode
        report["server_log"] = log_summary(log_path)
        if "error" in report:
            report["server_log_tail"] = log_path.read_text(errors="replace")[-3000:]
    return report


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--model", help="HF model directory, or 'default' for the bundled default model "
        "(default: a tiny random Llama)")  # fmt: skip
    add("--fake-runner", action="store_true", help="serve scripted tokens (no model, no logprobs)")
    add("--rounds", type=int, default=10)
    add("--no-engine-process", action="store_true", help="serve with the step loop in the server")
    add("--streams", type=int, default=150, help="streams per round")
    add("--stalled", type=int, default=10, help="stalled readers per round")
    add("--concurrency", type=int, default=16, help="in-process streams at once")
    add("--kill-streams-per-child", type=int, default=5, help="streams of each SIGKILLed child")
    add("--max-tokens", type=int, default=160, help="longest ordinary stream")
    add("--max-deadline", type=float, default=0.5, help="longest short deadline, seconds")
    add("--stall-tokens", type=int, help="tokens of a stalled stream (default: 1000, or what "
        "the model's context leaves; 8000 with --fake-runner, whose messages carry no "
        "logprobs)")  # fmt: skip
    add("--stall-timeout", type=float, default=5.0, help="passed to serve if it has the flag")
    add("--stall-wait", type=float, help="seconds, from the stall, to wait for the server to end "
        "stalled readers (default: stall timeout + 10)")  # fmt: skip
    add("--resume-s", type=float, default=5.0, help="seconds each stalled reader then reads "
        "again, to see what the server left queued behind its window")  # fmt: skip
    add("--canary-tokens", type=int, help="tokens of each canary stream (default: 1000, or what "
        "the model's context leaves)")  # fmt: skip
    add("--big-bodies", default=BIG_BODIES, help="bodies of benchmarks/big_bodies.py sent each "
        "round ('' for none)")  # fmt: skip
    add("--burst-streams", type=int, default=2000, help="streams opened at once each round")
    add("--burst-channels", type=int, default=8, help="connections the burst is spread over")
    add("--burst-tokens", type=int, default=64, help="tokens of each burst stream")
    add("--burst-timeout", type=float, default=180.0, help="longest wait for the burst to end")
    add("--canary-warmup", type=float, default=2.0, help="seconds of normal canary gaps")
    add("--no-hostile", action="store_true", help="skip the hostile requests after the last "
        "round (with --streams 0 --stalled 0 --big-bodies '': the burst phase alone)")  # fmt: skip
    add("--num-stops", type=int, default=1_000_000, help="stop strings of the hostile request")
    add("--hostile-timeout", type=float, default=60.0, help="deadline of each hostile request")
    add("--idle-timeout", type=float, default=60.0, help="longest wait for the engine to idle")
    add("--max-num-seqs", type=int, default=8)
    add("--max-queued-requests", type=int, default=32)
    add("--gpu-blocks", type=int, help="KV blocks of 16 tokens (default: 512; 8192 with "
        "--fake-runner, for its longer stalled streams)")  # fmt: skip
    add("--cpu-blocks", type=int, default=256, help="swap blocks")
    add("--keep-log", help="copy the server's log (JSON lines) here")
    add("--rss-noise-mib", type=float, default=20.0, help="RSS spread over the last 5 rounds "
        "that still reads as flat")  # fmt: skip
    add("--seed", type=int, default=0)
    add("--json", action="store_true")
    add("--report", metavar="JSON", help="print the tables of a saved --json output, run nothing")
    ns = parser.parse_args()
    if ns.model == "default":
        ns.model = default_model.path()
    if ns.gpu_blocks is None:
        ns.gpu_blocks = 8192 if ns.fake_runner else 512
    return ns


def fit_tokens(ns: argparse.Namespace, model: str) -> None:
    """Stalled and canary streams of 1000 tokens, or what the model's context leaves of it
    after 128 (the bundled default model's is 512)."""
    config = json.loads((Path(model) / "config.json").read_text())
    room = int(config.get("max_position_embeddings", 1128)) - 128
    if ns.stall_tokens is None:
        ns.stall_tokens = 8000 if ns.fake_runner else min(1000, room)
    if ns.canary_tokens is None:
        ns.canary_tokens = min(1000, room)


def main() -> None:
    ns = parse_args()
    if ns.report:  # a saved run's tables, e.g. docs/benchmarks/soak_issue24.json
        saved = json.loads(Path(ns.report).read_text())
        print_report(saved, argparse.Namespace(**saved["config"]))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = ns.model
        if model is None:
            from asyncengine.testing import make_random_model

            model_dir = make_random_model(Path(tmp) / "model", max_position_embeddings=16384)
            model = str(model_dir)
        fit_tokens(ns, model)
        log_path = Path(tmp) / "server.log"
        report = asyncio.run(soak(ns, model, log_path))
        if ns.keep_log:
            shutil.copy(log_path, ns.keep_log)
    report["failures"] = failures(report)
    report["goals"] = goals(report, ns)
    if ns.json:
        config = {k: v for k, v in vars(ns).items() if k not in ("json", "report")}
        print(json.dumps({"config": config, **report}, indent=2))
    elif "error" in report:
        print(f"server failed: {report['error']} (exit code {report['server_exit_code']})")
        print(report["server_log_tail"])
    else:
        print_report(report, ns)
    sys.exit(2 if "error" in report else 1 if report["failures"] else 0)


if __name__ == "__main__":
    main()
