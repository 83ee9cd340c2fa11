"""Two `asyncengine serve` replicas behind the real Shepherd Model Gateway (`smg`, PyPI), which
speaks OpenAI HTTP to clients and SMG's vLLM worker protocol to the replicas.

The oracles are the official `openai` client through the gateway and a client speaking only
`vllm_engine.proto` (from smg-grpc-proto) to a replica. One gateway and two replicas are shared
by the module; the replica SIGKILL comes last.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from server.utils import ServerProcess
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto import vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2
from transformers import AutoTokenizer

from asyncengine.testing import CHAT_TEMPLATE, free_ports

PREFIX_WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "runs", "away"]


@dataclass
class Gateway:
    replicas: list[ServerProcess]
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    model: str
    tokenizer: Any
    metrics_port: int = 0

    def metric(self, name: str, **labels: str) -> list[float]:
        """The values of the gateway's Prometheus series `name` whose labels include `labels`
        (none while its metrics port is not yet listening)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                text = reply.read().decode()
        except urllib.error.URLError:
            return []
        wanted = [f'{key}="{value}"' for key, value in labels.items()]
        return [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name + "{") and all(label in line for label in wanted)
        ]

    def client(self, **kwargs: Any) -> openai.OpenAI:
        base = f"http://127.0.0.1:{self.port}/v1"
        return openai.OpenAI(base_url=base, api_key="-", max_retries=0, timeout=120, **kwargs)

    def get(self, path: str) -> Any:
        url = f"http://127.0.0.1:{self.port}{path}"
        with urllib.request.urlopen(url, timeout=10) as reply:
            return json.loads(reply.read())

    def events(self, event: str) -> list[dict[str, Any]]:
        """The replicas' log records `event`, each with the replica's index."""
        found = []
        for index, replica in enumerate(self.replicas):
            for record in replica.log_records():
                if record.get("event") == event:
                    found.append({**record, "replica": index})
        return found


def smg_binary() -> str:
    path = shutil.which("smg", path=str(Path(sys.executable).parent)) or shutil.which("smg")
    assert path, "the smg binary is a dev dependency (pip install -e '.[dev]' installs it)"
    return path


def wait_ready(gateway: Gateway, deadline_s: float = 120.0) -> None:
    """Both workers registered and healthy, and a completion answered."""
    deadline = time.monotonic() + deadline_s
    client = gateway.client()
    while time.monotonic() < deadline:
        assert gateway.proc.poll() is None, gateway.log_path.read_text()[-3000:]
        try:
            workers = gateway.get("/workers")["workers"]
            if len(workers) == 2 and all(w["is_healthy"] for w in workers):
                client.completions.create(model=gateway.model, prompt="hi", max_tokens=1)
                return
        except (OSError, openai.APIError, KeyError):
            pass
        time.sleep(0.2)
    raise TimeoutError("the gateway did not get ready:\n" + gateway.log_path.read_text()[-3000:])


