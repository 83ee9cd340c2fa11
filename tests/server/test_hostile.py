"""Defects a hostile or careless client still finds at the redesigned front door (issue 12).

Each test reproduces one defect against a subprocess server, through the generated stubs
only: the shared "main" server, or `hostile`, a server of this module's own with bearer
tokens and the max_prompt_bytes a 32k-context model gets by default (32 x 32768 = 1 MiB).

"Stalls other streams" is measured as issue 12 measures it: a canary stream runs throughout
and its worst gap between two messages must stay far below what the defect causes.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from asyncengine.v1 import control_pb2 as cpb
from asyncengine.v1 import generation_pb2 as pb

from .utils import ServerProcess, bad_field, greedy_request, read_rest, stubs

TENANT = [("authorization", "Bearer tenant-token")]
CONTROL = [("authorization", "Bearer control-token")]
HOSTILE_FLAGS = (
    "--auth-token", "tenant-token", "--control-auth-token", "control-token",
    # what --max-model-len 32768 derives (32 bytes per token): a 32k-context model's default
    "--max-prompt-bytes", str(1 << 20),
    "--max-num-seqs", "4", "--max-queued-requests", "8", "--heartbeat-interval", "0.5",
    "--drain-grace-period", "1.0",
    # 64 MiB (the default is 8 MiB): the 60 MB message below is read, as before
    "--max-message-size", str(64 << 20),
)  # fmt: skip
# a canary's worst gap while another caller's call runs; its normal gap is about 1 ms
MAX_STALL_S = 0.4
# generation.proto: per-token detail is for at most this many bytes of text per call
MAX_DETAILED_TOKENIZE_BYTES = 65_536


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def main(server_pool: Any) -> ServerProcess:
    return server_pool["main"]


@pytest.fixture(scope="module")
def hostile(
    model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    log_path = tmp_path_factory.mktemp("server-hostile") / "server.log"
    server = ServerProcess(model_dir("llama"), log_path, *HOSTILE_FLAGS)
    try:
        server.wait_serving(timeout=300)  # it may start while the shared servers do
        yield server
    finally:
        server.stop()


async def _canary(
    server: ServerProcess,
    metadata: Any,
    started: asyncio.Event,
    stop: asyncio.Event,
    gaps: list[float],
) -> None:
    """Stream tokens until `stop`, one stream after another, recording the gaps within each."""
    async with server.aio_channel() as channel:
        generation, _ = stubs(channel)
        while not stop.is_set():
            call = generation.GenerateStream(
                greedy_request("the canary sings", 900), metadata=metadata, timeout=120
            )
            last = None
            async for _ in call:
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                    if len(gaps) >= 20:
                        started.set()
                last = now
                if stop.is_set():
                    call.cancel()
                    break


async def worst_gap_during(
    server: ServerProcess, metadata: Any, hostile_call: Callable[[], Awaitable[Any]]
) -> tuple[float, float, float, Any]:
    """(worst canary gap, median gap, seconds the hostile call took, what it returned)."""
    started, stop = asyncio.Event(), asyncio.Event()
    gaps: list[float] = []
    canary = asyncio.create_task(_canary(server, metadata, started, stop, gaps))
    await asyncio.wait_for(started.wait(), 60)
    began = time.perf_counter()
    try:
        outcome = await hostile_call()
    except grpc.RpcError as exc:
        outcome = exc
    took = time.perf_counter() - began
    await asyncio.sleep(0.3)  # the canary streams on past the end of the hostile call
    stop.set()
    await asyncio.wait_for(canary, 60)
    return max(gaps), statistics.median(gaps), took, outcome


def test_a_batch_of_many_empty_prompts_is_refused_without_stalling_other_streams(
    main: ServerProcess,
) -> None:
    """ServerState.admit checks ids for duplicates with `ids.count(id)` per id, before the
    batch-size bound: O(N^2) on the event loop. 25,000 empty prompts (a 100 KB message) froze
    every stream for 5-25 s before INVALID_ARGUMENT came back (100,000: minutes)."""
    request = pb.GenerateBatchRequest(
        prompts=[pb.Prompt(text="") for _ in range(25_000)],
        stopping=pb.StoppingOptions(max_new_tokens=1),
    )

    async def main_() -> tuple[float, float, float, Any]:
        async with main.aio_channel() as channel:
            generation, _ = stubs(channel)
            return await worst_gap_during(
                main, None, lambda: generation.Generate(request, timeout=120)
            )

    worst, median, took, outcome = run(main_())
    assert isinstance(outcome, grpc.RpcError), outcome
    assert outcome.code() == grpc.StatusCode.INVALID_ARGUMENT, outcome
    assert bad_field(outcome) == "prompts"
    assert took < 1.0, f"a batch that can never be admitted took {took:.1f} s to refuse"
    assert worst < MAX_STALL_S, (
        f"another stream went silent for {worst:.2f} s (median gap {median * 1000:.1f} ms) "
        "while a batch of 25,000 empty prompts was refused"
    )


def _tokenizer_backlog(generation: Any, metadata: Any, num_calls: int, text: str) -> Any:
    """Tokenize calls that keep the one tokenizer thread busy for a while."""
    request = pb.TokenizeRequest(texts=[text])
    return asyncio.gather(
        *(generation.Tokenize(request, metadata=metadata, timeout=60) for _ in range(num_calls))
    )


def test_control_abort_of_a_request_still_being_tokenized_ends_its_stream(
    main: ServerProcess,
) -> None:
    """Control.Abort of a request whose prompt waits for the tokenizer thread: Abort reports
    the id aborted, then AsyncLLMEngine.add_request raises CancelledError into the handler,
    which gRPC never turns into a status: the stream hangs until the client's deadline
    (forever without one), and no request_finished line is logged. The .proto: "Each
    aborted stream ends with Finished(CANCELLED), Usage and status OK"."""

    async def main_() -> tuple[list[str], Any]:
        async with main.aio_channel() as channel:
            generation, control = stubs(channel)
            backlog = _tokenizer_backlog(generation, None, 60, "a" * 32_000)
            await asyncio.sleep(0.05)
            call = generation.GenerateStream(
                greedy_request("abort me while I wait", 8, request_id="hostile-abort-1"),
                timeout=10,
            )
            await asyncio.sleep(0.05)
            aborted = await control.Abort(cpb.AbortRequest(request_ids=["hostile-abort-1"]))
            try:
                outcome: Any = await read_rest(call)
            except grpc.RpcError as exc:
                outcome = exc
            await backlog
            return list(aborted.aborted_ids), outcome

    aborted_ids, outcome = run(main_())
    assert aborted_ids == ["hostile-abort-1"]
    assert not isinstance(outcome, grpc.RpcError), (
        f"the aborted stream ended {outcome.code().name} ({outcome.details()!r}) instead of "
        "Finished(CANCELLED), Usage and OK"
    )
    finished = [r.finished for r in outcome if r.HasField("finished")]
    assert [f.reason for f in finished] == [pb.CANCELLED], outcome
    assert outcome[-1].HasField("usage")


