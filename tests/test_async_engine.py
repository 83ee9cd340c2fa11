"""AsyncLLMEngine: concurrent streams, cancellation in every state, errors, slow consumers."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import uvloop
from structlog.testing import capture_logs

from asyncengine import (
    LLM,
    AsyncLLMEngine,
    DuplicateRequestError,
    EngineArgs,
    EngineDeadError,
    InvalidRequestError,
    SamplingParams,
)
from asyncengine.core.request import RequestStatus
from asyncengine.engine.llm_engine import LLMEngine
from asyncengine.errors import RequestFailedError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KOREAN_PROMPTS = ["재미있는 이야기 들려줘", "양자역학 설명해줄래?", "봄에 관한 시를 써줄래?"]


def run(main: Callable[[], Awaitable[Any]], use_uvloop: bool = False) -> Any:
    return uvloop.run(main()) if use_uvloop else asyncio.run(main())


def make_engine(model_dir, **overrides: Any) -> AsyncLLMEngine:
    args = EngineArgs(model=str(model_dir), device="cpu", dtype="float32", **overrides)
    return AsyncLLMEngine.from_engine_args(args)


async def collect(engine: AsyncLLMEngine, prompt, params, request_id: str) -> list[Any]:
    return [out async for out in engine.generate(prompt, params, request_id=request_id)]


def assert_nothing_left(engine: AsyncLLMEngine) -> None:
    stats = engine.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (0, 0, 0)
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
    assert stats.num_free_cpu_blocks == stats.num_cpu_blocks
    engine.engine.block_manager.check_invariants()
    assert not engine.engine.has_unfinished_requests()


@pytest.mark.parametrize("use_uvloop", [False, True])
def test_three_korean_prompts_stream_concurrently_and_match_llm(model_dir, use_uvloop) -> None:
    path = model_dir("llama")
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=7)
    expected = [
        o.outputs[0].text
        for o in LLM(model=str(path), device="cpu", dtype="float32").generate(
            KOREAN_PROMPTS, params, use_tqdm=False
        )
    ]
    engine = make_engine(path)
    in_flight_together = []

    async def generate_stream(prompt: str) -> str:
        text, num_deltas = "", 0
        async for out in engine.generate(prompt, params, request_id=f"req-{hash(prompt)}"):
            in_flight_together.append(engine.get_stats().num_running)
            assert out.outputs[0].text.startswith(text)
            text = out.outputs[0].text
            num_deltas += 1
        assert out.finished and num_deltas > 1
        return text

    async def main() -> list[str]:
        texts = await asyncio.gather(*(generate_stream(p) for p in KOREAN_PROMPTS))
        assert_nothing_left(engine)
        await engine.shutdown()
        return list(texts)

    assert run(main, use_uvloop) == expected
    assert max(in_flight_together) == 3  # the streams really shared steps


def test_200_streams_with_a_third_cancelled_in_every_state(model_dir) -> None:
    path = model_dir("llama")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(2, 40))] for _ in range(200)]
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randint(4, 24), ignore_eos=True)
        for _ in range(200)
    ]
    reference = LLM(model=str(path), device="cpu", dtype="float32").generate(
        prompts, params, use_tqdm=False
    )
    engine = make_engine(
        path,
        block_size=8,
        num_gpu_blocks_override=48,
        num_cpu_blocks_override=400,
        preemption_mode="swap",
        max_num_seqs=64,
    )
    # a third is cancelled: while waiting, while swapped out, or by the reader leaving mid-stream
    chosen = rng.sample(range(200), 66)
    cancel_ids = set(chosen)
    when = dict.fromkeys(chosen[:22], RequestStatus.WAITING)
    when |= dict.fromkeys(chosen[22:44], RequestStatus.SWAPPED)
    cancelled_in: dict[str, RequestStatus] = {}

    async def consume(i: int) -> list[int] | None:
        request_id = f"r{i}"
        stop_after = rng.randint(0, 3) if i in chosen[44:] else None
        received = 0
        out = None
        async for out in engine.generate(prompts[i], params[i], request_id=request_id):  # noqa: B007
            received += 1
            if stop_after is not None and received > stop_after:
                cancelled_in.setdefault(request_id, RequestStatus.RUNNING)
                break  # leaving the loop aborts the request
        return None if i in cancel_ids else out.outputs[0].token_ids

    async def cancel_waiting_and_swapped(tasks: dict[str, asyncio.Task]) -> None:
        # cancel some of the chosen requests while they sit in the waiting or swapped queue
        # (with preemption_mode="swap", a preempted request is a swapped one)
        phases = {"queued": RequestStatus.WAITING, "preempted": RequestStatus.SWAPPED}
        while any(not t.done() for t in tasks.values()):
            for i, status in when.items():
                request_id, task = f"r{i}", tasks[f"r{i}"]
                phase = engine.request_phase(request_id)
                if phase in phases and phases[phase] is status and not task.done():
                    cancelled_in.setdefault(request_id, status)
                    task.cancel()
            # a real pause, not sleep(0): a loop that never blocks keeps the GIL from the
            # engine's worker thread, and every step then crawls
            await asyncio.sleep(0.002)

    async def main() -> list[Any]:
        tasks = {f"r{i}": asyncio.create_task(consume(i)) for i in range(200)}
        await cancel_waiting_and_swapped(tasks)
        results = await asyncio.gather(*tasks.values(), return_exceptions=True)
        # a `break` leaves the generator to the loop's finalizer, which closes it next tick
        await asyncio.sleep(0.05)
        assert_nothing_left(engine)
        await engine.shutdown()
        return results

    results = run(main)
    for i, result in enumerate(results):
        if i in cancel_ids:
            assert result is None or isinstance(result, asyncio.CancelledError)
        else:
            assert result == reference[i].outputs[0].token_ids, f"request {i}"
    states = set(cancelled_in.values())
    assert {RequestStatus.WAITING, RequestStatus.SWAPPED, RequestStatus.RUNNING} <= states
    assert engine.get_stats().num_preemptions_swap > 0


def test_engine_fault_ends_every_stream_with_engine_dead_error(model_dir) -> None:
    engine = make_engine(model_dir("llama"))
    real_execute = engine.engine.execute
    num_steps = 0
    fault_at = 0.0

    def failing_execute(plan):
        nonlocal num_steps, fault_at
        num_steps += 1
        if num_steps == 5:
            fault_at = time.monotonic()
            raise RuntimeError("injected fault")
        return real_execute(plan)

    engine.engine.execute = failing_execute  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=50, ignore_eos=True)

    async def main() -> None:
        streams = [
            asyncio.create_task(collect(engine, p, params, f"f{i}"))
            for i, p in enumerate(KOREAN_PROMPTS)
        ]
        done, pending = await asyncio.wait(streams, timeout=10.0)
        assert not pending
        assert time.monotonic() - fault_at < 1.0
        for task in done:
            error = task.exception()
            assert isinstance(error, EngineDeadError)
            assert isinstance(error.__cause__, RuntimeError)
            # every stream gets the same words: a cause may carry one request's values
            assert "injected fault" not in str(error)
        assert engine.errored and not engine.is_running
        with pytest.raises(EngineDeadError):
            engine.check_health()
        with pytest.raises(EngineDeadError):
            await collect(engine, "again", params, "late")
        await engine.shutdown()
        assert asyncio.all_tasks() == {asyncio.current_task()}

    run(main)


def test_bad_requests_fail_alone(model_dir) -> None:
    engine = make_engine(
        model_dir("llama"),
        max_model_len=64,
        num_gpu_blocks_override=6,
        block_size=8,
        max_num_seqs=4,
    )
    good = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def main() -> None:
        ok = asyncio.create_task(collect(engine, KOREAN_PROMPTS[0], good, "ok"))
        with pytest.raises(InvalidRequestError, match="max_model_len"):
            await collect(engine, list(range(3, 90)), good, "too-long")
        with pytest.raises(InvalidRequestError, match="KV cache"):
            await collect(engine, list(range(3, 60)), good, "never-fits")
        with pytest.raises(InvalidRequestError, match="empty"):
            await collect(engine, "", good, "empty")
        with pytest.raises(InvalidRequestError, match=r"n: is 5, more than max_num_seqs \(4\)"):
            await collect(engine, "hi", SamplingParams(n=5, max_tokens=4), "too-many-samples")
        first = engine.generate(KOREAN_PROMPTS[1], good, request_id="dup")
        await first.__anext__()
        with pytest.raises(DuplicateRequestError):
            await collect(engine, KOREAN_PROMPTS[2], good, "dup")
        await first.aclose()
        outputs = await ok
        assert len(outputs[-1].outputs[0].token_ids) == 8
        assert await engine.abort("unknown-id") == []  # a no-op
        assert await engine.abort(["ok"]) == []  # finished already: a no-op
        assert_nothing_left(engine)
        await engine.shutdown()

    run(main)


def test_slow_consumer_gets_every_token_without_slowing_the_others(model_dir) -> None:
    engine = make_engine(model_dir("llama"))
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    reference = LLM(model=str(model_dir("llama")), device="cpu", dtype="float32").generate(
        KOREAN_PROMPTS, params, use_tqdm=False
    )

    async def consume(i: int, delay: float) -> tuple[list[int], int, float]:
        started, num_reads = time.monotonic(), 0
        async for out in engine.generate(KOREAN_PROMPTS[i], params, request_id=f"s{i}"):  # noqa: B007
            num_reads += 1
            await asyncio.sleep(delay)
        return out.outputs[0].token_ids, num_reads, time.monotonic() - started

    async def main() -> list[tuple[list[int], int, float]]:
        results = await asyncio.gather(consume(0, 0.05), consume(1, 0.0), consume(2, 0.0))
        await engine.shutdown()
        return list(results)

    results = run(main)
    for (tokens, _, _), ref in zip(results, reference):
        assert tokens == ref.outputs[0].token_ids
    (_, slow_reads, slow_s), (_, fast_reads, fast_s) = results[0], results[1]
    assert slow_reads < fast_reads  # the slow reader's outputs were merged, not queued
    print(
        f"\nslow consumer: {slow_reads} reads in {slow_s:.2f}s; "
        f"fast consumer: {fast_reads} reads in {fast_s:.2f}s"
    )


def test_a_block_still_held_when_the_engine_goes_idle_is_reported(model_dir) -> None:
    engine = make_engine(model_dir("llama"), num_gpu_blocks_override=32)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def run_one_and_go_idle(request_id: str) -> None:
        await collect(engine, "hello", params, request_id)
        for _ in range(10):  # the loop checks once it finds nothing left to do
            await asyncio.sleep(0)

    async def main() -> list[dict[str, Any]]:
        with capture_logs() as clean:
            await run_one_and_go_idle("clean")
        assert not [e for e in clean if e["event"] == "kv_blocks_leaked"]
        engine.engine.block_manager.gpu_pool.allocate()  # a bookkeeping bug, simulated
        with capture_logs() as leaky:
            await run_one_and_go_idle("leaky")
        await engine.shutdown()
        return [e for e in leaky if e["event"] == "kv_blocks_leaked"]

    (leak,) = run(main)
    assert leak["log_level"] == "error"
    assert (leak["gpu_blocks"], leak["cpu_blocks"]) == (1, 0)


def test_a_failure_of_one_request_ends_it_alone(model_dir, monkeypatch) -> None:
    """Its sampling row or its detokenizing raising ends that request; the loop goes on."""
    from asyncengine.engine import output_processor
    from asyncengine.worker import sampler

    engine = make_engine(model_dir("llama"))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    poisoned_bias = SamplingParams(temperature=0, max_tokens=12, logit_bias={7: 1.0})
    apply_row, on_token = sampler.apply_penalties_and_masks, output_processor.RequestState.on_token

    def failing_row(logits, req) -> None:
        if req.sampling_params.logit_bias:
            raise IndexError("a bug in this request's row")
        apply_row(logits, req)

    def failing_text(self, req, logprobs, finish) -> None:
        if self.request_id == "bad-text" and req.num_output_tokens == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a bug in this request's text")
        on_token(self, req, logprobs, finish)

    monkeypatch.setattr(sampler, "apply_penalties_and_masks", failing_row)
    monkeypatch.setattr(output_processor.RequestState, "on_token", failing_text)
    expected = LLM(model=str(model_dir("llama")), device="cpu", dtype="float32").generate(
        KOREAN_PROMPTS[0], params, use_tqdm=False
    )[0]

    async def main() -> list[Any]:
        with capture_logs() as logs:
            results = await asyncio.gather(
                collect(engine, KOREAN_PROMPTS[0], params, "good"),
                collect(engine, KOREAN_PROMPTS[1], poisoned_bias, "bad-row"),
                collect(engine, KOREAN_PROMPTS[2], params, "bad-text"),
                return_exceptions=True,
            )
        assert engine.is_running and not engine.errored
        assert_nothing_left(engine)
        await engine.shutdown()
        return [results, [e for e in logs if e["event"] == "request_failed"]]

    (good, bad_row, bad_text), failures = run(main)
    assert good[-1].outputs[0].token_ids == expected.outputs[0].token_ids
    for error in (bad_row, bad_text):
        assert isinstance(error, RequestFailedError), error
        assert "a bug" not in str(error)  # the cause is logged, not sent
    assert {f["request_id"] for f in failures} == {"bad-row", "bad-text"}


def test_the_engine_serves_a_second_event_loop_and_ends_quietly(model_dir) -> None:
    """A script's asyncio.run ending is no engine failure; the next asyncio.run works."""
    engine = make_engine(model_dir("llama"))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with capture_logs() as logs:
        first = run(lambda: collect(engine, "hello", params, "first"))
        second = run(lambda: collect(engine, "hello", params, "second"))
    assert first[-1].outputs[0].token_ids == second[-1].outputs[0].token_ids
    assert not [e for e in logs if e["log_level"] in ("error", "critical")], logs
    assert not engine.errored


