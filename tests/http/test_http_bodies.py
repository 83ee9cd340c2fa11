"""Request bodies at the HTTP port (issue 24): a chunked body past --max-message-size is refused
as it arrives, the default limit is 8 MiB on both ports, and text that is not Unicode (a lone
surrogate) is a 400 naming its field."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from serving_http import ServerThread, http_server

from asyncengine.v1 import generation_pb2 as pb

MAX_MESSAGE_SIZE = 1 << 20
DEFAULT_MESSAGE_SIZE = 8 << 20  # a short context's: the longest prompt needs far less


@pytest.fixture(scope="module")
def small(model_dir: Any) -> Iterator[ServerThread]:
    """Scripted tokens, a 1 MiB body limit, the chat template of the tests."""
    from asyncengine import testing

    model = model_dir("llama", chat_template=testing.CHAT_TEMPLATE)
    flags = ("--no-engine-process", "--max-message-size", str(MAX_MESSAGE_SIZE))
    with http_server(model, *flags, fake_runner=True) as served:
        yield served


@pytest.fixture(scope="module")
def defaults(model_dir: Any) -> Iterator[ServerThread]:
    """Scripted tokens and the default message size."""
    with http_server(model_dir("llama"), "--no-engine-process", fake_runner=True) as served:
        yield served


def _post(server: ServerThread, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
        with contextlib.suppress(OSError):  # refused before the end (413): the answer waits
            sock.sendall(head.encode() + b"Content-Type: application/json\r\n\r\n" + body)
        return _read_response(sock)


def _read_response(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    reply = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except OSError:
            break
        if not chunk:
            break
        reply += chunk
        head, _, rest = reply.partition(b"\r\n\r\n")
        length = [h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")]
        if length and len(rest) >= int(length[0].split(b":")[1]):
            break
    head, _, rest = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(rest or b"{}")


def test_a_chunked_body_over_the_limit_is_413_before_the_rest_is_sent(
    small: ServerThread,
) -> None:
    """A chunked body has no Content-Length to refuse up front: today the server reads all of
    it, then answers 400 "There was an error parsing the body"."""
    total = 64 * MAX_MESSAGE_SIZE
    chunk = b"x" * 65536
    frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    sent = 0
    reply: list[tuple[int, dict[str, Any]]] = []
    with socket.create_connection(("127.0.0.1", small.http_port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        reader = threading.Thread(target=lambda: reply.append(_read_response(sock)))
        reader.start()
        try:
            while sent < total and reader.is_alive():
                sock.sendall(frame)
                sent += len(chunk)
        except OSError:
            pass  # the server closed its end: nothing more is read
        reader.join(30)
    assert reply, "no response"
    status, body = reply[0]
    assert status == 413 and body["error"]["code"] == "request_too_large", body
    # what the sockets' buffers hold on loopback is a few MiB: far from the whole body
    assert sent < total / 2, f"{sent} of {total} bytes were taken before the 413"


@pytest.mark.parametrize(
    "num_bytes", [1 + MAX_MESSAGE_SIZE, 16 * MAX_MESSAGE_SIZE, 64 * MAX_MESSAGE_SIZE]
)
def test_a_client_that_reads_after_sending_its_whole_body_gets_the_413(
    small: ServerThread, num_bytes: int
) -> None:
    """A 413 written while the client still sends its declared body: the connection closed
    with bytes unread was reset, and a reset drops the answer from the client's buffer (the
    suite saw the status line without its JSON)."""
    body = b'{"prompt": "' + b"x" * (num_bytes - 14) + b'"}'
    for _ in range(5):
        status, reply = _post(small, "/v1/completions", body)
        assert status == 413, reply
        assert reply["error"]["code"] == "request_too_large", reply


def test_the_next_request_is_served_after_a_413(small: ServerThread) -> None:
    status, _ = _post(small, "/v1/completions", b'{"prompt": "' + b"x" * 2_000_000 + b'"}')
    assert status == 413
    status, _ = _post(small, "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}')
    assert status == 200


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "\udc00"], "max_tokens": 2}, "prompt.1"),
        ("/v1/completions", {"prompt": "hi", "stop": "\ud83d"}, "stop"),
        ("/v1/completions", {"prompt": "hi", "stop": ["ok", "x\udfff"]}, "stop.1"),
        ("/v1/completions", {"prompt": "hi", "user": "\ud800"}, "user"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a\ud800"}]},
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc01"}]}]},
            "messages.0.content.0.text",
        ),
        ("/tokenize", {"prompt": "a\ud800"}, "prompt"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_its_field(
    small: ServerThread, path: str, body: dict[str, Any], param: str
) -> None:
    """Today the prompt's is a 500 (a TypeError in the tokenizer) and the stop string's is
    accepted: text that is not Unicode never reaches a tokenizer or a stop matcher now."""
    status, reply = _post(small, path, json.dumps(body).encode())  # ensure_ascii: \ud800
    assert status == 400, reply
    assert reply["error"]["param"] == param, reply
    assert "surrogate" in reply["error"]["message"]


def test_invalid_utf8_is_a_400_naming_its_field(small: ServerThread) -> None:
    status, reply = _post(small, "/v1/completions", b'{"prompt": "a\xffb", "max_tokens": 2}')
    assert status == 400 and reply["error"]["param"] == "prompt", reply
    # a paired surrogate is one character, and an escaped backslash no escape at all
    ok = json.dumps({"prompt": "\U0001f600 \\ud800", "max_tokens": 2}).encode()
    assert _post(small, "/v1/completions", ok)[0] == 200


_DEEP = 5000  # past Python's recursion limit, the JSON decoder's depth


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", b'{"prompt": "hi", "x": ' + b"[" * _DEEP + b"]" * _DEEP + b"}"),
        (
            "/v1/completions",
            b'{"prompt": "hi", "logit_bias": ' + b'{"a":' * _DEEP + b"1" + b"}" * (_DEEP + 1),
        ),
        ("/v1/chat/completions", b'{"messages": [' + b"[" * _DEEP + b"]" * _DEEP + b"]}"),
    ],
)
def test_json_nested_too_deeply_is_a_400(small: ServerThread, path: str, body: bytes) -> None:
    """Today a 500: the decoder's RecursionError, whether the field is read or ignored."""
    status, reply = _post(small, path, body)
    assert status == 400, reply
    assert "nested too deeply" in reply["error"]["message"], reply
    assert _post(small, "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}')[0] == 200


def test_many_prompts_or_messages_are_refused_before_they_are_built(small: ServerThread) -> None:
    """Counted before the list is split (prompts) or each one built (messages): a body of
    many tiny elements costs the server a count, not millions of objects."""
    many_prompts = json.dumps({"prompt": [""] * 200_000}).encode()
    status, reply = _post(small, "/v1/completions", many_prompts)
    assert status == 400 and reply["error"]["param"] == "prompt", reply
    many_messages = json.dumps({"messages": [{"role": "user", "content": "x"}] * 5000}).encode()
    status, reply = _post(small, "/v1/chat/completions", many_messages)
    assert status == 400 and reply["error"]["param"] == "messages", reply
    assert "4096 messages" in reply["error"]["message"]


def _text_body(num_bytes: int) -> bytes:
    """A completion body of exactly `num_bytes`: a text prompt too long for the context."""
    head, tail = b'{"prompt": "', b'"}'
    return head + b"x" * (num_bytes - len(head) - len(tail)) + tail


def test_the_default_limit_is_8_mib_on_both_ports(defaults: ServerThread) -> None:
    """Today's default is 64 MiB: a body just over 8 MiB is read and parsed (the largest such
    body held every stream ~100 ms); now it is refused by its size, naming the limit."""
    status, reply = _post(defaults, "/v1/completions", _text_body(DEFAULT_MESSAGE_SIZE + 1))
    assert status == 413, reply
    assert f"over {DEFAULT_MESSAGE_SIZE} bytes" in reply["error"]["message"]
    status, reply = _post(defaults, "/v1/completions", _text_body(DEFAULT_MESSAGE_SIZE))
    assert status == 400 and reply["error"]["param"] == "prompt", reply  # read, then bounded
    ids = [5] * (DEFAULT_MESSAGE_SIZE - 8)  # one byte each, packed: just over with its framing
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids)).SerializeToString()
    assert DEFAULT_MESSAGE_SIZE < len(request) < DEFAULT_MESSAGE_SIZE + 16
    target = f"127.0.0.1:{defaults.grpc_port}"
    with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as refused:
        list(channel.unary_stream("/asyncengine.v1.Generation/GenerateStream")(request))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(DEFAULT_MESSAGE_SIZE) in (refused.value.details() or "")
