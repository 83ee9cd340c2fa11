"""Run `asyncengine serve` as a subprocess and talk to it through the generated stubs only."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import interrupts
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from asyncengine.v1 import control_pb2_grpc, generation_pb2_grpc
from asyncengine.v1 import generation_pb2 as pb

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# For a channel that polls a server still starting: gRPC backs off between failed connects
# (1 s, 1.6 s, 2.6 s, ... 120 s), so a poller's default channel saw a server that came up after
# 30 s of imports ~15 s late. 100 ms between connects finds it at once.
FAST_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 100),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve_command(flags: Sequence[str] = ()) -> list[str]:
    # the test hooks' entry point
    if {"--fake-runner", "--fault-after-steps", "--step-delay"} & set(flags):
        return [sys.executable, "-m", "asyncengine.testing", "serve"]
    script = shutil.which("asyncengine", path=str(Path(sys.executable).parent))
    if script:
        return [script, "serve"]
    return [sys.executable, "-m", "asyncengine.server.cli", "serve"]


# the servers started and not yet reaped: a Ctrl-C kills them all at once (`kill_all`)
_LIVE: set[ServerProcess] = set()


class ServerProcess:
    """One `asyncengine serve` on 127.0.0.1 with a tiny model; its stderr goes to a log file.

    It runs in a session (and process group) of its own, with its engine process and workers:
    a terminal's Ctrl-C reaches pytest alone, which then kills every group (`kill_all`), and a
    test can send a Ctrl-C to the server's group as a terminal would (`os.killpg`).
    """

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        *flags: str,
        env: dict[str, str] | None = None,
        root_cert: bytes | None = None,
        client_cert: tuple[bytes, bytes] | None = None,  # (key, cert)
    ) -> None:
        self.log_path = log_path
        self.root_cert = root_cert
        self.client_cert = client_cert
        command = [
            *_serve_command(flags),
            # port 0: the server binds a free port and logs it (a port picked here and bound
            # there could be taken in between, by another test's server or gloo's sockets)
            "--model", str(model_dir), "--host", "127.0.0.1", "--port", "0",
            "--device", "cpu", "--dtype", "float32", "--torch-threads", "1", *flags,
        ]  # fmt: skip
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in kill())
        self._is_terminated = False
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
            start_new_session=True,
        )
        _LIVE.add(self)

    @functools.cached_property
    def port(self) -> int:
        """The gRPC port, from the log line 'serving' (waited for)."""
        return self.logged_port("serving")

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def logged_port(self, event: str, timeout: float = 300.0) -> int:
        """The port of the first log line `event` ('serving', 'http_serving', 'metrics_serving'),
        waited for while the server starts."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log().splitlines():
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if isinstance(record, dict) and record.get("event") == event:
                        return int(record["port"])
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.05)
        raise TimeoutError(f"no log line {event!r} after {timeout} s:\n{self.log()}")

    def channel(self, *, secure: bool | None = None, **kwargs: Any) -> grpc.Channel:
        """A sync channel; TLS with this server's root (and client cert) unless secure=False;
        `options` are more channel arguments."""
        return _channel(grpc, self, secure, **kwargs)

    def aio_channel(self, *, secure: bool | None = None, **kwargs: Any) -> grpc.aio.Channel:
        return _channel(grpc.aio, self, secure, **kwargs)

    def wait_serving(self, timeout: float = 120.0) -> None:
        """Poll the standard health service until it says SERVING (never sleep-and-hope)."""
        deadline = time.monotonic() + timeout
        self.logged_port("serving", timeout)
        with self.channel(options=FAST_RECONNECT) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                    if reply.status == SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise TimeoutError(f"server not SERVING after {timeout} s:\n{self.log()}")

    def terminate(self) -> None:
        """SIGTERM (a graceful drain), once, without waiting: `stop` then waits. (A second
        SIGTERM would cut the drain short, or kill a server already past its handlers.)"""
        if self.proc.poll() is None and not self._is_terminated:
            self.proc.send_signal(signal.SIGTERM)
            self._is_terminated = True

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (graceful drain) and wait; returns the exit code. Past `timeout`, or once
        the server has exited, whatever is left of its process group is killed."""
        self.terminate()
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the server's process group (its engine process and workers too) and reap it.
        The engine process ignores SIGINT and SIGTERM, so nothing short of this ends it early."""
        _LIVE.discard(self)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._log.close()

    def log(self) -> str:
        return self.log_path.read_text()

    def log_records(self) -> list[dict[str, Any]]:
        """Every JSON log line (a non-JSON line fails the caller: logs must be JSON lines)."""
        return [json.loads(line) for line in self.log().splitlines() if line.strip()]


