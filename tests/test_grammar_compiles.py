"""Grammar compiles are bounded: a caller that leaves stops paying for its compile, a compile
past its time limit is an error naming the field, and the compiled-grammar cache has a size.

The slow grammars are JSON schemas of 900 patterned properties: under a CPU-second each to
compile against the test tokenizer. CPU time is read from /proc, for the process that compiles (the
engine process, or this one in-process).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import threading
import time
from typing import Any

import pytest

from asyncengine import AsyncLLMEngine, EngineArgs, InvalidRequestError, SamplingParams
from asyncengine.engine.llm_engine import LLMEngine
from asyncengine.engine.mp_client import MPClient
from asyncengine.engine.structured_output import StructuredOutputManager
from asyncengine.sampling_params import StructuredOutputsParams

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]
NUM_PROPERTIES = 900  # a 56 KB schema (under the 64 KB bound): ~0.8 CPU-s to compile
QUIET_POLL_S = 0.1
SLOW_COMPILE_S = 1.5


def slow_schema(salt: str) -> StructuredOutputsParams:
    """A JSON schema of many patterned properties, distinct per `salt` (no cache hit)."""
    props = {
        f"p{i}": {"type": "string", "pattern": f"^[a-f0-9]{{{i % 7 + 2},{i % 11 + 12}}}-{salt}{i}$"}
        for i in range(NUM_PROPERTIES)
    }
    schema = {"type": "object", "properties": props, "required": list(props)[:450]}
    return StructuredOutputsParams(json=json.dumps(schema, separators=(",", ":")))


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid`, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def is_running(pid: int) -> bool:
    """Whether a thread of `pid` (other than this one) is running or waiting for a CPU: a
    compile on a loaded box uses little CPU, yet it is not done."""
    me = str(threading.get_native_id())
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/task/{tid}/stat") as f:
            if tid != me and f.read().rsplit(")", 1)[1].split()[0] == "R":
                return True
    return False


def cpu_until_quiet(pid: int, timeout_s: float = 60.0) -> float:
    """The CPU seconds `pid` uses from now until no thread of it runs (three looks in a row)."""
    start = cpu_s(pid)
    deadline, num_quiet = time.monotonic() + timeout_s, 0
    while num_quiet < 3:
        assert time.monotonic() < deadline, f"still busy after {timeout_s} s"
        time.sleep(QUIET_POLL_S)
        num_quiet = 0 if is_running(pid) else num_quiet + 1
    return cpu_s(pid) - start


def make_engine(
    model_dir: Any, where: str, factory: Any = LLMEngine.from_engine_args, **overrides: Any
) -> tuple[AsyncLLMEngine, int]:
    """An engine (in-process or in an engine process) and the pid that compiles its grammars."""
    values = {"model": str(model_dir("llama")), "device": "cpu", "dtype": "float32"}
    args = EngineArgs(**(values | {"grammar_compile_threads": 1} | overrides))
    if where == "in-process":
        return AsyncLLMEngine(factory(args)), os.getpid()
    client = MPClient(args, factory, torch_threads=1)
    return AsyncLLMEngine(client), client._process.pid


def _json_compiles_slowly(args: EngineArgs) -> LLMEngine:
    """An engine whose JSON schemas take SLOW_COMPILE_S more to compile (whatever the box)."""
    engine = LLMEngine.from_engine_args(args)
    compile_now = engine.validator.check_structured_outputs

    def compile_slowly(params: SamplingParams) -> Any:
        assert params.structured_outputs is not None
        if params.structured_outputs.kind == "json":
            time.sleep(SLOW_COMPILE_S)
        return compile_now(params)

    engine.validator.check_structured_outputs = compile_slowly  # type: ignore[method-assign]
    return engine


async def leave_after(engine: AsyncLLMEngine, request_id: str, so: Any, deadline_s: float) -> None:
    """A caller whose deadline passes while its grammar compiles."""
    params = SamplingParams(max_tokens=4, structured_outputs=so)

    async def run() -> None:
        async for _ in engine.generate("p", params, request_id=request_id):
            pass

    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(run(), deadline_s)


@pytest.mark.parametrize("where", ["in-process", "engine process"])
def test_callers_leaving_stop_paying_for_their_compiles(model_dir, where) -> None:
    """Six callers leaving while their grammars compile cost the engine about one compile:
    the one running when they leave runs on (xgrammar cannot stop it), the five queued behind
    it never start."""
    # a compile on a loaded box takes long: no time limit here
    engine, pid = make_engine(model_dir, where, max_grammar_compile_s=600)
    stays = SamplingParams(max_tokens=4, structured_outputs=slow_schema("a"))

    async def main() -> tuple[float, float]:
        started = cpu_s(pid)
        async for _ in engine.generate("p", stays, request_id="stays"):
            pass
        one = cpu_s(pid) - started  # a whole compile (and four tokens)
        started = cpu_s(pid)
        await asyncio.gather(
            *(leave_after(engine, f"six-{s}", slow_schema(s), 0.3) for s in "bcdefg")
        )
        await asyncio.to_thread(cpu_until_quiet, pid)
        assert engine.num_requests == 0
        return one, cpu_s(pid) - started

    try:
        one, six = asyncio.run(main())
        stats = engine.get_stats()
    finally:
        asyncio.run(engine.shutdown())
    print(f"\nengine CPU: one compile {one:.2f} s, six whose callers left {six:.2f} s")
    assert one > 0.1, one  # the compile was slow, or this proves nothing
    assert six < 1.5 * one, (one, six)
    if where == "in-process":  # the engine process's stats come with its steps
        assert stats.num_grammar_compiles_dropped == 5


@pytest.mark.parametrize("where", ["in-process", "engine process"])
def test_a_compile_past_its_time_limit_is_an_error_naming_the_field(model_dir, where) -> None:
    engine, _ = make_engine(model_dir, where, _json_compiles_slowly, max_grammar_compile_s=0.2)
    schema = '{"type": "object"}'
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json=schema))
    small = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="ab"))

    async def main() -> float:
        started = time.monotonic()
        with pytest.raises(InvalidRequestError) as info:
            await engine.add_request("slow", "p", params)
        waited = time.monotonic() - started
        assert info.value.field == "structured_outputs.json"
        assert "did not compile in 0.2 s (max_grammar_compile_s)" in str(info.value)
        # the engine goes on: the next compile waits for the first to end, then runs
        outs = [o async for o in engine.generate("p", small, request_id="small")]
        assert outs[-1].finished and outs[-1].error is None
        assert engine.num_requests == 0
        return waited

    try:
        waited = asyncio.run(main())
        stats = engine.get_stats()
    finally:
        asyncio.run(engine.shutdown())
    assert waited < 0.2 + 0.5, waited  # told at the limit, not at the compile's end
    assert stats.num_grammar_compile_timeouts == 1
    assert stats.grammar_compile_busy_s >= SLOW_COMPILE_S


def test_the_grammar_cache_is_bounded_by_bytes_and_evicts_the_least_recent(model_dir) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir("llama")))
    vocab_size = len(tokenizer)
    unbounded = StructuredOutputManager(tokenizer, vocab_size, (0,), max_cache_bytes=1 << 40)
    size = unbounded.compile(StructuredOutputsParams(regex="[a-z]{2}x")).grammar.memory_size_bytes
    manager = StructuredOutputManager(tokenizer, vocab_size, (0,), max_cache_bytes=3 * size)
    specs = [StructuredOutputsParams(regex=f"[a-z]{{2}}{c}") for c in "vwxyz"]
    for spec in specs:
        assert manager.compile(spec).compile_s is not None
    # same-shaped regexes, the same size: three fit, the first two were evicted
    assert manager.num_cached == 3 and manager.cache_bytes <= 3 * size
    assert manager.compile(specs[-1]).compile_s is None  # kept
    assert manager.compile(specs[0]).compile_s is not None  # evicted: compiled again
    none_kept = StructuredOutputManager(tokenizer, vocab_size, (0,), max_cache_bytes=0)
    none_kept.compile(specs[0])
    assert none_kept.num_cached == 0 and none_kept.compile(specs[0]).compile_s is not None
