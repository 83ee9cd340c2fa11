"""One real server on loopback, driven only through the stubs generated from protos/."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from asyncengine import LLM, SamplingParams
from asyncengine.v1 import control_pb2 as cpb
from asyncengine.v1 import generation_pb2 as pb

from .conftest import MAX_MODEL_LEN
from .utils import (
    NOT_SERVING,
    SERVING,
    ServerProcess,
    bad_field,
    check_stream_shape,
    detail,
    events,
    greedy_request,
    read_rest,
    read_until,
    stubs,
)

PHRASES = [
    "양자역학 설명해줄래?",
    "재미있는 이야기 들려줘",
    "봄에 관한 시를 써줄래?",
    "Hello, my name is",
    "The capital of France is",
    "I love pizza 🍕 and",
    "def fibonacci(n: int) -> int:",
]


@pytest.fixture(scope="module")
def server(server_pool: Any) -> ServerProcess:
    """The shared server (see SERVER_SPECS["main"]); the last test here ends it with SIGTERM."""
    return server_pool["main"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # for the in-process reference LLM


@pytest.fixture(scope="module")
def llm(model_dir: Any) -> LLM:
    """The offline engine the served results must equal."""
    return LLM(
        model=str(model_dir("llama")),
        device="cpu",
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        num_gpu_blocks_override=2048,
        num_cpu_blocks_override=64,
    )


def make_prompts(n: int, seed: int) -> list[str | list[int]]:
    rng = random.Random(seed)
    return [
        f"{rng.choice(PHRASES)} {i}"
        if i % 2 == 0
        else [rng.randrange(3, 500) for _ in range(rng.randint(2, 30))]
        for i in range(n)
    ]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def read_stream(call: Any) -> list[pb.GenerateResponse]:
    return [response async for response in call]


def assert_idle(control: Any, within_s: float = 1.0) -> cpb.LoadReport:
    """Nothing running, waiting or swapped, and every block free, within `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        load = control.GetServerInfo(cpb.GetServerInfoRequest()).load
        idle = (load.running, load.waiting, load.swapped) == (0, 0, 0)
        if idle and load.gpu_blocks_free == load.gpu_blocks_total:
            assert load.cpu_blocks_free == load.cpu_blocks_total
            return load
        assert time.monotonic() < deadline, f"not idle: {load}"
        time.sleep(0.02)


def test_health_and_reflection_list_both_services(server: ServerProcess) -> None:
    with server.channel() as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "asyncengine.v1.Generation", "asyncengine.v1.Control"):
            assert health.Check(health_pb2.HealthCheckRequest(service=name)).status == SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        (reply,) = list(reflection.ServerReflectionInfo(iter([ask])))
        names = {s.name for s in reply.list_services_response.service}
    assert {"asyncengine.v1.Generation", "asyncengine.v1.Control"} <= names
    assert "grpc.health.v1.Health" in names


def test_reflection_v1_lists_services_beside_v1alpha(server: ServerProcess) -> None:
    # no v1 stub ships with grpcio-reflection 1.85; v1's messages are v1alpha's renamed
    with server.channel() as channel:
        info = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        (reply,) = list(info(iter([ask])))
    names = {s.name for s in reply.list_services_response.service}
    assert {"asyncengine.v1.Generation", "asyncengine.v1.Control"} <= names
    assert {f"grpc.reflection.{v}.ServerReflection" for v in ("v1", "v1alpha")} <= names


def test_64_concurrent_streams_equal_llm_generate(server: ServerProcess, llm: LLM) -> None:
    prompts = make_prompts(64, seed=1)
    rng = random.Random(2)
    requests, params = [], []
    for i, prompt in enumerate(prompts):
        max_new_tokens = rng.randint(4, 24)
        seed = 1000 + i if i % 4 >= 2 else None  # half greedy, half seeded sampling
        temperature = 0.8 if seed is not None else 0.0
        sampling = pb.SamplingOptions(temperature=temperature, seed=seed)
        requests.append(
            greedy_request(
                prompt,
                max_new_tokens,
                sampling=sampling,
                request_id=f"par-{i}",
                response=pb.ResponseOptions(return_token_ids=True),
            )
        )
        params.append(
            SamplingParams(
                temperature=temperature, seed=seed, max_tokens=max_new_tokens, ignore_eos=True
            )
        )
    expected = llm.generate(prompts, params, use_tqdm=False)

    async def main() -> list[list[pb.GenerateResponse]]:
        async with server.aio_channel() as channel:
            generation, _ = stubs(channel)
            calls = [generation.GenerateStream(r, timeout=60) for r in requests]
            return await asyncio.gather(*map(read_stream, calls))

    streams = run(main())
    for i, (responses, reference) in enumerate(zip(streams, expected)):
        text = check_stream_shape(responses)
        completion = reference.outputs[0]
        assert text == completion.text, f"stream {i}"
        token_ids = [t for r in responses if r.HasField("delta") for t in r.delta.token_ids]
        assert token_ids == completion.token_ids, f"stream {i}"
        accepted = responses[0].accepted
        assert accepted.request_id == f"par-{i}"
        assert accepted.prompt_tokens == len(reference.prompt_token_ids)
        assert accepted.seed == (1000 + i if i % 4 >= 2 else 0)
        assert responses[-2].finished.reason == pb.LENGTH
        assert responses[-1].usage.prompt_tokens == accepted.prompt_tokens
        assert responses[-1].usage.time_to_first_token_s > 0
    with server.channel() as channel:
        assert_idle(stubs(channel)[1])


def test_unary_generate_returns_results_in_prompt_order(server: ServerProcess, llm: LLM) -> None:
    prompts = make_prompts(8, seed=3)
    params = SamplingParams(temperature=0.7, seed=11, max_tokens=12, ignore_eos=True)
    expected = llm.generate(prompts, params, use_tqdm=False)
    request = pb.GenerateBatchRequest(
        prompts=[
            pb.Prompt(text=p) if isinstance(p, str) else pb.Prompt(token_ids=pb.TokenIds(ids=p))
            for p in prompts
        ],
        sampling=pb.SamplingOptions(temperature=0.7, seed=11),
        stopping=pb.StoppingOptions(max_new_tokens=12, ignore_eos=True),
        response=pb.ResponseOptions(return_token_ids=True),
    )
    with server.channel() as channel:
        reply = stubs(channel)[0].Generate(request, timeout=60)
    assert len(reply.results) == len(prompts)
    for result, reference in zip(reply.results, expected):
        assert result.text == reference.outputs[0].text
        assert list(result.token_ids) == reference.outputs[0].token_ids
        assert result.finish_reason == pb.LENGTH
        assert result.usage.completion_tokens == 12
        assert result.usage.prompt_tokens == len(reference.prompt_token_ids)


def test_tokenize_and_detokenize_round_trip_korean(server: ServerProcess) -> None:
    texts = ["안녕하세요, 만나서 반갑습니다.", "양자역학 설명해줄래? 🚀", "봄비가 내리면 꽃이 핀다"]
    with server.channel() as channel:
        generation, _ = stubs(channel)
        tokenized = generation.Tokenize(
            pb.TokenizeRequest(texts=texts, return_tokens=True, return_offsets=True)
        )
        sequences = [pb.TokenIds(ids=r.token_ids) for r in tokenized.results]
        detokenized = generation.Detokenize(pb.DetokenizeRequest(sequences=sequences))
        truncated = generation.Tokenize(
            pb.TokenizeRequest(texts=texts[:1], add_special_tokens=False, truncate=3)
        )
        raw = generation.Detokenize(
            pb.DetokenizeRequest(sequences=sequences[:1], skip_special_tokens=False)
        )
    assert list(detokenized.texts) == texts
    assert raw.texts[0] == "<s>" + texts[0]  # BOS is kept when asked
    for text, result in zip(texts, tokenized.results):
        assert result.token_ids[0] == 0 and result.token_count == len(result.token_ids)
        assert len(result.tokens) == len(result.offsets) == result.token_count
        assert all(0 <= o.start <= o.end <= len(text) for o in result.offsets)
        assert result.offsets[-1].end == len(text)
    # truncation keeps the end of the text; no BOS was asked for
    (head,) = truncated.results
    assert list(head.token_ids) == list(tokenized.results[0].token_ids[-3:])


def test_heartbeats_while_queued_and_abort_is_idempotent(server: ServerProcess) -> None:
    """16 long requests fill the batch; a 17th waits (QUEUED heartbeats) until they are aborted."""
    fillers = [greedy_request([5 + i, 7, 9], None, request_id=f"fill-{i}") for i in range(16)]

    async def main() -> tuple[list[pb.GenerateResponse], list[Any], list[str], list[str]]:
        async with server.aio_channel() as channel:
            generation, control = stubs(channel)
            calls = [generation.GenerateStream(r, timeout=60) for r in fillers]
            for call in calls:
                await read_until(call, "delta")  # all 16 are running now
            waiting = generation.GenerateStream(greedy_request("queued", 4, request_id="q"))
            head = [await waiting.read() for _ in range(3)]
            filler_ids = [r.request_id for r in fillers]
            abort = await control.Abort(cpb.AbortRequest(request_ids=filler_ids))
            again = await control.Abort(cpb.AbortRequest(request_ids=["fill-0", "unknown"]))
            rest = await read_rest(waiting)
            ends = [await read_rest(call) for call in calls]
            return head + rest, ends, list(abort.aborted_ids), list(again.aborted_ids)

    queued, filler_ends, aborted, aborted_again = run(main())
    assert events(queued[:3]) == ["accepted", "heartbeat", "heartbeat"]
    assert {r.heartbeat.phase for r in queued[1:3]} == {pb.Heartbeat.QUEUED}
    check_stream_shape(queued)
    assert queued[-2].finished.reason == pb.LENGTH
    assert sorted(aborted) == sorted(f"fill-{i}" for i in range(16))
    assert aborted_again == []
    for end in filler_ends:
        assert events(end[-2:]) == ["finished", "usage"]
        assert end[-2].finished.reason == pb.CANCELLED
        assert end[-1].usage.completion_tokens < MAX_MODEL_LEN - 3  # really cut short


def test_half_of_64_streams_cancelled_frees_every_block(server: ServerProcess) -> None:
    """Every even stream runs to the context limit unless cancelled: by the client, by its
    deadline, or by Control.Abort. All must leave the engine at once."""
    prompts = make_prompts(64, seed=4)
    kinds = {i: ("client", "deadline", "abort")[(i // 2) % 3] for i in range(0, 64, 2)}

    async def one(generation: Any, control: Any, i: int) -> str:
        kind = kinds.get(i)
        request = greedy_request(prompts[i], None if kind else 8, request_id=f"cx-{i}")
        call = generation.GenerateStream(request, timeout=0.25 if kind == "deadline" else 60)
        responses = []
        try:
            async for response in call:
                responses.append(response)
                num_deltas = sum(r.HasField("delta") for r in responses)
                is_delta = response.HasField("delta")
                if kind == "client" and is_delta and num_deltas == 2:
                    call.cancel()
                    return "client"
                if kind == "abort" and is_delta and num_deltas == 1:
                    reply = await control.Abort(cpb.AbortRequest(request_ids=[f"cx-{i}"]))
                    assert list(reply.aborted_ids) == [f"cx-{i}"]
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and kind == "deadline"
            return "deadline"
        check_stream_shape(responses)
        reason = responses[-2].finished.reason
        assert reason == (pb.CANCELLED if kind == "abort" else pb.LENGTH), (i, reason)
        return kind or "done"

    async def main() -> list[str]:
        async with server.aio_channel() as channel:
            generation, control = stubs(channel)
            return await asyncio.gather(*(one(generation, control, i) for i in range(64)))

    outcomes = run(main())
    assert outcomes == [kinds.get(i, "done") for i in range(64)]
    with server.channel() as channel:
        _, control = stubs(channel)
        assert_idle(control, within_s=1.0)
        # the server is still fine
        reply = stubs(channel)[0].Generate(
            pb.GenerateBatchRequest(
                prompts=[pb.Prompt(text="after")], stopping=pb.StoppingOptions(max_new_tokens=3)
            )
        )
        assert reply.results[0].usage.completion_tokens == 3


def test_parallel_samples_stream_with_their_index_and_equal_llm(server, llm) -> None:
    prompt, n = "봄에 관한 시를 써줄래?", 3
    request = pb.GenerateRequest(
        text=prompt,
        sampling=pb.SamplingOptions(n=n, temperature=0.9, seed=77),
        stopping=pb.StoppingOptions(max_new_tokens=16, ignore_eos=True),
        response=pb.ResponseOptions(return_token_ids=True),
    )
    with server.channel() as channel:
        generation, _ = stubs(channel)
        responses = list(generation.GenerateStream(request, timeout=60))
        with pytest.raises(grpc.RpcError) as batch_error:  # one result per prompt: n must be 1
            generation.Generate(
                pb.GenerateBatchRequest(prompts=[pb.Prompt(text=prompt)], sampling=request.sampling)
            )
    assert bad_field(batch_error.value) == "sampling.n"
    kinds = events(responses)
    assert kinds[0] == "accepted" and kinds[-n - 1 :] == ["finished"] * n + ["usage"], kinds
    seqs = [getattr(r, k).sequence_number for r, k in zip(responses[1:], kinds[1:])]
    assert seqs == list(range(1, len(responses)))
    texts, tokens = [""] * n, [[] for _ in range(n)]
    for delta in (r.delta for r in responses if r.HasField("delta")):
        assert delta.token_offset == len(tokens[delta.sample_index])
        texts[delta.sample_index] += delta.text
        tokens[delta.sample_index] += delta.token_ids
    finished = [r.finished for r in responses if r.HasField("finished")]
    assert [f.sample_index for f in finished] == list(range(n))
    assert all(f.reason == pb.FinishReason.LENGTH for f in finished)
    expected = llm.generate(
        prompt,
        SamplingParams(n=n, temperature=0.9, seed=77, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert texts == [c.text for c in expected.outputs]
    assert tokens == [c.token_ids for c in expected.outputs]
    assert responses[-1].usage.completion_tokens == n * 16


BAD_REQUESTS = [
    ("sampling.temperature", {"sampling": pb.SamplingOptions(temperature=-1)}),
    ("sampling.top_p", {"sampling": pb.SamplingOptions(top_p=1.5)}),
    ("sampling.min_p", {"sampling": pb.SamplingOptions(min_p=2.0)}),
    ("sampling.repetition_penalty", {"sampling": pb.SamplingOptions(repetition_penalty=0)}),
    ("sampling.presence_penalty", {"sampling": pb.SamplingOptions(presence_penalty=3)}),
    ("sampling.frequency_penalty", {"sampling": pb.SamplingOptions(frequency_penalty=-3)}),
    ("sampling.seed", {"sampling": pb.SamplingOptions(seed=2**63)}),
    ("sampling.n", {"sampling": pb.SamplingOptions(n=65)}),
    ("sampling.n", {"sampling": pb.SamplingOptions(n=17)}),  # the server's max_num_seqs is 16
    ("cache_salt", {"cache_salt": "x" * 257}),
    ("stopping.max_new_tokens", {"stopping": pb.StoppingOptions(max_new_tokens=0)}),
    (
        "stopping.min_new_tokens",
        {"stopping": pb.StoppingOptions(max_new_tokens=4, min_new_tokens=5)},
    ),
    ("stopping.stop", {"stopping": pb.StoppingOptions(stop=[""])}),
    ("response.logprobs", {"response": pb.ResponseOptions(logprobs=21)}),
    ("text", {"text": ""}),
    ("text", {"no_prompt": True}),
    ("token_ids", {"token_ids": pb.TokenIds(ids=[5, 512])}),
    ("token_ids", {"token_ids": pb.TokenIds(ids=[5] * MAX_MODEL_LEN)}),
    (
        "stopping.max_new_tokens",
        {
            "token_ids": pb.TokenIds(ids=[5] * (MAX_MODEL_LEN - 10)),
            "stopping": pb.StoppingOptions(max_new_tokens=11),
        },
    ),
]


def make_bad_request(fields: dict[str, Any]) -> pb.GenerateRequest:
    """The request with `fields`; prompt "hello" unless they set one (or say `no_prompt`)."""
    fields = dict(fields)
    if not (fields.pop("no_prompt", False) or "text" in fields or "token_ids" in fields):
        fields["text"] = "hello"
    return pb.GenerateRequest(**fields)


@pytest.mark.parametrize(("field", "fields"), BAD_REQUESTS, ids=[f for f, _ in BAD_REQUESTS])
def test_bad_input_is_invalid_argument_naming_the_field(
    server: ServerProcess, field: str, fields: dict[str, Any]
) -> None:
    with server.channel() as channel:
        generation, _ = stubs(channel)
        with pytest.raises(grpc.RpcError) as stream_error:
            list(generation.GenerateStream(make_bad_request(fields), timeout=10))
        assert stream_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad_field(stream_error.value) == field
        # the same through unary Generate, where the field is that of the failing prompt
        request = make_bad_request(fields)
        prompt_kind = request.WhichOneof("prompt")
        prompts = [pb.Prompt(text="fine")]
        if prompt_kind is not None:
            prompts.append(pb.Prompt(**{prompt_kind: getattr(request, prompt_kind)}))
        batch = pb.GenerateBatchRequest(
            prompts=prompts,
            cache_salt=request.cache_salt,
            sampling=request.sampling,
            stopping=request.stopping,
            response=request.response,
        )
        if field in ("text", "token_ids") and prompt_kind is None:
            batch.prompts.append(pb.Prompt())
        with pytest.raises(grpc.RpcError) as batch_error:
            generation.Generate(batch, timeout=10)
        assert batch_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        expected = f"prompts[1].{field}" if field in ("text", "token_ids") else field
        assert bad_field(batch_error.value) == expected


def test_other_bad_calls_and_the_server_keeps_serving(server: ServerProcess) -> None:
    with server.channel() as channel:
        generation, control = stubs(channel)
        with pytest.raises(grpc.RpcError) as error:
            generation.Generate(pb.GenerateBatchRequest())
        assert bad_field(error.value) == "prompts"
        with pytest.raises(grpc.RpcError) as error:
            generation.Detokenize(pb.DetokenizeRequest(sequences=[pb.TokenIds(ids=[3, 999])]))
        assert bad_field(error.value) == "sequences[0].ids"
        # a duplicate of a request still in flight
        first = generation.GenerateStream(greedy_request([5, 6], None, request_id="dup"))
        assert next(first).HasField("accepted")
        with pytest.raises(grpc.RpcError) as error:
            list(generation.GenerateStream(greedy_request("x", 2, request_id="dup")))
        assert error.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert detail(error.value, error_details_pb2.ErrorInfo).reason == "DUPLICATE_REQUEST_ID"
        assert list(control.Abort(cpb.AbortRequest(request_ids=["dup"])).aborted_ids) == ["dup"]
        assert list(first)[-2].finished.reason == pb.CANCELLED
        responses = list(generation.GenerateStream(greedy_request("still fine", 5)))
        check_stream_shape(responses)
        assert_idle(control)


def test_finish_reasons_stop_details_echo_and_logprobs(server: ServerProcess) -> None:
    prompt = [11, 12, 13, 14]
    with server.channel() as channel:
        generation, _ = stubs(channel)

        def stream(**kwargs: Any) -> list[pb.GenerateResponse]:
            return list(generation.GenerateStream(greedy_request(prompt, **kwargs), timeout=30))

        plain = stream(max_new_tokens=24, response=pb.ResponseOptions(return_token_ids=True))
        text = check_stream_shape(plain)
        token_ids = [t for r in plain if r.HasField("delta") for t in r.delta.token_ids]
        stop_token = stream(
            max_new_tokens=24, stopping=pb.StoppingOptions(stop_token_ids=[token_ids[5]])
        )
        stop = text[len(text) // 2 :][:3]
        stop_string = stream(max_new_tokens=24, stopping=pb.StoppingOptions(stop=[stop]))
        time_limit = stream(
            max_new_tokens=None, stopping=pb.StoppingOptions(ignore_eos=True, time_limit_ms=50)
        )
        context = list(generation.GenerateStream(greedy_request([5] * (MAX_MODEL_LEN - 6), None)))
        echo = stream(max_new_tokens=6, response=pb.ResponseOptions(echo_prompt=True, logprobs=3))
    finished = stop_token[-2].finished
    assert (finished.reason, finished.stop_token_id) == (pb.STOP_TOKEN, token_ids[5])
    assert stop_token[-1].usage.completion_tokens == token_ids.index(token_ids[5]) + 1
    finished = stop_string[-2].finished
    assert (finished.reason, finished.stop_string) == (pb.STOP_STRING, stop)
    assert check_stream_shape(stop_string) == text[: text.index(stop)]
    assert time_limit[-2].finished.reason == pb.TIME_LIMIT
    assert time_limit[-1].usage.completion_tokens < MAX_MODEL_LEN - len(prompt)
    assert context[-2].finished.reason == pb.CONTEXT_LIMIT
    assert context[-1].usage.completion_tokens == 6
    accepted = echo[0].accepted
    assert list(accepted.prompt_token_ids) == prompt and accepted.prompt_text
    positions = [lp for r in echo if r.HasField("delta") for lp in r.delta.logprobs]
    assert len(positions) == 6
    for position in positions:
        assert len(position.top) == 3 and position.top[0].logprob >= position.top[-1].logprob
        assert position.sampled.logprob <= 0 and position.sampled.token


def test_model_info_server_info_and_watch_load(server: ServerProcess) -> None:
    with server.channel() as channel:
        _, control = stubs(channel)
        model = control.GetModelInfo(cpb.GetModelInfoRequest())
        info = control.GetServerInfo(cpb.GetServerInfoRequest())
        watch = control.WatchLoad(cpb.WatchLoadRequest(interval_ms=50), timeout=10)
        reports = [next(watch), next(watch)]
        watch.cancel()
    assert model.architecture == "LlamaForCausalLM" and model.max_context_length == MAX_MODEL_LEN
    assert (model.vocab_size, list(model.eos_token_ids), model.bos_token_id) == (512, [1], 0)
    assert (model.block_size, model.max_num_seqs, model.max_queued_requests) == (16, 16, 128)
    assert info.version and info.uptime_s > 0 and not info.draining
    assert info.load.gpu_blocks_total == 2048 and info.load.cpu_blocks_total == 64
    assert all(r.gpu_blocks_total == 2048 for r in reports)


def test_logs_are_json_lines_one_per_finished_request(server: ServerProcess) -> None:
    with server.channel() as channel:
        generation, _ = stubs(channel)
        list(generation.GenerateStream(greedy_request("log me", 7, request_id="log-1")))
    records = server.log_records()  # raises if any line is not JSON
    mine = [r for r in records if r.get("request_id") == "log-1"]
    assert len(mine) == 1, mine  # one line per request, nothing per token
    (line,) = mine
    assert line["event"] == "request_finished" and line["level"] == "info"
    assert (line["finish_reason"], line["completion_tokens"]) == ("LENGTH", 7)
    assert {"time_to_first_token_s", "total_s", "preemptions", "prompt_tokens"} <= set(line)


def test_sigterm_during_streaming_ends_streams_cleanly_and_exits_0(server_pool: Any) -> None:
    """On a server of its own (grace period 1 s): the SIGTERM ends it."""
    server = server_pool["sigterm"]

    async def main() -> tuple[Any, ...]:
        async with server.aio_channel() as channel:
            generation, _ = stubs(channel)
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == SERVING
            # two finish within the grace period; two would run ~1000 tokens and are cut off
            # (their penalties and logprobs make each step cost far more than on the fast path)
            slow = {
                "sampling": pb.SamplingOptions(
                    temperature=0.0,
                    repetition_penalty=1.2,
                    presence_penalty=0.5,
                    frequency_penalty=0.5,
                ),
                "response": pb.ResponseOptions(logprobs=20, return_token_ids=True),
            }
            requests = [
                greedy_request([5, i], 20) if i < 2 else greedy_request([5, i], None, **slow)
                for i in range(4)
            ]
            calls = [generation.GenerateStream(r, timeout=60) for r in requests]
            heads = [await read_until(call, "delta") for call in calls]
            server.proc.send_signal(signal.SIGTERM)
            assert (await watch.read()).status == NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await read_rest(generation.GenerateStream(greedy_request("late", 2)))
            ends = [await read_rest(call) for call in calls]
            return heads, ends, refused.value

    heads, ends, refused = run(main())
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert detail(refused, error_details_pb2.ErrorInfo).reason == "DRAINING"
    reasons = []
    for head, end in zip(heads, ends):
        check_stream_shape(head + end)  # Accepted ... Finished, Usage, then status OK
        reasons.append(end[-2].finished.reason)
    assert reasons == [pb.LENGTH, pb.LENGTH, pb.ABORTED_BY_SERVER, pb.ABORTED_BY_SERVER]
    assert server.proc.wait(timeout=30) == 0
    assert any(r["event"] == "drain_done" and r["aborted"] == 2 for r in server.log_records())