def start_smg(
    replicas: list[ServerProcess], policy: str, log_path: Path
) -> tuple[subprocess.Popen[bytes], int, Path, int]:
    """`smg launch` in front of the replicas (its ports must be given: it refuses port 0)."""
    port, metrics_port = free_ports(2)
    command = [
        smg_binary(), "launch", "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--policy", policy, "--log-json",
        "--worker-urls", *(f"grpc://{r.target}" for r in replicas),
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    return proc, port, log_path, metrics_port


@pytest.fixture(scope="module")
def gateway(
    model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("smg")
    model = model_dir("llama")
    template = tmp / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    replicas = [
        ServerProcess(model, tmp / f"replica{i}.log", "--chat-template", str(template),
                      "--served-model-name", "tiny", "--enable-kv-events")
        for i in range(2)
    ]  # fmt: skip
    proc = None
    try:
        for replica in replicas:
            replica.wait_serving(300)
        proc, port, log_path, metrics_port = start_smg(replicas, "cache_aware", tmp / "smg.log")
        tokenizer = AutoTokenizer.from_pretrained(model)
        made = Gateway(replicas, proc, port, log_path, "tiny", tokenizer, metrics_port)
        wait_ready(made)
        yield made
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        for replica in replicas:
            replica.kill()


def direct_generate(
    replica: ServerProcess, request: vpb.GenerateRequest
) -> list[vpb.GenerateResponse]:
    with replica.channel() as channel:
        return list(vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(request, timeout=60))


def greedy(token_ids: list[int], max_tokens: int, **params: Any) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(
        request_id=f"direct-{time.monotonic_ns()}",
        tokenized=vpb.TokenizedInput(input_ids=token_ids),
        sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=max_tokens, **params),
    )


def same_text(got: str | None, expected: str) -> bool:
    """Equal but for a trailing incomplete UTF-8 sequence: the gateway holds those bytes back
    at the end where Hugging Face's decode writes U+FFFD."""
    return (got or "").rstrip("\ufffd") == expected.rstrip("\ufffd")


def test_completions_and_chat_match_the_engine_streamed_or_not(gateway: Gateway) -> None:
    client, tok = gateway.client(), gateway.tokenizer
    prompt = "Hello, my name is"
    # the gateway adds no BOS to a completion's prompt: the engine's text for those ids
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    (done,) = direct_generate(gateway.replicas[0], greedy(ids, 12, ignore_eos=True))
    expected = tok.decode(done.complete.output_ids)
    extra = {"ignore_eos": True}
    reply = client.completions.create(
        model=gateway.model, prompt=prompt, max_tokens=12, temperature=0, extra_body=extra
    )
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == (expected, "length")
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), 12)
    chunks = list(client.completions.create(
        model=gateway.model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=extra,
    ))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12

    # chat goes through --chat-template, which the gateway reads from the worker's tokenizer
    messages = [{"role": "user", "content": "hi there"}]
    rendered = tok.apply_chat_template(
        messages, chat_template=CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    chat_ids = tok(rendered, add_special_tokens=False)["input_ids"]
    (done,) = direct_generate(gateway.replicas[1], greedy(list(chat_ids), 10, ignore_eos=True))
    expected = tok.decode(done.complete.output_ids, skip_special_tokens=True)
    answer = client.chat.completions.create(
        model=gateway.model,
        messages=messages,
        max_tokens=10,
        temperature=0,
        extra_body=extra,  # type: ignore[arg-type]
    )
    assert answer.usage is not None and answer.usage.prompt_tokens == len(chat_ids)
    assert same_text(answer.choices[0].message.content, expected)
    streamed = client.chat.completions.create(
        model=gateway.model,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        extra_body=extra,  # type: ignore[arg-type]
    )
    assert same_text(
        "".join(c.choices[0].delta.content or "" for c in streamed if c.choices), expected
    )


def test_n_stop_strings_logprobs_and_a_json_schema(gateway: Gateway) -> None:
    client = gateway.client()
    two = client.completions.create(
        model=gateway.model, prompt="Once upon a time", max_tokens=6, temperature=1.0, n=2, seed=7,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert two.usage is not None and two.usage.completion_tokens == 12

    stopped = client.completions.create(
        model=gateway.model, prompt="Hello, my name is", max_tokens=30, temperature=0, stop=[" "],
    )  # fmt: skip
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop" and " " not in choice.text
    assert (choice.model_extra or {}).get("matched_stop") == " "

    chat = client.chat.completions.create(
        model=gateway.model, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content is not None and len(content) == 5
    for entry in content:  # greedy: the sampled token is the likeliest of the top two
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert abs(entry.logprob - max(t.logprob for t in entry.top_logprobs)) < 1e-4

    schema = {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}}, "required": ["a"],
              "additionalProperties": False}  # fmt: skip
    shaped = client.chat.completions.create(
        model=gateway.model, messages=[{"role": "user", "content": "json"}], max_tokens=40,
        temperature=0, response_format={"type": "json_schema",
                                        "json_schema": {"name": "a", "schema": schema}},
    )  # fmt: skip
    assert json.loads(shaped.choices[0].message.content or "")["a"] in (1, 2, 3)


def test_the_worker_protocol_direct_prompt_logprobs_defaults_refusals_tokenizer(
    gateway: Gateway,
) -> None:
    replica = gateway.replicas[0]
    ids = gateway.tokenizer("Hello, my name is", add_special_tokens=False)["input_ids"]
    # proto3's zeros are defaults: top_p, n and repetition_penalty 0 mean 1 (as unset)
    request = greedy(ids, 4, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    request.stream = True
    responses = direct_generate(replica, request)
    chunks = [r.chunk for r in responses if r.HasField("chunk")]
    (complete,) = [r.complete for r in responses if r.HasField("complete")]
    assert sum(len(c.token_ids) for c in chunks) == 4 and complete.finish_reason == "length"
    prompt_lps = chunks[0].input_logprobs
    assert list(prompt_lps.token_ids) == ids and not prompt_lps.token_logprobs[0].HasField("value")
    assert all(lp.HasField("value") for lp in prompt_lps.token_logprobs[1:])
    assert all(len(c.output_logprobs.token_ids) == len(c.token_ids) for c in chunks)
    # a constraint this engine lacks and a bad value: INVALID_ARGUMENT (a 400, never retried)
    with replica.channel() as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        for params, field in (
            (vpb.SamplingParams(structural_tag="{}"), "structural_tag"),
            (vpb.SamplingParams(logprobs=-1), "logprobs"),
            (vpb.SamplingParams(temperature=-1.0), "temperature"),
        ):
            bad = vpb.GenerateRequest(
                tokenized=vpb.TokenizedInput(input_ids=ids), sampling_params=params
            )
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Generate(bad, timeout=30))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
            assert field in (caught.value.details() or ""), caught.value
        loads = stub.GetLoads(vpb.GetLoadsRequest(), timeout=10)
        (load,) = loads.loads
        assert load.max_total_num_tokens > 0 and load.max_running_requests > 0
        info = stub.GetModelInfo(vpb.GetModelInfoRequest(), timeout=10)
        assert (info.served_model_name, info.max_context_length) == ("tiny", 2048)
        archive = b"".join(
            c.data for c in stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=30)
        )
    files = zipfile.ZipFile(io.BytesIO(archive))
    assert files.read("chat_template.jinja").decode() == CHAT_TEMPLATE
    assert "tokenizer.json" in files.namelist()
    assert (Path(info.tokenizer_path) / "chat_template.jinja").read_text() == CHAT_TEMPLATE


