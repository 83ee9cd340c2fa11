"""The front door against careless and hostile callers: each defect a client found, as a test.

Through the generated stubs only, against the "front" server: an admission limit of 4
(max_num_seqs 2 + 2 queued), a 4 s stall time and a cache of 1536 tokens.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2

from asyncengine.v1 import control_pb2 as cpb
from asyncengine.v1 import generation_pb2 as pb

from .utils import (
    ServerProcess,
    bad_field,
    check_stream_shape,
    detail,
    greedy_request,
    read_rest,
    read_until,
    stubs,
)

VOCAB_SIZE = 512  # the test model's


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def front(server_pool: Any) -> ServerProcess:
    return server_pool["front"]


def alone(server: ServerProcess, prompt: str, max_new_tokens: int) -> str:
    with server.channel() as channel:
        generation, _ = stubs(channel)
        return check_stream_shape(
            list(generation.GenerateStream(greedy_request(prompt, max_new_tokens)))
        )


def test_caller_ids_never_collide_with_the_samples_of_another_request(
    front: ServerProcess,
) -> None:
    """`victim#1` in flight, then `victim` with n=2: once the engine's own sample ids."""

    async def main() -> tuple[list[Any], list[Any]]:
        async with front.aio_channel() as channel:
            generation, _ = stubs(channel)
            first = generation.GenerateStream(
                greedy_request("the first", 24, request_id="victim#1"), timeout=60
            )
            head = await read_until(first, "delta")
            sampling = pb.SamplingOptions(temperature=0.8, seed=3, n=2)
            second = generation.GenerateStream(
                greedy_request("the second", 24, request_id="victim", sampling=sampling),
                timeout=60,
            )
            return head + await read_rest(first), await read_rest(second)

    first, second = run(main())
    check_stream_shape(first)
    finished = [r.finished for r in second if r.HasField("finished")]
    assert sorted(f.sample_index for f in finished) == [0, 1]
    assert all(f.reason == pb.LENGTH for f in finished)
    assert alone(front, "still serving", 4)


@pytest.mark.parametrize(
    "field, bad",
    [
        (
            "stopping.stop_token_ids",
            greedy_request(
                "x", 4, stopping=pb.StoppingOptions(stop_token_ids=[VOCAB_SIZE], min_new_tokens=1)
            ),
        ),
        (
            "stopping.stop_token_ids",
            greedy_request("x", 4, stopping=pb.StoppingOptions(stop_token_ids=[2**32 - 1])),
        ),
        ("token_ids", greedy_request([5, VOCAB_SIZE], 4)),
    ],
)
def test_token_ids_out_of_the_vocabulary_are_refused_and_harm_no_one(
    front: ServerProcess, field: str, bad: pb.GenerateRequest
) -> None:
    expected = alone(front, "a bystander", 48)

    async def main() -> tuple[grpc.aio.AioRpcError, list[Any]]:
        async with front.aio_channel() as channel:
            generation, _ = stubs(channel)
            bystander = generation.GenerateStream(greedy_request("a bystander", 48), timeout=60)
            head = await read_until(bystander, "delta")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await read_rest(generation.GenerateStream(bad, timeout=30))
            return refused.value, head + await read_rest(bystander)

    refused, bystander = run(main())
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_field(refused) == field
    assert check_stream_shape(bystander) == expected


def test_detokenize_refuses_ids_out_of_the_vocabulary(front: ServerProcess) -> None:
    with front.channel() as channel:
        generation, _ = stubs(channel)
        request = pb.DetokenizeRequest(sequences=[pb.TokenIds(ids=[5]), pb.TokenIds(ids=[512])])
        with pytest.raises(grpc.RpcError) as refused:
            generation.Detokenize(request)
    assert bad_field(refused.value) == "sequences[1].ids"