def kill_all() -> None:
    """SIGKILL every server not yet stopped, with its engine and workers, waiting for none
    (the first Ctrl-C does this; the teardown's `stop` or `kill` then reaps them)."""
    for server in list(_LIVE):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.proc.pid, signal.SIGKILL)


interrupts.on_first_interrupt(kill_all)


def _channel(module: Any, server: ServerProcess, secure: bool | None, **kwargs: Any) -> Any:
    options = [("grpc.max_receive_message_length", 64 << 20), *kwargs.get("options", ())]
    if secure is False or (secure is None and server.root_cert is None):
        return module.insecure_channel(server.target, options=options)
    root = kwargs.get("root_cert", server.root_cert)
    key, cert = kwargs.get("client_cert", server.client_cert) or (None, None)
    credentials = grpc.ssl_channel_credentials(root, key, cert)
    return module.secure_channel(server.target, credentials, options=options)


def stubs(channel: Any) -> tuple[generation_pb2_grpc.GenerationStub, control_pb2_grpc.ControlStub]:
    return generation_pb2_grpc.GenerationStub(channel), control_pb2_grpc.ControlStub(channel)


def rich_status(error: grpc.RpcError) -> status_pb2.Status:
    """The google.rpc.Status a server sent in `grpc-status-details-bin`."""
    for key, value in error.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key == "grpc-status-details-bin":
            return status_pb2.Status.FromString(value)
    raise AssertionError(f"no rich status details in {error!r}")


def detail(error: grpc.RpcError, kind: type) -> Any:
    """The first detail of type `kind` (BadRequest, RetryInfo, ErrorInfo) in the error."""
    for packed in rich_status(error).details:
        message = kind()
        if packed.Unpack(message):
            return message
    raise AssertionError(f"no {kind.__name__} in {rich_status(error)}")


def bad_field(error: grpc.RpcError) -> str:
    violations = detail(error, error_details_pb2.BadRequest).field_violations
    assert len(violations) == 1, violations
    return violations[0].field


def greedy_request(prompt: str | Sequence[int], max_new_tokens: int | None, **kwargs: Any) -> Any:
    """A GenerateRequest for greedy decoding; `kwargs` go to the request itself."""
    stopping = kwargs.pop("stopping", None) or pb.StoppingOptions(ignore_eos=True)
    if max_new_tokens is not None:
        stopping.max_new_tokens = max_new_tokens
    prompt_field: dict[str, Any] = (
        {"text": prompt} if isinstance(prompt, str) else {"token_ids": pb.TokenIds(ids=prompt)}
    )
    return pb.GenerateRequest(
        **prompt_field,
        sampling=kwargs.pop("sampling", None) or pb.SamplingOptions(temperature=0.0),
        stopping=stopping,
        **kwargs,
    )


def events(responses: Sequence[pb.GenerateResponse]) -> list[str]:
    return [r.WhichOneof("event") for r in responses]


def check_stream_shape(responses: Sequence[pb.GenerateResponse]) -> str:
    """Accepted first, Usage last, one Finished before it, consecutive sequence numbers.

    Returns the joined delta text.
    """
    kinds = events(responses)
    assert kinds[0] == "accepted" and kinds[-2:] == ["finished", "usage"], kinds
    assert set(kinds[1:-2]) <= {"delta", "heartbeat"}, kinds
    seqs = [getattr(r, kind).sequence_number for r, kind in zip(responses[1:], kinds[1:])]
    assert seqs == list(range(1, len(responses))), seqs
    deltas = [r.delta for r in responses if r.HasField("delta")]
    offset = 0
    for delta in deltas:
        assert delta.token_offset == offset
        offset = delta.completion_tokens
    assert responses[-1].usage.completion_tokens == offset
    return "".join(d.text for d in deltas)


async def read_until(call: Any, kind: str) -> list[pb.GenerateResponse]:
    """Read an aio stream up to and including its first `kind` event."""
    responses = [await call.read()]
    while responses[-1].WhichOneof("event") != kind:
        responses.append(await call.read())
    return responses


async def read_rest(call: Any) -> list[pb.GenerateResponse]:
    """The remaining responses of an aio stream read with `read()` (styles must not mix)."""
    responses = []
    while (response := await call.read()) != grpc.aio.EOF:
        responses.append(response)
    return responses
