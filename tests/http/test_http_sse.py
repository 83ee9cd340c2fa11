"""The SSE stream survives clients that read it in arbitrary network chunks and strip each one,
as vLLM's benchmark client (`vllm bench serve`) does, keep-alives included (issue 27)."""

from __future__ import annotations

import codecs
import http.client
import json
import random
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from serving_http import ServerThread, http_server

# keep-alives every 50 ms, and steps of 150 ms: each stream waits for its first token, and
# between tokens, longer than a keep-alive interval
FLAGS = ("--heartbeat-interval", "0.05")
STEP_DELAY_S = 0.15


@pytest.fixture(scope="module")
def slow_server(chat_model: Path) -> Iterator[ServerThread]:
    with http_server(chat_model, *FLAGS, fake_runner=True, step_delay_s=STEP_DELAY_S) as served:
        yield served
        served.assert_nothing_left()


class StrippingClient:
    """What vLLM's `bench serve` does with a stream (vllm/benchmarks/lib/endpoint_request_func
    .py): each network chunk stripped and added to a buffer; messages split off at blank lines,
    or taken whole once the buffer is `data: ` and valid JSON; `:` messages skipped as comments."""

    def __init__(self) -> None:
        self.buffer = ""
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self.events: list[Any] = []
        self.is_done = False

    def feed(self, chunk: bytes) -> None:
        chunk = chunk.strip()
        if not chunk:
            return
        self.buffer += self._decoder.decode(chunk)
        messages = []
        while "\n\n" in self.buffer:
            message, self.buffer = self.buffer.split("\n\n", 1)
            if message.strip():
                messages.append(message.strip())
        if self.buffer.startswith("data: "):
            content = self.buffer.removeprefix("data: ").strip()
            try:
                if content == "[DONE]" or json.loads(content) is not None:
                    messages.append(self.buffer.strip())
                    self.buffer = ""
            except json.JSONDecodeError:
                pass  # the rest of it is still to come
        for message in messages:
            if message.startswith(":"):
                continue
            payload = message.removeprefix("data: ")
            if payload == "[DONE]":
                self.is_done = True
            else:
                self.events.append(json.loads(payload))


def network_chunks(body: bytes, writes: list[bytes], rng: random.Random) -> Iterator[bytes]:
    """`body` in small arbitrary pieces as a socket may deliver it: most of the server's writes
    in a read of their own (so a chunk ends where an event or keep-alive does), some coalesced
    with the next, and events cut at random inside. Cuts inside an event fall between two
    non-space bytes: a stripping client loses the whitespace at a cut, whatever the server."""
    assert b"".join(writes) == body
    start, offset = 0, 0
    for write in writes:
        end = offset + len(write)
        for cut in sorted(rng.sample(range(offset + 1, end), k=min(3, len(write) - 1))):
            if not (body[cut - 1 : cut].isspace() or body[cut : cut + 1].isspace()):
                yield body[start:cut]
                start = cut
        if rng.random() < 0.75:  # the write's end is a read's end
            yield body[start:end]
            start = end
        offset = end
    if start < len(body):
        yield body[start:]


def spec_events(body: bytes) -> tuple[list[Any], int]:
    """The stream's events as the SSE spec reads it (lines; a blank line dispatches the data
    gathered, if any), and how many blank lines dispatched nothing."""
    events, data, num_empty = [], [], 0
    for line in body.decode().split("\n"):
        if line == "":
            if data:
                events.append("\n".join(data))
            else:
                num_empty += 1
            data = []
        elif line.startswith("data:"):
            data.append(line.removeprefix("data:").removeprefix(" "))
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]], num_empty