def test_drain_of_a_request_still_being_tokenized_ends_its_stream(
    hostile: ServerProcess,
) -> None:
    """The same hang through Drain: a request waiting for the tokenizer when the grace period
    ends gets no status at all (DEADLINE_EXCEEDED at the client), not ABORTED_BY_SERVER."""

    async def main_() -> tuple[int, Any]:
        async with hostile.aio_channel() as channel:
            generation, control = stubs(channel)
            backlog = _tokenizer_backlog(generation, TENANT, 6, "a" * 1_000_000)
            await asyncio.sleep(0.05)
            # Drain returns once the aborted request leaves the tokenizer queue: a long deadline
            call = generation.GenerateStream(
                greedy_request("drain me while I wait", 8), metadata=TENANT, timeout=30
            )
            await asyncio.sleep(0.05)
            try:
                drained = await control.Drain(
                    cpb.DrainRequest(grace_period_ms=1), metadata=CONTROL, timeout=30
                )
            finally:
                await control.Resume(cpb.ResumeRequest(), metadata=CONTROL, timeout=30)
            try:
                outcome: Any = await read_rest(call)
            except grpc.RpcError as exc:
                outcome = exc
            await backlog
            return drained.aborted, outcome

    aborted, outcome = run(main_())
    assert aborted >= 1
    assert not isinstance(outcome, grpc.RpcError), (
        f"the drained stream ended {outcome.code().name} ({outcome.details()!r}) instead of "
        "Finished(ABORTED_BY_SERVER), Usage and OK"
    )
    finished = [r.finished for r in outcome if r.HasField("finished")]
    assert [f.reason for f in finished] == [pb.ABORTED_BY_SERVER], outcome


