"""The Python client against a real `asyncengine serve` on the tiny random llama (CPU)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from asyncengine_client import (
    Accepted,
    AsyncClient,
    AuthError,
    Client,
    Delta,
    Finished,
    FinishReason,
    InvalidRequestError,
    UnavailableError,
    Usage,
)

ModelDirFactory = Callable[..., Path]  # the `model_dir` fixture of tests/conftest.py
TOKEN = "e2e-token"
CONTROL_TOKEN = "e2e-control-token"  # with tenant tokens, Control takes only its own
GREEDY = {"temperature": 0.0, "ignore_eos": True}
# gRPC backs off between failed connects (1 s, 1.6 s, 2.6 s, ...): a poller's default channel
# saw a server that came up after 30 s of imports ~15 s late; 100 ms between connects does not
FAST_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 100),
]


def logged_port(log: Path, server: subprocess.Popen, timeout: float) -> int:
    """The port of the log line 'serving' (the server was started with --port 0)."""
    deadline = time.monotonic() + timeout
    while server.poll() is None and time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and record.get("event") == "serving":
                    return int(record["port"])
        time.sleep(0.05)
    pytest.fail(f"asyncengine serve logged no port:\n{log.read_text()}")


@pytest.fixture(scope="module")
def target(model_dir: ModelDirFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`host:port` of an `asyncengine serve --auth-token --control-auth-token` on the tiny llama."""
    log = tmp_path_factory.mktemp("python-client") / "serve.log"
    command = [
        sys.executable, "-m", "asyncengine.server.cli", "serve",
        "--model", str(model_dir("llama")), "--host", "127.0.0.1", "--port", "0",
        "--device", "cpu", "--torch-threads", "1", "--auth-token", TOKEN,
        "--control-auth-token", CONTROL_TOKEN,
        "--num-gpu-blocks-override", "256", "--num-cpu-blocks-override", "64",
    ]  # fmt: skip
    with log.open("wb") as log_file:
        server = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        # generous: at the suite's start it comes up beside the shared servers, on 2 cores
        target = f"127.0.0.1:{logged_port(log, server, timeout=300)}"
        with Client(target, options=FAST_RECONNECT) as client:  # health needs no token
            deadline = time.monotonic() + 300
            while server.poll() is None and time.monotonic() < deadline:
                with contextlib.suppress(UnavailableError):  # not listening yet
                    if client.health(timeout=1) == "SERVING":
                        break
                time.sleep(0.1)
            else:
                pytest.fail(f"asyncengine serve did not come up:\n{log.read_text()}")
        yield target
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def test_stream_deltas_join_to_the_unary_text(target: str) -> None:
    async def run() -> tuple[list, list]:
        async with AsyncClient(target, token=TOKEN) as client:
            options = {"max_new_tokens": 12, "return_token_ids": True, **GREEDY}
            events = [e async for e in client.generate_stream("Explain AI simply", **options)]
            return events, await client.generate(["Explain AI simply"], **options)

    events, (completion,) = asyncio.run(run())
    assert isinstance(events[0], Accepted) and events[0].request_id
    assert isinstance(events[-1], Usage) and events[-1].completion_tokens == 12
    (finished,) = [e for e in events if isinstance(e, Finished)]
    assert finished.reason is FinishReason.LENGTH is completion.finish_reason
    deltas = [e for e in events if isinstance(e, Delta)]
    assert "".join(d.text for d in deltas) == completion.text
    assert [i for d in deltas for i in d.token_ids] == completion.token_ids
    assert len(completion.token_ids) == 12


def test_unary_batch_in_prompt_order(target: str) -> None:
    prompts = ["a", "a b c d e f g h", "양자역학 설명해줄래?", "a b c"]
    with Client(target, token=TOKEN) as client:
        counts = [r.token_count for r in client.tokenize(prompts)]
        completions = client.generate(prompts, max_new_tokens=4, **GREEDY)
        alone = client.generate([prompts[2]], max_new_tokens=4, **GREEDY)
    assert len(set(counts)) == len(prompts)  # distinct lengths make the order visible
    assert [c.usage.prompt_tokens for c in completions] == counts
    assert completions[2].text == alone[0].text