def stream_writes(server: ServerThread, path: str, body: dict[str, Any]) -> list[bytes]:
    """The stream's bytes in the pieces they arrived in (over loopback, each server write)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        writes = []
        while piece := response.read1(1 << 16):
            writes.append(piece)
        return writes
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "Hello there", "stream_options": {"include_usage": True}}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ],
    ids=["completions", "chat"],
)
def test_a_stripping_chunked_reader_recovers_every_event_keep_alives_and_all(
    slow_server: ServerThread, path: str, body: dict[str, Any]
) -> None:
    request = {"model": slow_server.model, "max_tokens": 6, "stream": True, **body}
    writes = stream_writes(slow_server, path, request)
    whole = b"".join(writes)
    events, num_keepalives = spec_events(whole)
    # keep-alives are there (before the first token and between tokens)
    assert num_keepalives >= 4, whole
    assert len(events) >= 4
    for seed in range(20):
        client = StrippingClient()
        for chunk in network_chunks(whole, writes, random.Random(seed)):
            client.feed(chunk)
        assert client.events == events, (seed, whole)
        assert client.is_done and client.buffer == ""


def test_the_openai_client_streams_through_keep_alives(slow_server: ServerThread) -> None:
    client = slow_server.client()
    args = {"model": slow_server.model, "prompt": "Hello there", "max_tokens": 6}
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def prompt_whose_first_token_starts_a_character(model: Path, vocab_size: int) -> list[int]:
    """Token ids after which the fake runner's first token is one byte that starts a UTF-8
    character of 2-4 bytes: a token with no text of its own yet."""
    from transformers import AutoTokenizer

    from asyncengine.worker.fake_runner import count_up

    tokenizer = AutoTokenizer.from_pretrained(model)
    # byte-level BPE (GPT-2's) spells the bytes that are not printable ASCII or Latin-1 as
    # the characters from U+0100 on, in byte order
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [byte for byte in range(256) if byte not in printable]
    byte_of = {chr(b): b for b in printable} | {chr(0x100 + i): b for i, b in enumerate(others)}
    script = count_up(vocab_size)
    for last in range(3, vocab_size):
        prompt = [5, 6, 7, last]
        first = script(SimpleNamespace(token_ids=prompt, num_tokens=len(prompt)))
        piece = tokenizer.convert_ids_to_tokens(first)
        if len(piece) == 1 and 0xC2 <= byte_of.get(piece, 0) <= 0xF4:
            return prompt
    raise AssertionError("no prompt starts its output with a lead byte")


def test_a_token_without_text_yet_is_a_chunk_of_its_own(
    slow_server: ServerThread, chat_model: Path
) -> None:
    """vLLM streams a chunk for every step's tokens, its text empty while a character is still
    incomplete, and `vllm bench serve` takes the first chunk as the first token: one held back
    until its text is whole read as a late first token and fewer, longer ITLs."""
    vocab_size = json.loads((chat_model / "config.json").read_text())["vocab_size"]
    prompt = prompt_whose_first_token_starts_a_character(chat_model, vocab_size)
    request = {"model": slow_server.model, "prompt": prompt, "max_tokens": 6, "stream": True,
               "ignore_eos": True}  # fmt: skip
    events, _ = spec_events(b"".join(stream_writes(slow_server, "/v1/completions", request)))
    texts = [event["choices"][0]["text"] for event in events if event["choices"]]
    assert texts[0] == ""  # the lead byte alone
    assert len(texts) == 6  # a chunk a token: every 150 ms step makes one


def test_a_chat_stream_starts_with_its_first_token(slow_server: ServerThread) -> None:
    """The role chunk comes with the first tokens, as vLLM sends it, not before the prompt is
    read: a client timing the first token by the first chunk would read the request's arrival."""
    request = {"model": slow_server.model, "max_tokens": 2, "stream": True,
               "messages": [{"role": "user", "content": "Hi"}]}  # fmt: skip
    body = b"".join(stream_writes(slow_server, "/v1/chat/completions", request))
    before = body[: body.index(b"data:")]
    # the first step takes 150 ms: keep-alives (blank lines) every 50 ms until its tokens
    assert before == b"\n\n" * (len(before) // 2) and len(before) >= 4, body
    events, _ = spec_events(body)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_the_openai_client_streams_a_chat_that_starts_with_keep_alives(
    slow_server: ServerThread,
) -> None:
    client = slow_server.client()
    args = {"model": slow_server.model, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 6}  # fmt: skip
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks)
        == whole.choices[0].message.content
    )
    assert chunks[-1].choices[0].finish_reason == "length"