def test_an_invalid_request_is_one_400_not_a_retried_500(gateway: Gateway) -> None:
    before = len(gateway.events("request_refused"))
    with pytest.raises(openai.BadRequestError):
        gateway.client().completions.create(
            model=gateway.model, prompt="Hello", max_tokens=5, temperature=0,
            extra_body={"stop": ["x" * 300]},
        )  # fmt: skip
    refused = gateway.events("request_refused")[before:]
    assert [r["field"] for r in refused] == ["sampling_params.stop"], refused


def wait_for(condition: Callable[[], Any], what: str, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.1)
    raise TimeoutError(what)


def test_a_client_that_leaves_aborts_its_request(gateway: Gateway) -> None:
    stream = gateway.client().completions.create(
        model=gateway.model, prompt="A long story:", max_tokens=1500, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    ended = wait_for(
        lambda: [r for r in gateway.events("request_finished")
                 if r["protocol"] == "smg" and r["completion_tokens"] < 1500
                 and r["finish_reason"] in ("CLIENT_CANCELLED", "CANCELLED")],
        "the gateway's abandoned request kept running",
    )  # fmt: skip
    assert len(ended) == 1, ended


def test_cache_aware_routing_lands_a_shared_prefix_on_one_replica(gateway: Gateway) -> None:
    client = gateway.client()
    cached = []
    for group in range(4):
        prefix = " ".join(f"{w}{group}" for w in PREFIX_WORDS * 4)
        for question in range(3):
            reply = client.completions.create(
                model=gateway.model, prompt=f"{prefix} question {question}?", max_tokens=1,
                temperature=0,
            )  # fmt: skip
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            cached.append((group, question, reply.usage.prompt_tokens_details.cached_tokens or 0))
    # every later request of a group found its prefix in the cache of the replica it went to
    assert all(n >= 64 for _, question, n in cached if question > 0), cached


def test_the_gateway_consumes_each_replicas_kv_events(gateway: Gateway) -> None:
    """With --enable-kv-events, smg subscribes to both replicas and indexes the blocks they
    store (on a worker answering UNIMPLEMENTED it sets smg_kv_events_unavailable to 1)."""
    prefix = " ".join(f"{w}kv" for w in PREFIX_WORDS * 6)
    gateway.client().completions.create(model=gateway.model, prompt=prefix, max_tokens=1)
    wait_for(
        lambda: sum(gateway.metric("smg_kv_event_blocks_total", op="stored")) >= 4,
        "the gateway indexed no stored block:\n" + gateway.log_path.read_text()[-3000:],
    )
    assert gateway.metric("smg_kv_events_unavailable") in ([], [0.0, 0.0]), gateway.metric(
        "smg_kv_events_unavailable"
    )
    assert sum(gateway.metric("smg_kv_event_batches_total", disposition="applied")) >= 1
    connected = [line for line in gateway.log_path.read_text().splitlines()
                 if "KV event stream connected" in line]  # fmt: skip
    assert all(any(r.target in line for line in connected) for r in gateway.replicas), connected


def test_subscribe_kv_events_direct_snapshot_then_the_blocks_a_prompt_stores(
    gateway: Gateway,
) -> None:
    replica = gateway.replicas[1]
    ids = [7 + (i % 50) for i in range(16 * 3 + 5)]
    with replica.channel() as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        events = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=60)
        first = next(events)  # the snapshot: cleared, then whatever the replica holds
        assert first.snapshot.count >= 1 and first.events[0].WhichOneof("data") == "cleared"
        list(stub.Generate(greedy(ids, 1), timeout=60))
        stored: list[Any] = []
        while sum(len(message.blocks) for message in stored) < 3:
            batch = next(events)
            assert batch.sequence_number > first.sequence_number and not batch.HasField("snapshot")
            stored += [e.stored for e in batch.events if e.WhichOneof("data") == "stored"]
        events.cancel()
    blocks = [block for message in stored for block in message.blocks]
    assert [list(b.token_ids) for b in blocks[:3]] == [ids[:16], ids[16:32], ids[32:48]]
    assert all(b.block_size == 16 for b in blocks)
    assert not stored[0].HasField("parent_block_hash")  # the chain starts at the prompt's start