def test_cache_salt_keeps_tenants_from_sharing_cached_prompts(target: str) -> None:
    prompt = list(range(100, 180))  # 80 tokens: five full blocks of 16
    with Client(target, token=TOKEN) as client:

        def cached_tokens(**options: object) -> int:
            (completion,) = client.generate([prompt], max_new_tokens=2, **GREEDY, **options)
            return completion.usage.cached_tokens

        assert cached_tokens(cache_salt="tenant-a") == 0
        assert cached_tokens(cache_salt="tenant-a") == 64  # 4 blocks: one token is always computed
        assert cached_tokens(cache_salt="tenant-b") == 0
        assert cached_tokens() == 0  # no salt is a tenant of its own
        with pytest.raises(InvalidRequestError) as caught:
            cached_tokens(cache_salt="x" * 257)
    assert caught.value.field == "cache_salt"


def test_korean_tokenize_detokenize_round_trip(target: str) -> None:
    text = "양자역학 설명해줄래? 한국어 텍스트"
    with Client(target, token=TOKEN) as client:
        (tokenized,) = client.tokenize([text], add_special_tokens=False, return_offsets=True)
        assert client.detokenize([tokenized.token_ids]) == [text]
    assert len(tokenized.offsets) == tokenized.token_count == len(tokenized.token_ids)


def test_abort_ends_the_stream_cancelled(target: str) -> None:
    with Client(target, token=TOKEN) as client, Client(target, token=CONTROL_TOKEN) as control:
        events = []
        stream = client.generate_stream("hi", request_id="to-abort", max_new_tokens=1000, **GREEDY)
        aborted = False
        for event in stream:
            events.append(event)
            # Deltas may carry several tokens: abort at the first one past 2
            if isinstance(event, Delta) and event.completion_tokens >= 2 and not aborted:
                assert control.abort(["to-abort", "unknown"]) == ["to-abort"]
                aborted = True
    assert isinstance(events[-2], Finished) and events[-2].reason is FinishReason.CANCELLED
    assert isinstance(events[-1], Usage) and events[-1].completion_tokens < 1000


def test_errors_are_typed(target: str) -> None:
    for token in (None, TOKEN):  # a tenant's token does not open Control
        with Client(target, token=token) as client, pytest.raises(AuthError):
            client.model_info()
    with Client(target, token=CONTROL_TOKEN) as control:
        assert control.model_info().max_context_length > 0
    with Client(target, token=TOKEN) as client, pytest.raises(InvalidRequestError) as caught:
        client.generate(["hi"], temperature=-1.0)
    assert caught.value.field == "sampling.temperature"


def test_cli_generate_stream(target: str) -> None:
    command = [
        sys.executable, "-m", "asyncengine_client.cli", "generate", "Explain AI simply",
        "--stream", "--max-new-tokens", "6", "--temperature", "0", "--ignore-eos",
        "--target", target, "--token", TOKEN,
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    with Client(target, token=TOKEN) as client:
        (completion,) = client.generate(["Explain AI simply"], max_new_tokens=6, **GREEDY)
    assert out.stdout == completion.text + "\n"
    assert "[length]" in out.stderr and "completion 6 tokens" in out.stderr


def test_drain_then_resume_puts_the_server_back_in_service(target: str) -> None:
    async def drain_and_resume() -> tuple[int, str, bool]:
        async with AsyncClient(target, token=CONTROL_TOKEN) as control:
            aborted = await control.drain(grace_period_ms=100)
            return aborted, await control.health(), await control.resume()

    with Client(target, token=CONTROL_TOKEN) as control, Client(target, token=TOKEN) as client:
        assert control.resume() is False  # not draining: a no-op
        assert asyncio.run(drain_and_resume()) == (0, "NOT_SERVING", True)
        assert control.health() == "SERVING" and not control.server_info().draining
        (completion,) = client.generate(["hi"], max_new_tokens=2, **GREEDY)  # admission is open
        assert control.drain(grace_period_ms=100) == 0 and control.health() == "NOT_SERVING"
        assert control.resume() is True and control.health() == "SERVING"
    assert completion.usage.completion_tokens == 2
