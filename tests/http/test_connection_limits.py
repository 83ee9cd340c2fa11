"""Connection limits of both ports (issue 24). HTTP: slowloris and silent sockets are closed
after --http-header-timeout, a stalled body after --http-body-timeout, connections past
--http-max-connections at once; a response, however long, is never cut by them. gRPC: a socket
that never handshakes is closed after --handshake-timeout, a connection that carries no call
after --max-connection-idle."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

import pytest
from serving_http import ServerThread, http_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HEADER_TIMEOUT_S, BODY_TIMEOUT_S, MAX_CONNECTIONS = 1.5, 1.0, 4
HANDSHAKE_TIMEOUT_S, MAX_CONNECTION_IDLE_S = 1.0, 3.0
# a client's HTTP/2 connection preface and an empty SETTINGS frame: the handshake, done
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


@pytest.fixture(scope="module")
def limited(model_dir) -> Iterator[ServerThread]:
    flags = (
        "--no-engine-process", "--http-header-timeout", str(HEADER_TIMEOUT_S),
        "--http-body-timeout", str(BODY_TIMEOUT_S),
        "--http-max-connections", str(MAX_CONNECTIONS),
        "--handshake-timeout", str(HANDSHAKE_TIMEOUT_S),
        "--max-connection-idle", str(MAX_CONNECTION_IDLE_S),
    )  # fmt: skip
    with http_server(model_dir("llama"), *flags, fake_runner=True, step_delay_s=0.005) as served:
        yield served


@contextlib.contextmanager
def connection(served: ServerThread, port: int | None = None) -> Iterator[socket.socket]:
    sock = socket.create_connection(("127.0.0.1", port or served.http_port), timeout=10)
    try:
        yield sock
    finally:
        sock.close()


def seconds_until_closed(sock: socket.socket, drip: bytes = b"", every_s: float = 0.2) -> float:
    """Send `drip` a byte at a time every `every_s` (nothing if empty) until the server closes
    the connection; how long that took."""
    start = time.monotonic()
    sock.settimeout(every_s)
    for byte in [drip[i : i + 1] for i in range(len(drip))] or [b""] * 100:
        with contextlib.suppress(TimeoutError):
            if byte:
                sock.sendall(byte)
            while sock.recv(65536):  # a response (none expected) is read past
                pass
            return time.monotonic() - start  # b"": closed
        assert time.monotonic() - start < 10, "the server never closed the connection"
    raise AssertionError("the drip ran out before the server closed the connection")


SLOW_HEADERS = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 200


def test_a_slowloris_and_a_silent_socket_are_closed_after_the_header_timeout(
    limited: ServerThread,
) -> None:
    with connection(limited) as silent:
        assert HEADER_TIMEOUT_S - 0.2 < seconds_until_closed(silent) < HEADER_TIMEOUT_S + 3
    with connection(limited) as slow:
        # one byte every 0.2 s: each arrives long before any per-read timeout would fire
        assert seconds_until_closed(slow, SLOW_HEADERS) < HEADER_TIMEOUT_S + 3


def test_a_kept_alive_connection_s_next_request_has_the_header_timeout_too(
    limited: ServerThread,
) -> None:
    with connection(limited) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        assert seconds_until_closed(sock, SLOW_HEADERS) < HEADER_TIMEOUT_S + 3


def test_a_stalled_body_is_closed_after_the_body_timeout(limited: ServerThread) -> None:
    with connection(limited) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n" + b'{"prompt": "'
        )
        assert BODY_TIMEOUT_S - 0.2 < seconds_until_closed(sock) < BODY_TIMEOUT_S + 3


def test_connections_past_the_limit_are_closed_at_once(limited: ServerThread) -> None:
    with contextlib.ExitStack() as stack:
        held = [stack.enter_context(connection(limited)) for _ in range(MAX_CONNECTIONS)]
        time.sleep(0.2)  # all accepted
        with connection(limited) as extra:
            assert seconds_until_closed(extra) < HEADER_TIMEOUT_S - 0.5
        for sock in held:  # still open: each is closed by its own header timeout
            sock.settimeout(0.05)
            with pytest.raises(TimeoutError):
                sock.recv(1)
    time.sleep(0.2)  # closed on the server's side too before another test connects


def test_a_response_longer_than_every_timeout_is_never_cut(limited: ServerThread) -> None:
    start = time.monotonic()
    stream = limited.client().completions.create(
        model=limited.model, prompt="a", max_tokens=500, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    assert time.monotonic() - start > HEADER_TIMEOUT_S + BODY_TIMEOUT_S
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_grpc_socket_that_never_handshakes_is_closed_after_the_handshake_timeout(
    limited: ServerThread,
) -> None:
    with connection(limited, limited.grpc_port) as silent:
        closed_s = seconds_until_closed(silent)
    assert HANDSHAKE_TIMEOUT_S - 0.2 < closed_s < HANDSHAKE_TIMEOUT_S + 3


def test_a_grpc_connection_without_calls_is_closed_after_the_idle_limit(
    limited: ServerThread,
) -> None:
    with connection(limited, limited.grpc_port) as idle:
        idle.sendall(HTTP2_PREFACE)
        closed_s = seconds_until_closed(idle)  # past its GOAWAY, the connection goes
    # gRPC jitters the idle limit by up to 10%; well past the handshake timeout either way
    assert 0.85 * MAX_CONNECTION_IDLE_S < closed_s < MAX_CONNECTION_IDLE_S + 5