def test_a_gateway_started_later_resyncs_from_each_replicas_snapshot(
    gateway: Gateway, tmp_path: Path
) -> None:
    """What the replicas already hold reaches a new subscriber as one snapshot (cleared, then
    every cached block): the resync a subscriber that fell behind gets too."""
    for index, replica in enumerate(gateway.replicas):
        list(direct_generate(replica, greedy([300 + index + i % 40 for i in range(50)], 1)))
    proc, port, log_path, metrics_port = start_smg(
        gateway.replicas, "cache_aware", tmp_path / "smg.log"
    )
    try:
        late = Gateway(gateway.replicas, proc, port, log_path, gateway.model, gateway.tokenizer,
                       metrics_port)  # fmt: skip
        snapshot_blocks = wait_for(
            lambda: (found := late.metric("smg_kv_event_blocks_total", op="snapshot"))
            and len(found) == 2 and min(found) >= 3 and found,
            "no snapshot reached the new gateway:\n" + log_path.read_text()[-3000:],
        )  # fmt: skip
        assert late.metric("smg_kv_event_resyncs_total", reason="snapshot") == [1.0, 1.0]
        indexed = late.metric("smg_kv_index_blocks")
        assert sorted(indexed) == sorted(snapshot_blocks), (indexed, snapshot_blocks)
    finally:
        proc.kill()
        proc.wait()


def test_flush_cache_clears_the_replicas_prefix_cache_and_says_so_on_its_kv_events(
    gateway: Gateway,
) -> None:
    replica = gateway.replicas[1]
    ids = [200 + i % 30 for i in range(40)]
    with replica.channel() as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        list(stub.Generate(greedy(ids, 1), timeout=60))
        events = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=60)
        next(events)  # the snapshot
        flushed = stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=10), timeout=30)
        assert flushed.success, flushed.message
        batch = next(events)
        events.cancel()
        assert [e.WhichOneof("data") for e in batch.events] == ["cleared"]
        (again,) = list(stub.Generate(greedy(ids, 1), timeout=60))[-1:]
    assert again.complete.cached_tokens == 0  # the prefix was forgotten


def test_a_replica_killed_mid_stream_leaves_the_other_whole(
    gateway: Gateway, tmp_path: Path
) -> None:
    # round-robin puts two of the four streams on each replica (cache_aware, idle, may not)
    proc, port, log_path, _ = start_smg(gateway.replicas, "round_robin", tmp_path / "smg.log")
    try:
        rr = Gateway(gateway.replicas, proc, port, log_path, gateway.model, gateway.tokenizer)
        wait_ready(rr)
        kill_mid_stream(rr)
    finally:
        proc.kill()
        proc.wait()


def kill_mid_stream(gateway: Gateway) -> None:
    client = gateway.client()
    results: dict[int, tuple[str, int, str | None]] = {}

    def stream(i: int) -> None:
        text, num, error, finish = "", 0, None, None
        try:
            for chunk in client.completions.create(
                # long enough to still run when the replicas are asked (400 tokens of the tiny
                # model ended in ~1 s on an idle machine, before the count)
                model=gateway.model, prompt=f"Story number {i}:", max_tokens=1500, temperature=0,
                stream=True, extra_body={"ignore_eos": True},
            ):  # fmt: skip
                if chunk.choices:
                    text += chunk.choices[0].text
                    num += 1
                    finish = chunk.choices[0].finish_reason or finish
                    results[i] = (text, num, None)
        except openai.APIError as exc:
            error = repr(exc)
        results[i] = (text, num, error or f"done: {finish}")

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    wait_for(lambda: len(results) == 4 and all(r[1] >= 3 for r in results.values()), "streams")
    active = []
    for replica in gateway.replicas:
        with replica.channel() as channel:
            info = vllm_engine_pb2_grpc.VllmEngineStub(channel).GetServerInfo(
                vpb.GetServerInfoRequest(), timeout=10
            )
        active.append(info.active_requests)
    assert all(active) and sum(active) == 4, (active, results)
    victim = 0
    gateway.replicas[victim].kill()
    for thread in threads:
        thread.join(120)
    whole = [r for r in results.values() if r[2] == "done: length"]
    assert len(whole) == active[1 - victim], (active, results)
    assert len(results) - len(whole) == active[victim], (active, results)
    # new requests all succeed on the survivor
    for i in range(5):
        reply = client.completions.create(model=gateway.model, prompt=f"after {i}", max_tokens=3)
        assert reply.choices[0].finish_reason in ("length", "stop")