def hold_steps(engine: AsyncLLMEngine) -> tuple[threading.Event, threading.Event]:
    """(go, entered): each step of `engine`'s forward sets `entered`, then waits for `go`."""
    go, entered = threading.Event(), threading.Event()
    core = engine.engine
    execute = core.execute

    def held_execute(plan: Any) -> Any:
        entered.set()
        go.wait(10)
        return execute(plan)

    core.execute = held_execute  # type: ignore[method-assign]
    return go, entered


def test_a_step_past_step_timeout_s_ends_its_streams_with_the_engine_dead(model_dir) -> None:
    args = EngineArgs(model=str(model_dir("llama")), device="cpu", dtype="float32")
    engine = AsyncLLMEngine(LLMEngine.from_engine_args(args), step_timeout_s=0.2)
    go, _ = hold_steps(engine)

    async def main() -> BaseException:
        with pytest.raises(EngineDeadError) as error:
            await collect(engine, [5, 6], SamplingParams(max_tokens=2), "slow")
        go.set()
        return error.value

    error = run(main)
    assert engine.errored
    assert "a step took longer than 0.2 s" in repr(error.__cause__), repr(error)


def test_shutdown_stops_the_step_loop_when_the_step_in_flight_ends_with_its_cancel(
    model_dir,
) -> None:
    """The step's result and shutdown's cancel of the step loop reach the event loop in the
    same turn. asyncio.wait_for took the finished step over the cancel (Python 3.11); the
    step loop went back to waiting for work, and shutdown waited for it forever (seen in the
    suite as a server stop that never returned)."""
    engine = make_engine(model_dir("llama"))
    go, entered = hold_steps(engine)

    async def main() -> None:
        await engine.add_request("only", [5, 6], SamplingParams(max_tokens=1))
        assert await asyncio.to_thread(entered.wait, 10), "the step never started"
        go.set()
        # the loop held: the step ends meanwhile, and its result waits in the loop's queue
        # ahead of the cancel that shutdown is about to make
        time.sleep(0.5)
        async with asyncio.timeout(10):
            await engine.shutdown()

    run(main)


def test_a_second_running_loop_is_refused_and_the_first_goes_on(model_dir) -> None:
    """An engine serves one event loop at a time. A call from another thread's loop while
    the first runs is a clear error; before, it took the engine over: the first loop's
    requests were aborted and the second's never got an output."""
    engine = make_engine(model_dir("llama"))
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    errors: list[BaseException] = []

    def other_thread() -> None:
        try:
            other = collect(engine, "hi", SamplingParams(max_tokens=2), "other")
            run(lambda: asyncio.wait_for(other, 10))
        except BaseException as exc:
            errors.append(exc)

    async def main() -> list[Any]:
        outputs = []
        async for out in engine.generate("hello", long, request_id="first"):
            if not outputs:
                thread = threading.Thread(target=other_thread)
                thread.start()
                await asyncio.to_thread(thread.join)
            outputs.append(out)
        return outputs

    outputs = run(main)
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 40
    assert outputs[-1].outputs[0].finish_reason == "length"
    (error,) = errors
    assert isinstance(error, RuntimeError) and "another event loop" in str(error), error
    run(lambda: collect(engine, "hi", SamplingParams(max_tokens=2), "after"))  # free again