def test_a_7_mib_prompt_is_refused_by_its_size_before_tokenizing(
    front: ServerProcess,
) -> None:
    """Within the default message size (8 MiB), far over the context's prompt bytes."""
    with front.channel() as channel:
        generation, _ = stubs(channel)
        with pytest.raises(grpc.RpcError) as refused:
            list(generation.GenerateStream(greedy_request("word " * ((7 << 20) // 5), 4)))
        with pytest.raises(grpc.RpcError) as tokenize_refused:
            generation.Tokenize(pb.TokenizeRequest(texts=["word " * ((4 << 20) // 5)]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_field(refused.value) == "text"
    assert "bytes" in refused.value.details()  # measured, not tokenized
    assert bad_field(tokenize_refused.value) == "texts"


def test_a_million_stop_strings_are_refused(front: ServerProcess) -> None:
    stopping = pb.StoppingOptions(stop=["a"] * 1_000_000)
    with front.channel() as channel:
        generation, _ = stubs(channel)
        with pytest.raises(grpc.RpcError) as refused:
            list(generation.GenerateStream(greedy_request("x", 4, stopping=stopping)))
    assert bad_field(refused.value) == "stopping.stop"


def test_a_1_mib_request_id_is_refused_and_not_logged_whole(front: ServerProcess) -> None:
    long_id = "i" * (1 << 20)
    with front.channel() as channel:
        generation, _ = stubs(channel)
        with pytest.raises(grpc.RpcError) as refused:
            list(generation.GenerateStream(greedy_request("x", 4, request_id=long_id)))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_field(refused.value) == "request_id"
    assert len(refused.value.details()) < 1000
    assert max(len(line) for line in front.log().splitlines()) < 10_000


def test_a_client_that_leaves_is_logged_as_client_cancelled(front: ServerProcess) -> None:
    async def main() -> None:
        async with front.aio_channel() as channel:
            generation, _ = stubs(channel)
            call = generation.GenerateStream(greedy_request("leaving", None, request_id="leaver"))
            await read_until(call, "delta")
            call.cancel()
        await asyncio.sleep(0.5)

    run(main())
    (line,) = [r for r in front.log_records() if r.get("request_id") == "leaver"]
    assert line["finish_reason"] == "CLIENT_CANCELLED"


def test_a_batch_that_can_never_be_admitted_is_invalid_not_a_retry(front: ServerProcess) -> None:
    prompts = [pb.Prompt(text=f"prompt {i}") for i in range(5)]  # the limit is 4
    with front.channel() as channel:
        generation, _ = stubs(channel)
        with pytest.raises(grpc.RpcError) as refused:
            generation.Generate(pb.GenerateBatchRequest(prompts=prompts))
        fits = generation.Generate(pb.GenerateBatchRequest(prompts=prompts[:4]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_field(refused.value) == "prompts"
    assert len(fits.results) == 4


def test_a_sequence_the_whole_cache_cannot_hold_ends_cache_limit(front: ServerProcess) -> None:
    with front.channel() as channel:
        generation, _ = stubs(channel)
        responses = list(generation.GenerateStream(greedy_request([5, 6], None), timeout=120))
    check_stream_shape(responses)
    assert responses[-2].finished.reason == pb.CACHE_LIMIT  # not LENGTH: max_new_tokens unset
    # the cache's 96 blocks of 16, well short of the context (2048)
    assert responses[-1].usage.completion_tokens == 96 * 16 - 2


def test_readers_that_stop_reading_hold_no_admission_and_are_ended(front: ServerProcess) -> None:
    """Four streams fill their HTTP/2 windows and are never read again: once the engine is
    done with them, new calls are admitted; after the stall time each ends with a status."""
    flood = greedy_request(
        [5, 7], 1000, response=pb.ResponseOptions(logprobs=20, return_token_ids=True)
    )

    async def main() -> tuple[cpb.LoadReport, list[Any], list[Any]]:
        # no BDP probing: the client's window stays at HTTP/2's 64 KiB, as a reader that stops
        # reading leaves it
        options = [("grpc.http2.bdp_probe", 0)]
        stalled_channels = [grpc.aio.insecure_channel(front.target, options) for _ in range(4)]
        calls = [stubs(c)[0].GenerateStream(flood, timeout=120) for c in stalled_channels]
        for call in calls:
            await read_until(call, "delta")  # then never read again
        async with front.aio_channel() as channel:
            generation, control = stubs(channel)
            for _ in range(600):  # the engine finishes them although nobody reads
                load = (await control.GetServerInfo(cpb.GetServerInfoRequest())).load
                if load.admitted == 0 and load.running == 0:
                    break
                await asyncio.sleep(0.05)
            # the limit is 4 and four streams are open: a new one is still admitted
            admitted = await read_rest(generation.GenerateStream(greedy_request("next", 4)))
        # the handlers stay blocked on writes nobody takes until the stall time ends them
        for _ in range(600):
            if len(stalled_lines(front)) == 4:
                break
            await asyncio.sleep(0.05)
        ends = []
        for call in calls:
            try:
                await read_rest(call)
                ends.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as error:
                ends.append(error)
        for channel in stalled_channels:
            await channel.close()
        return load, admitted, ends

    load, admitted, ends = run(main())
    assert load.admitted == 0 and load.running == 0
    check_stream_shape(admitted)
    for end in ends:
        assert isinstance(end, grpc.aio.AioRpcError), end
        assert end.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert detail(end, error_details_pb2.ErrorInfo).reason == "CLIENT_STALLED"
    assert len(stalled_lines(front)) == 4


def stalled_lines(server: ServerProcess) -> list[dict[str, Any]]:
    return [r for r in server.log_records() if r.get("finish_reason") == "CLIENT_STALLED"]