def test_an_unauthenticated_60_mib_message_does_not_stall_other_streams(
    hostile: ServerProcess,
) -> None:
    """The bearer-token interceptor rejects a call without a valid token, but its rejecting
    handler keeps the real request deserializer: gRPC parses the whole message on the event
    loop first. A 60 MB GenerateRequest (30M token ids) from a caller with no token froze
    every tenant's streams for 1-3 s, once per message."""
    raw = greedy_request([300] * 30_000_000, 1).SerializeToString()
    assert len(raw) < 64 << 20  # within the server's message limit

    async def main_() -> tuple[float, float, float, Any]:
        async with hostile.aio_channel() as channel:
            generate_stream = channel.unary_stream(
                "/asyncengine.v1.Generation/GenerateStream",
                request_serializer=lambda data: data,
                response_deserializer=pb.GenerateResponse.FromString,
            )

            async def unauthenticated() -> Any:
                return [r async for r in generate_stream(raw, timeout=60)]

            return await worst_gap_during(hostile, TENANT, unauthenticated)

    worst, median, _, outcome = run(main_())
    assert isinstance(outcome, grpc.RpcError), outcome
    assert outcome.code() == grpc.StatusCode.UNAUTHENTICATED, outcome
    assert worst < MAX_STALL_S, (
        f"a tenant's stream went silent for {worst:.2f} s (median gap {median * 1000:.1f} ms) "
        "while a caller without a token sent a 60 MB message"
    )


@pytest.mark.parametrize(
    ("text", "detail"),
    [("a" * 400_000, {}), ("a" * MAX_DETAILED_TOKENIZE_BYTES, {"return_offsets": True})],
    ids=["400k-characters-ids-only", "64KiB-with-offsets"],
)
def test_tokenize_of_a_large_text_does_not_stall_other_streams(
    hostile: ServerProcess, text: str, detail: dict[str, bool]
) -> None:
    """Tokenize ran the tokenizer off the loop but built one pb.Offset per token under the
    GIL: 400,000 characters with return_offsets stalled every other stream for 0.5-1 s on a
    loaded machine (~2 s before the build moved to a thread). Ids alone are built in C; per-
    token detail is bounded (the test below), and the largest text it allows must not stall."""
    request = pb.TokenizeRequest(texts=[text], return_tokens=bool(detail), **detail)

    async def main_() -> tuple[float, float, float, Any]:
        async with hostile.aio_channel() as channel:
            generation, _ = stubs(channel)
            return await worst_gap_during(
                hostile,
                TENANT,
                lambda: generation.Tokenize(request, metadata=TENANT, timeout=60),
            )

    worst, median, _, outcome = run(main_())
    assert not isinstance(outcome, grpc.RpcError), outcome
    (result,) = outcome.results
    assert result.token_count > len(text) // 2
    assert len(result.offsets) == (result.token_count if detail else 0)
    assert worst < MAX_STALL_S, (
        f"another stream went silent for {worst:.2f} s (median gap {median * 1000:.1f} ms) "
        f"while {len(text)} characters were tokenized ({detail or 'ids only'})"
    )


@pytest.mark.parametrize("detail", ["return_offsets", "return_tokens"])
def test_per_token_detail_of_a_text_over_its_bound_is_refused_naming_the_field(
    hostile: ServerProcess, detail: str
) -> None:
    request = pb.TokenizeRequest(
        texts=["a" * (MAX_DETAILED_TOKENIZE_BYTES // 2)] * 2 + ["b"], **{detail: True}
    )
    with pytest.raises(grpc.RpcError) as info:
        stubs(hostile.channel())[0].Tokenize(request, metadata=TENANT, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert bad_field(info.value) == detail
    assert str(MAX_DETAILED_TOKENIZE_BYTES) in (info.value.details() or "")
