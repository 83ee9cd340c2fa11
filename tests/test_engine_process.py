"""AsyncLLMEngine over MPClient: the step loop in its own process, behind the same interface.

The in-process AsyncLLMEngine is the reference: the same requests must give the same outputs
(and greedy ones the transformers tokens); aborts, faults, a killed process, a hung step,
grammars and shutdown must end every stream with its final output or an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import json
import os
import random
import re
import signal
import time
from typing import Any

import msgspec
import pytest
import uvloop

from asyncengine import (
    AsyncLLMEngine,
    DuplicateRequestError,
    EngineArgs,
    EngineDeadError,
    InvalidRequestError,
    SamplingParams,
)
from asyncengine.engine.core_process import CoreFactory
from asyncengine.engine.llm_engine import LLMEngine
from asyncengine.engine.mp_client import MPClient
from asyncengine.errors import RequestFailedError
from asyncengine.outputs import RequestOutput
from asyncengine.sampling_params import RequestOutputKind, StructuredOutputsParams
from asyncengine.testing import fake_engine, hooked_llm_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def engine_args(model_dir, **overrides: Any) -> EngineArgs:
    values = {"model": str(model_dir("llama")), "device": "cpu", "dtype": "float32"}
    return EngineArgs(**(values | overrides))


def process_engine(
    args: EngineArgs, factory: CoreFactory = LLMEngine.from_engine_args, **options: Any
) -> AsyncLLMEngine:
    """An AsyncLLMEngine whose core steps in a child process (one torch thread there)."""
    return AsyncLLMEngine(MPClient(args, factory, torch_threads=1, **options))


def process_of(engine: AsyncLLMEngine) -> Any:
    assert isinstance(engine.core, MPClient)
    return engine.core._process


@pytest.fixture(scope="module")
def engine(model_dir):
    """One engine process for the tests that leave it healthy (each runs its own event loop)."""
    engine = process_engine(engine_args(model_dir, block_size=8, num_gpu_blocks_override=64))
    yield engine
    asyncio.run(engine.shutdown())
    assert not process_of(engine).is_alive()


def _slow_and_refusing(args: EngineArgs) -> Any:
    """The engine of `slow_engine`: 50 ms more per step, and a request "boom..." the engine
    itself refuses (as a bug in queuing it would)."""
    engine = hooked_llm_engine(args, step_delay_s=0.05)
    add = engine.add_validated_request

    def refusing(validated: Any, *args: Any, **kwargs: Any) -> None:
        if validated.request_id.startswith("boom"):
            raise RuntimeError("refused")
        add(validated, *args, **kwargs)

    engine.add_validated_request = refusing
    return engine


@pytest.fixture(scope="module")
def slow_engine(model_dir):
    """Slow steps: the windows between a message and its answer are wide open."""
    engine = process_engine(
        engine_args(model_dir, block_size=8, num_gpu_blocks_override=64), _slow_and_refusing
    )
    yield engine
    asyncio.run(engine.shutdown())


async def collect(engine, prompt, params, request_id: str) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params, request_id=request_id)]


def assert_nothing_left(engine: AsyncLLMEngine) -> None:
    stats = engine.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (0, 0, 0)
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
    assert engine.num_requests == 0


REQUESTS: list[tuple[Any, SamplingParams]] = [
    ("재미있는 이야기 들려줘", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)),
    ([5, 9, 200, 31, 7], SamplingParams(temperature=0.9, seed=3, max_tokens=20)),
    ("the block table", SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12)),
    ("hello", SamplingParams(temperature=0, max_tokens=16, logprobs=3, prompt_logprobs=2)),
    (
        "stop here",
        SamplingParams(
            temperature=0.7,
            seed=5,
            max_tokens=30,
            stop=["e"],
            output_kind=RequestOutputKind.DELTA,
        ),
    ),
    (
        "final only",
        SamplingParams(temperature=0, max_tokens=9, output_kind=RequestOutputKind.FINAL_ONLY),
    ),
]


REQUESTS_BY_ID = {f"r{i}": params for i, (_, params) in enumerate(REQUESTS)}


def test_the_same_outputs_as_in_process_and_greedy_matches_transformers(
    model_dir, engine, hf_greedy
) -> None:
    reference = AsyncLLMEngine.from_engine_args(
        engine_args(model_dir, block_size=8, num_gpu_blocks_override=64)
    )

    async def in_process() -> list[list[RequestOutput]]:
        results = await asyncio.gather(
            *(collect(reference, p, sp, f"r{i}") for i, (p, sp) in enumerate(REQUESTS))
        )
        await reference.shutdown()
        return list(results)

    async def in_child() -> list[list[RequestOutput]]:
        results = await asyncio.gather(
            *(collect(engine, p, sp, f"r{i}") for i, (p, sp) in enumerate(REQUESTS))
        )
        assert_nothing_left(engine)
        return list(results)

    expected, got = asyncio.run(in_process()), asyncio.run(in_child())
    for i, (want, have) in enumerate(zip(expected, got)):
        # how many outputs a reader takes depends on its timing (a pending one is replaced, or
        # merged); what it has read in the end does not, save the timings
        assert have[-1].finished and not any(o.finished for o in have[:-1]), i
        have_result, have_values = split_logprobs(result_of(have))
        want_result, want_values = split_logprobs(result_of(want))
        assert have_result == want_result, f"request {i}"
        assert have_values == pytest.approx(want_values, abs=1e-5), f"request {i}"
    prompt_ids = got[0][-1].prompt_token_ids
    assert got[0][-1].outputs[0].token_ids == hf_greedy(model_dir("llama"), prompt_ids, 24)


def split_logprobs(output: RequestOutput) -> tuple[RequestOutput, list[float]]:
    """`output` with its logprob values (and each sample's running sum of them) set to 0, and
    the values in order. A row's values differ in their last bits with the batch it ran in (a
    product of few rows runs another kernel than one of many), and the batches are the step
    loop's timing, not the request's."""
    output = copy.deepcopy(output)
    values: list[float] = []
    for entries in [output.prompt_logprobs or [], *(c.logprobs or [] for c in output.outputs)]:
        for entry in entries:
            for logprob in (entry or {}).values():
                values.append(logprob.logprob)
                logprob.logprob = 0.0
    for completion in output.outputs:
        if completion.cumulative_logprob is not None:
            values.append(completion.cumulative_logprob)
            completion.cumulative_logprob = 0.0
    return output, values


def result_of(outputs: list[RequestOutput]) -> RequestOutput:
    """What a reader has at the end: the last output, or every DELTA output merged into one."""
    result = copy.deepcopy(outputs[0])
    for later in outputs[1:]:
        if REQUESTS_BY_ID[later.request_id].output_kind is RequestOutputKind.DELTA:
            result.extend(copy.deepcopy(later))
        else:
            result = copy.deepcopy(later)
    result.metrics = None
    return result


def test_a_third_cancelled_mid_stream_and_every_block_comes_back(engine) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(2, 30))] for _ in range(60)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    async def consume(i: int) -> int:
        count = 0
        async for out in engine.generate(prompts[i], params, request_id=f"c{i}"):
            count = len(out.outputs[0].token_ids)
            if i % 3 == 0 and count >= i % 5:
                break  # leaving the loop aborts it
        return count

    async def main() -> list[int]:
        tasks = [asyncio.create_task(consume(i)) for i in range(60)]
        await asyncio.sleep(0.01)
        for task in tasks[1::7]:
            task.cancel()  # some while still queued
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.05)  # the generators' finalizers run, the aborts come back
        await engine.abort([])  # one round trip: every abort sent before it is done
        assert_nothing_left(engine)
        return [r for r in results if isinstance(r, int)]

    counts = asyncio.run(main())
    assert counts.count(16) >= 30


def test_abort_returns_with_the_blocks_free_and_the_id_can_be_used_again(engine) -> None:
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main() -> None:
        stream = await engine.add_request("again", "a long one", params)
        first = await stream.get()
        assert first is not None and not first.finished
        assert engine.request_phase("again") in ("queued", "prefill", "decode")
        assert await engine.abort("again") == ["again"]
        assert_nothing_left(engine)
        final = None
        while final is None or not final.finished:
            final = await stream.get()
        assert final.outputs[0].finish_reason == "abort"
        with pytest.raises(DuplicateRequestError):
            stream2 = await engine.add_request("twice", "x", params)
            await engine.add_request("twice", "y", params)
        await engine.abort("twice")
        del stream2
        # the id is free at once after its abort
        outs = await collect(engine, "a long one", SamplingParams(max_tokens=3), "again")
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
        assert_nothing_left(engine)

    asyncio.run(main())


def test_bad_input_is_refused_before_the_child_sees_it(engine) -> None:
    async def main() -> None:
        with pytest.raises(InvalidRequestError, match="empty"):
            await collect(engine, "", SamplingParams(max_tokens=2), "empty")
        with pytest.raises(InvalidRequestError) as info:
            await collect(engine, [10**6], SamplingParams(max_tokens=2), "oov")
        assert info.value.field == "prompt"
        bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed"))
        with pytest.raises(InvalidRequestError) as info:
            await collect(engine, "x", bad, "bad-regex")
        assert "compile" in str(info.value)
        assert_nothing_left(engine)

    asyncio.run(main())


def test_structured_outputs_compile_in_the_child_and_abort_while_compiling(engine) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    constrained = SamplingParams(
        temperature=0.8,
        seed=1,
        max_tokens=60,
        structured_outputs=StructuredOutputsParams(json=json.dumps(schema)),
    )

    async def main() -> None:
        outs = await collect(engine, "json please", constrained, "json")
        final = outs[-1].outputs[0]
        if final.finish_reason == "stop":  # the grammar ended it: it parses
            assert isinstance(json.loads(final.text)["n"], int)
        # aborted while its grammar compiles (a new schema is not in the cache)
        other = SamplingParams(
            max_tokens=8,
            structured_outputs=StructuredOutputsParams(regex="[a-z]{3,7}[0-9]{2}"),
        )
        task = asyncio.create_task(collect(engine, "regex", other, "compiling"))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        await engine.abort("compiling")
        result = await task
        assert result[-1].finished and result[-1].outputs[0].finish_reason == "abort"
        await engine.abort([])
        assert_nothing_left(engine)

    asyncio.run(main())


def test_a_caller_leaving_while_its_grammar_compiles_leaves_nothing_running(slow_engine) -> None:
    engine = slow_engine
    params = SamplingParams(
        max_tokens=200,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(regex="[a-z]{1,300}"),
    )

    async def main() -> None:
        busy = asyncio.create_task(
            collect(engine, "busy", SamplingParams(max_tokens=6, ignore_eos=True), "busy")
        )
        await asyncio.sleep(0.1)
        adding = asyncio.create_task(engine.add_request("X", "hello", params))
        await asyncio.sleep(0.02)  # sent; the child answers after its step
        adding.cancel()
        with pytest.raises(asyncio.CancelledError):
            await adding
        await busy
        # the id is free, and the first request is gone from the child too
        outs = await asyncio.wait_for(
            collect(engine, "again", SamplingParams(max_tokens=3, ignore_eos=True), "X"), 20
        )
        assert outs[-1].outputs[0].finish_reason == "length"
        await engine.abort([])
        assert_nothing_left(engine)

    asyncio.run(main())


def test_an_id_aborted_used_and_aborted_again_gives_each_stream_its_own_final(
    slow_engine,
) -> None:
    engine = slow_engine
    params = SamplingParams(max_tokens=100, ignore_eos=True)

    async def final(stream) -> RequestOutput:
        out = await stream.get()
        while not out.finished:
            out = await stream.get()
        return out

    async def main() -> None:
        first = await engine.add_request("Y", "the first prompt here", params)
        while (await first.get()).outputs[0].token_ids == []:
            pass
        aborting = asyncio.create_task(engine.abort("Y"))
        await asyncio.sleep(0)  # the abort is sent, its answer not back
        second = await engine.add_request("Y", "2nd", params)  # before the child answers
        assert await engine.abort("Y") == ["Y"]
        await aborting
        one = await asyncio.wait_for(final(first), 20)
        two = await asyncio.wait_for(final(second), 20)
        # each its own: the second's final is of the request that arrived second
        assert one.metrics.arrival_time < two.metrics.arrival_time
        assert one.metrics.num_output_tokens >= 1
        assert one.outputs[0].finish_reason == two.outputs[0].finish_reason == "abort"
        assert_nothing_left(engine)

    asyncio.run(main())


def test_abort_returns_only_what_it_aborted(slow_engine) -> None:
    """A request the child finishes in the step it is running when the abort arrives was not
    aborted: abort() leaves it out (a drain reports how many it cut off)."""
    engine = slow_engine
    params = SamplingParams(max_tokens=2, ignore_eos=True)

    async def main() -> None:
        stream = await engine.add_request("last-step", "short", params)
        first = await stream.get()
        assert first is not None and not first.finished
        # its last step runs now (50 ms): 10 ms into it, the abort reaches the child after it
        await asyncio.sleep(0.01)
        assert await engine.abort("last-step") == []
        final = await stream.get()
        assert final is not None and final.finished
        assert final.outputs[0].finish_reason == "length"
        assert_nothing_left(engine)

    asyncio.run(main())


def test_a_request_the_child_cannot_queue_fails_alone(slow_engine) -> None:
    engine = slow_engine
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    async def main() -> None:
        ok = asyncio.create_task(collect(engine, "fine", params, "fine"))
        with pytest.raises(RequestFailedError):
            await asyncio.wait_for(collect(engine, "bad", params, "boom-1"), 20)
        assert (await ok)[-1].finished
        assert not engine.errored
        assert_nothing_left(engine)

    asyncio.run(main())


def _kill_soon(engine: AsyncLLMEngine) -> None:
    os.kill(process_of(engine).pid, signal.SIGKILL)


@pytest.mark.parametrize("how", ["killed", "step fault", "hung step"])
def test_a_dead_engine_process_ends_every_stream(model_dir, how) -> None:
    factory: Any = functools.partial(hooked_llm_engine, step_delay_s=0.01)  # still running
    if how == "step fault":
        factory = functools.partial(hooked_llm_engine, fault_at=6)
    elif how == "hung step":
        factory = functools.partial(hooked_llm_engine, step_delay_s=0.05, fault_at=None)
    engine = process_engine(
        engine_args(model_dir), factory, step_timeout_s=0.5 if how != "hung step" else 0.02
    )
    params = SamplingParams(max_tokens=400, ignore_eos=True)

    async def main() -> None:
        tasks = [
            asyncio.create_task(collect(engine, f"prompt {i}", params, f"d{i}")) for i in range(4)
        ]
        if how == "killed":
            await asyncio.sleep(0.3)
            _kill_soon(engine)
        started = time.monotonic()
        done, pending = await asyncio.wait(tasks, timeout=20)
        assert not pending, f"streams still open {time.monotonic() - started:.1f}s after"
        for task in done:
            assert isinstance(task.exception(), EngineDeadError), task.exception()
        assert engine.errored
        with pytest.raises(EngineDeadError):
            await collect(engine, "late", params, "late")
        await engine.shutdown()

    asyncio.run(main())
    assert not process_of(engine).is_alive()


def test_a_bad_setting_or_a_failed_start_raises_what_it_would_in_process(model_dir) -> None:
    with pytest.raises(ValueError, match="device"):
        process_engine(engine_args(model_dir, device="nonsense"))
    # the child's own start-up error, re-raised here as itself
    with pytest.raises(ValueError, match="block"):
        process_engine(engine_args(model_dir), functools.partial(_fails_to_start))


def _fails_to_start(args: EngineArgs) -> Any:
    raise ValueError("no block for you")


# -- the channel: any size, any burst, under uvloop (as `serve` runs) --------------------------


def test_a_message_of_any_size_goes_through(engine) -> None:
    """generation.proto's largest choice (256 strings of 1,024 characters): the pipe before
    the ZMQ channel died on any message its socket buffer could not take at once (uvloop
    leaves the fd non-blocking)."""
    choices = [f"{i:04d}" * 256 for i in range(256)]
    constrained = SamplingParams(
        max_tokens=4, structured_outputs=StructuredOutputsParams(choice=choices)
    )

    async def main() -> None:
        outs = await collect(engine, "pick one", constrained, "choice")
        text = outs[-1].outputs[0].text
        assert text and any(choice.startswith(text) for choice in choices), text
        assert_nothing_left(engine)

    uvloop.run(main())
    assert not engine.errored


def test_a_60_mib_request_goes_through(model_dir) -> None:
    """A prompt of 20 M token ids (60 MiB on the channel) in a context that holds it."""
    num_tokens = 20_000_000
    model = model_dir("llama", max_position_embeddings=1 << 25)
    args = engine_args(
        model_dir,
        model=str(model),
        block_size=1024,
        num_gpu_blocks_override=(num_tokens >> 10) * 11 // 10,
        max_num_batched_tokens=1 << 25,
        enable_prefix_caching=False,
    )
    engine = process_engine(args, functools.partial(hooked_llm_engine, fake_runner=True))
    prompt = [200 + i % 300 for i in range(num_tokens)]  # 3 bytes each in msgpack

    async def main() -> RequestOutput:
        outs = await collect(engine, prompt, SamplingParams(max_tokens=2, ignore_eos=True), "big")
        assert_nothing_left(engine)
        return outs[-1]

    try:
        final = uvloop.run(main())
        assert len(final.prompt_token_ids) == num_tokens
        assert len(final.outputs[0].token_ids) == 2
        assert not engine.errored
    finally:
        asyncio.run(engine.shutdown())


def test_a_burst_of_a_thousand_long_prompts_is_served(model_dir) -> None:
    """1,000 prompts of 1,000 token ids at once (what admission lets in): the engine lives and
    every one finishes."""
    args = engine_args(model_dir, max_model_len=2048, num_gpu_blocks_override=1 << 17)
    engine = process_engine(args, functools.partial(hooked_llm_engine, fake_runner=True))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(1000)] for _ in range(1000)]
    params = SamplingParams(max_tokens=2, ignore_eos=True)

    async def main() -> list[list[RequestOutput]]:
        results = await asyncio.gather(
            *(collect(engine, p, params, f"b{i}") for i, p in enumerate(prompts))
        )
        assert_nothing_left(engine)
        return list(results)

    try:
        results = uvloop.run(main())
        assert all(len(outs[-1].outputs[0].token_ids) == 2 for outs in results)
        assert not engine.errored
    finally:
        asyncio.run(engine.shutdown())


def test_a_busy_front_gets_every_token_in_order_in_fewer_messages_than_steps(model_dir) -> None:
    """While the front's event loop is blocked, the engine process steps on and gathers its
    steps into one message: every stream still gets all its tokens, in order, and one final,
    as the in-process engine gives them."""
    args = engine_args(model_dir, block_size=8, num_gpu_blocks_override=256)
    prompts = [[5 + i, 9, 200, 31] for i in range(8)]
    params = SamplingParams(max_tokens=40, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def run(engine: AsyncLLMEngine, is_front_busy: bool) -> list[list[RequestOutput]]:
        calls = [collect(engine, p, params, f"q{i}") for i, p in enumerate(prompts)]
        tasks = [asyncio.create_task(call) for call in calls]
        if is_front_busy:
            client = engine.core
            assert isinstance(client, MPClient)
            while client.num_steps == 0 and not any(task.done() for task in tasks):
                await asyncio.sleep(0.001)
            time.sleep(0.5)  # the loop blocked: the engine's remaining steps take ~0.1 s
        results = await asyncio.gather(*tasks)
        assert_nothing_left(engine)
        return list(results)

    expected = uvloop.run(run(fake_engine(args), is_front_busy=False))
    factory = functools.partial(hooked_llm_engine, fake_runner=True, step_delay_s=0.002)
    engine = process_engine(args, factory)
    try:
        results = uvloop.run(run(engine, is_front_busy=True))
        client = engine.core
        assert isinstance(client, MPClient)
        assert client.num_step_messages < client.num_steps
    finally:
        asyncio.run(engine.shutdown())
    for outs, want in zip(results, expected, strict=True):
        assert [out.finished for out in outs] == [False] * (len(outs) - 1) + [True]
        tokens = [t for out in outs for t in out.outputs[0].token_ids]
        assert tokens == [t for out in want for t in out.outputs[0].token_ids]
        assert len(tokens) == 40
        assert "".join(out.outputs[0].text for out in outs) == "".join(
            out.outputs[0].text for out in want
        )
        assert outs[-1].outputs[0].finish_reason == "length"


def _late_to_read(args: EngineArgs) -> Any:
    """Scripted tokens; the engine process starts its loop (and its reader) 1.5 s after it
    says Ready, as a loaded machine schedules it late."""
    from asyncengine.engine import core_process

    init = core_process._Core.__init__

    def late_init(self: Any, *args: Any, **kwargs: Any) -> None:
        time.sleep(1.5)
        init(self, *args, **kwargs)

    core_process._Core.__init__ = late_init  # type: ignore[method-assign]
    return hooked_llm_engine(args, fake_runner=True)


def test_a_request_sent_the_moment_the_engine_is_ready_waits_for_it(model_dir) -> None:
    """The parent sends its first request before the engine process reads: it waits in the
    channel, and is served (it was "the engine is dead": no peer took the message yet)."""
    args = engine_args(model_dir, block_size=8, num_gpu_blocks_override=64)
    engine = process_engine(args, _late_to_read)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    try:
        started = time.monotonic()
        outs = uvloop.run(collect(engine, [5, 9, 200, 31], params, "first"))
        waited_s = time.monotonic() - started
        assert_nothing_left(engine)
    finally:
        asyncio.run(engine.shutdown())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert len(outs[-1].outputs[0].token_ids) == 6
    assert waited_s > 0.5  # it was sent while the engine process was not reading yet


# -- liveness: a heartbeat, not the steps, says the engine process is alive ----------------------


def _one_long_step(args: EngineArgs) -> Any:
    """Scripted tokens; the first step holds the GIL in Python for 3 s (a long CPU-bound
    prefill at its worst for a heartbeat thread), the later ones take 10 ms each."""
    engine = hooked_llm_engine(args, fake_runner=True, step_delay_s=0.01)
    execute, num_steps = engine.execute, 0

    def execute_slowly_once(plan: Any) -> Any:
        nonlocal num_steps
        num_steps += 1
        if num_steps == 1:
            until = time.monotonic() + 3.0
            while time.monotonic() < until:
                pass
        return execute(plan)

    engine.execute = execute_slowly_once
    return engine


def test_a_frozen_engine_is_dead_within_the_heartbeat_deadline_and_a_long_step_is_not(
    model_dir,
) -> None:
    deadline_s = 1.5
    engine = process_engine(engine_args(model_dir), _one_long_step, heartbeat_timeout_s=deadline_s)

    async def main() -> float:
        # a step twice as long as the deadline: the heartbeat goes on beside it
        outs = await collect(engine, "long", SamplingParams(max_tokens=3, ignore_eos=True), "l")
        assert outs[-1].finished and not engine.errored
        params = SamplingParams(max_tokens=2000, ignore_eos=True)
        tasks = [asyncio.create_task(collect(engine, "x", params, f"f{i}")) for i in range(4)]
        await asyncio.sleep(0.3)
        os.kill(process_of(engine).pid, signal.SIGSTOP)  # frozen, not dead
        stopped = time.monotonic()
        done, pending = await asyncio.wait(tasks, timeout=10 * deadline_s)
        detected_s = time.monotonic() - stopped
        assert not pending, "streams still open: the frozen engine was not noticed"
        for task in done:
            assert isinstance(task.exception(), EngineDeadError), task.exception()
        assert engine.errored
        await engine.shutdown()
        return detected_s

    try:
        detected_s = asyncio.run(main())
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process_of(engine).pid, signal.SIGKILL)
    assert deadline_s <= detected_s < deadline_s + 2.0
    assert not process_of(engine).is_alive()


def _slow_grammars(args: EngineArgs) -> LLMEngine:
    """An engine whose grammars take 1 s more to compile: wide open to an abort."""
    engine = LLMEngine.from_engine_args(args)
    compile_now = engine.validator.check_structured_outputs

    def compile_slowly(params: SamplingParams) -> Any:
        time.sleep(1.0)
        return compile_now(params)

    engine.validator.check_structured_outputs = compile_slowly  # type: ignore[method-assign]
    return engine


@pytest.mark.parametrize("where", ["in-process", "engine process"])
def test_an_id_aborted_while_compiling_and_reused_at_once_runs_only_the_new_request(
    model_dir, where
) -> None:
    """Both core clients: the abort counts the compiling request, its compile is dropped when
    it ends, and the id's next request (compiling too) is the only one that runs."""
    args = engine_args(model_dir, block_size=8, num_gpu_blocks_override=64)
    if where == "in-process":
        engine = AsyncLLMEngine(_slow_grammars(args))
    else:
        engine = process_engine(args, _slow_grammars)

    def constrained(regex: str) -> SamplingParams:
        return SamplingParams(
            max_tokens=12, structured_outputs=StructuredOutputsParams(regex=regex)
        )

    async def main() -> None:
        first = asyncio.create_task(collect(engine, "a", constrained("[a-c]{2,9}x{3}"), "Z"))
        await asyncio.sleep(0.3)  # queued, its grammar compiling
        assert await engine.abort("Z") == ["Z"]
        outs = await collect(engine, "b", constrained("[0-4]{3,8}"), "Z")
        assert re.fullmatch("[0-4]{0,8}", outs[-1].outputs[0].text), outs[-1].outputs[0].text
        assert (await first)[-1].outputs[0].finish_reason == "abort"
        await asyncio.sleep(1.2)  # the first compile has ended: it must not run now
        assert engine.num_requests == 0 and engine.get_stats().num_running == 0
        assert_nothing_left(engine)

    try:
        asyncio.run(main())
        assert not engine.errored
    finally:
        asyncio.run(engine.shutdown())


def test_a_message_the_engine_process_cannot_decode_fails_only_its_request(engine) -> None:
    """A request whose AddRequest does not decode in the child (here: its sampling params
    turned into a string on the wire) fails alone; the engine and the other request go on."""
    client = engine.core
    assert isinstance(client, MPClient)
    encoder = client._encoder

    class Corrupting:
        def encode(self, message: Any) -> bytes:
            if getattr(message, "request_id", None) != "garbled":
                return encoder.encode(message)
            raw = msgspec.msgpack.decode(encoder.encode(message))
            raw[2]["sampling_params"] = "not a SamplingParams"
            return msgspec.msgpack.encode(raw)

    params = SamplingParams(max_tokens=4, ignore_eos=True)

    async def main() -> None:
        client._encoder = Corrupting()  # type: ignore[assignment]
        try:
            fine = asyncio.create_task(collect(engine, "fine", params, "fine"))
            with pytest.raises(RequestFailedError):
                await asyncio.wait_for(collect(engine, "bad", params, "garbled"), 20)
            assert len((await fine)[-1].outputs[0].token_ids) == 4
        finally:
            client._encoder = encoder
        assert not engine.errored
        assert_nothing_left(engine)

    asyncio.run(main())
