"""Structured outputs: JSON schema, regex, choice and grammar constraints through the Python API.

The model has random weights, so it never writes JSON (or anything else) by chance: whatever
validates, the constraint made it so. Runs are checked unpressed and under forced swap and
forced recompute, with chunked prefill, prefix caching and n=2.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import jsonschema
import pytest

from asyncengine import LLM, AsyncLLMEngine, EngineArgs, InvalidRequestError
from asyncengine.engine.structured_output import StructuredOutputManager, choice_grammar
from asyncengine.errors import RequestFailedError
from asyncengine.outputs import CompletionOutput, FinishReason
from asyncengine.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 4},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 2, "maxLength": 6},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "color", "tags", "address"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3}-\d{2,4}( [A-Z][a-z]{1,5}){0,2}"
CHOICES = ["red", "green", "blue", "맞아요 🍕", 'say "hi"\\n']
# a shared start (prefix caching) long enough to prefill in chunks of max_num_batched_tokens
PREFIX = (
    "A paged key-value cache splits the memory of each sequence into fixed-size blocks, "
    "and the scheduler decides which requests run in the next step and which ones wait."
)


def make_engine(model_dir: Any, **overrides: Any) -> AsyncLLMEngine:
    args = EngineArgs(model=str(model_dir), device="cpu", dtype="float32", **overrides)
    return AsyncLLMEngine.from_engine_args(args)


def constrained(kind: str, seed: int, **overrides: Any) -> SamplingParams:
    so = {
        "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        "regex": StructuredOutputsParams(regex=REGEX),
        "choice": StructuredOutputsParams(choice=CHOICES),
    }[kind]
    fields: dict[str, Any] = {"n": 2, "temperature": 1.0, "seed": seed, "max_tokens": 200}
    return SamplingParams(**(fields | overrides), structured_outputs=so)


def check_sample(kind: str, sample: CompletionOutput) -> None:
    """The sample ended by its grammar and is what the constraint says."""
    assert sample.finish is FinishReason.EOS, (kind, sample)
    if kind == "json":
        jsonschema.validate(json.loads(sample.text), SCHEMA)  # strict: no raw control chars
    elif kind == "regex":
        assert re.fullmatch(REGEX, sample.text), sample.text
    else:
        assert sample.text in CHOICES, sample.text


async def final(engine: AsyncLLMEngine, prompt: Any, params: SamplingParams, request_id: str):
    out = None
    async for out in engine.generate(prompt, params, request_id=request_id):  # noqa: B007
        pass
    assert out is not None and out.finished
    return out


def assert_nothing_left(engine: AsyncLLMEngine) -> None:
    stats = engine.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (0, 0, 0)
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
    assert stats.num_free_cpu_blocks == stats.num_cpu_blocks
    assert not engine.engine.structured.has_requests  # every matcher went with its request


KINDS = ["json", "regex", "choice"]
REQUESTS = [(f"c{i}", f"{PREFIX} {i}", KINDS[i % 3], 100 + i) for i in range(24)]
FREE = [(f"u{i}", f"{PREFIX} free {i}", 500 + i) for i in range(4)]


def free_params(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=24, ignore_eos=True)


def run_mixed_batch(engine: AsyncLLMEngine) -> dict[str, list[list[int]]]:
    """The 24 constrained requests (n=2) and 4 unconstrained ones at once: token ids of each
    sample, after checking every constrained sample against its constraint."""

    async def main() -> dict[str, list[list[int]]]:
        tasks = {rid: final(engine, p, constrained(k, s), rid) for rid, p, k, s in REQUESTS}
        tasks |= {rid: final(engine, p, free_params(s), rid) for rid, p, s in FREE}
        outs = dict(zip(tasks, await asyncio.gather(*tasks.values())))
        assert_nothing_left(engine)
        await engine.shutdown()
        for rid, _, kind, _ in REQUESTS:
            samples = outs[rid].outputs
            assert [s.index for s in samples] == [0, 1]
            for sample in samples:
                check_sample(kind, sample)
        return {rid: [s.token_ids for s in out.outputs] for rid, out in outs.items()}

    return asyncio.run(main())


@pytest.fixture(scope="module")
def unpressed(model_dir: Any) -> dict[str, list[list[int]]]:
    engine = make_engine(
        model_dir("llama"), block_size=8, max_num_batched_tokens=128, max_num_seqs=64
    )
    tokens = run_mixed_batch(engine)
    stats = engine.get_stats()
    assert stats.num_preemptions_swap == stats.num_preemptions_recompute == 0
    assert stats.num_prefix_cache_hits > 0  # the shared prefix came from the cache
    return tokens


def test_every_sample_of_a_mixed_batch_meets_its_constraint(model_dir, unpressed) -> None:
    # a matcher per sample: the two samples of a request went their own ways
    assert sum(a != b for a, b in (unpressed[rid] for rid, *_ in REQUESTS)) >= 12
    # each kind made several different outputs, not one answer the model happens to like
    for kind in KINDS:
        outputs = {tuple(t) for rid, _, k, _ in REQUESTS if k == kind for t in unpressed[rid]}
        assert len(outputs) >= 4, kind
    # unconstrained requests in the batch got exactly the tokens they get alone
    alone = LLM(model=str(model_dir("llama")), device="cpu", dtype="float32").generate(
        [p for _, p, _ in FREE], [free_params(s) for _, _, s in FREE], use_tqdm=False
    )
    for (rid, _, _), out in zip(FREE, alone):
        assert unpressed[rid] == [out.outputs[0].token_ids], rid


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_constrained_outputs_are_the_same_under_preemption(model_dir, unpressed, mode) -> None:
    engine = make_engine(
        model_dir("llama"),
        block_size=8,
        max_num_batched_tokens=128,
        max_num_seqs=64,
        num_gpu_blocks_override=72,
        num_cpu_blocks_override=2048,
        preemption_mode=mode,
    )
    assert run_mixed_batch(engine) == unpressed
    stats = engine.get_stats()
    assert (stats.num_preemptions_swap if mode == "swap" else stats.num_preemptions_recompute) > 0


def test_min_tokens_stop_strings_grammar_and_logprobs(model_dir) -> None:
    llm = LLM(model=str(model_dir("llama")), device="cpu", dtype="float32")
    prompts = [f"numbers {i}" for i in range(6)]

    def samples(**fields: Any) -> list[CompletionOutput]:
        outs = llm.generate(prompts, SamplingParams(max_tokens=64, **fields), use_tqdm=False)
        return [out.outputs[0] for out in outs]

    # min_tokens holds EOS back while the grammar can go on; the output still matches
    digits = StructuredOutputsParams(regex=r"[0-9]+")
    for sample in samples(seed=1, min_tokens=6, structured_outputs=digits):
        assert re.fullmatch(r"[0-9]+", sample.text) and len(sample.token_ids) > 6, sample
    # where the grammar allows nothing but its end, it ends, min_tokens or ignore_eos or not
    yes_no = StructuredOutputsParams(choice=["yes", "no"])
    for sample in samples(seed=2, min_tokens=30, ignore_eos=True, structured_outputs=yes_no):
        assert sample.text in ("yes", "no") and sample.finish is FinishReason.EOS, sample
    # a stop string cuts the constrained text like any other
    regex = StructuredOutputsParams(regex=REGEX)
    for sample in samples(seed=3, stop=["-"], structured_outputs=regex):
        assert sample.finish is FinishReason.STOP_STRING and re.fullmatch("[a-z]{3}", sample.text)
    # an EBNF grammar; logprobs are of the masked distribution: every alternative reported is
    # a token the grammar allowed there
    grammar = StructuredOutputsParams(grammar='root ::= "(" [0-9]{1,3} ("," [0-9]{1,3}){0,3} ")"')
    tokenizer = llm.get_tokenizer()
    for sample in samples(seed=4, logprobs=5, structured_outputs=grammar):
        assert re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3}){0,3}\)", sample.text), sample.text
        assert sample.logprobs is not None and len(sample.logprobs) == len(sample.token_ids)
        for entry in sample.logprobs:
            assert all(lp.logprob > -float("inf") for lp in entry.values())
            pieces = [tokenizer.decode([t]) for t in entry if t != tokenizer.eos_token_id]
            assert all(re.fullmatch(r"[(),0-9]+", p) for p in pieces), pieces


def test_an_invalid_constraint_is_an_error_naming_its_field(model_dir) -> None:
    bad = [
        # passes the static rules; xgrammar finds the empty range
        (
            "structured_outputs.json",
            StructuredOutputsParams(json={"type": "integer", "minimum": 5, "maximum": 1}),
        ),
        ("structured_outputs.regex", StructuredOutputsParams(regex="[a-")),
        ("structured_outputs.grammar", StructuredOutputsParams(grammar="root ::= undefined")),
    ]
    llm = LLM(model=str(model_dir("llama")), device="cpu", dtype="float32")
    for i, (field, so) in enumerate(bad):
        params = SamplingParams(structured_outputs=so)
        with pytest.raises(InvalidRequestError) as error:
            llm.llm_engine.add_request(f"bad-{i}", "hi", params)
        assert error.value.field == field
        assert "does not compile" in error.value.description
        assert "/project/" not in error.value.description  # no C++ source locations
        with pytest.raises(InvalidRequestError) as error:  # before any prompt runs, as vLLM's
            llm.generate(["hi", "there"], params, use_tqdm=False)
        assert error.value.field == field
        assert not llm.llm_engine.has_unfinished_requests()
    engine = make_engine(model_dir("llama"))
    ok = constrained("choice", seed=9, n=1)

    async def main() -> None:
        good = asyncio.create_task(final(engine, "fine", ok, "good"))
        for i, (field, so) in enumerate(bad):
            with pytest.raises(InvalidRequestError) as error:
                await final(engine, "hi", SamplingParams(structured_outputs=so), f"bad-{i}")
            assert error.value.field == field
        assert (await good).outputs[0].text in CHOICES
        assert_nothing_left(engine)
        await engine.shutdown()

    asyncio.run(main())


def test_static_checks_name_the_field() -> None:
    cases = [
        ("structured_outputs", {}),
        ("structured_outputs", {"regex": "a", "choice": ["a"]}),
        ("structured_outputs.json", {"json": "{not json"}),
        ("structured_outputs.json", {"json": "[1, 2]"}),
        ("structured_outputs.json", {"json": {"description": "x" * 70_000}}),
        ("structured_outputs.regex", {"regex": ""}),
        ("structured_outputs.grammar", {"grammar": "x" * 70_000}),
        ("structured_outputs.choice", {"choice": []}),
        ("structured_outputs.choice", {"choice": ["a", ""]}),
        ("structured_outputs.choice", {"choice": [str(i) for i in range(300)]}),
        ("structured_outputs.json_object", {"json_object": 1}),
        # the issue's: refused when made, not a request that ends in error
        ("structured_outputs.json", {"json": {"type": "no-such-type"}}),
        ("structured_outputs.json", {"json": {"type": "string", "maxLength": -1}}),
    ]
    for field, kwargs in cases:
        with pytest.raises(InvalidRequestError) as error:
            StructuredOutputsParams(**kwargs)
        assert error.value.field == field, kwargs
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(structured_outputs={"json": {}})  # type: ignore[arg-type]
    assert error.value.field == "structured_outputs"
    assert StructuredOutputsParams(json={"type": "object"}).json == '{"type": "object"}'
    assert choice_grammar(['a"b', "c\\d"]) == r'root ::= "a\"b" | "c\\d"'


def test_json_object_and_the_grammar_cache(model_dir) -> None:
    llm = LLM(model=str(model_dir("llama")), device="cpu", dtype="float32")
    so = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    outs = llm.generate(
        [f"object {i}" for i in range(8)],
        SamplingParams(seed=5, max_tokens=400, structured_outputs=so),
        use_tqdm=False,
    )
    ended = [o.outputs[0] for o in outs if o.outputs[0].finish is FinishReason.EOS]
    assert ended  # random weights write long strings: not every one ends within 400 tokens
    for sample in ended:
        assert isinstance(json.loads(sample.text), dict)
    manager: StructuredOutputManager = llm.llm_engine.structured
    first = manager.compile(StructuredOutputsParams(regex="[ab]+"))
    again = manager.compile(StructuredOutputsParams(regex="[ab]+"))
    assert first.compile_s is not None and again.compile_s is None
    assert again.grammar is first.grammar


def test_the_loop_serves_others_while_a_slow_grammar_compiles(model_dir, monkeypatch) -> None:
    # hundreds of properties with patterns: a compile of a good fraction of a second, and
    # never less than 0.3 s (like xgrammar, the sleep lets go of the GIL), however fast the box
    compile = StructuredOutputManager.compile

    def slow_compile(self: StructuredOutputManager, params: Any) -> Any:
        time.sleep(0.3)
        return compile(self, params)

    monkeypatch.setattr(StructuredOutputManager, "compile", slow_compile)
    slow = {
        "type": "object",
        "properties": {
            f"k{i}": {"type": "string", "pattern": "[a-z]{2,5}(-[0-9]+)?"} for i in range(600)
        },
        "required": ["k0"],
    }
    engine = make_engine(model_dir("llama"))
    delta = RequestOutputKind.DELTA
    free = SamplingParams(temperature=0, max_tokens=600, ignore_eos=True, output_kind=delta)
    slow_params = SamplingParams(
        seed=1,
        max_tokens=12,
        structured_outputs=StructuredOutputsParams(json=slow, disable_any_whitespace=True),
    )

    async def main() -> tuple[float, list[float], list[str]]:
        arrivals: list[float] = []
        phases: list[str] = []

        async def stream() -> None:
            async for _ in engine.generate("free running", free, request_id="free"):
                arrivals.append(time.monotonic())
                if engine.is_in_flight("slow") and not engine.engine.is_in_flight("slow"):
                    phases.append(str(engine.request_phase("slow")))
                if len(arrivals) == 3:
                    started.set()

        started = asyncio.Event()
        free_task = asyncio.create_task(stream())
        await started.wait()
        begin = time.monotonic()
        slow_stream = await engine.add_request("slow", "constrained", slow_params)
        compile_s = time.monotonic() - begin
        while (out := await slow_stream.get()) is not None and not out.finished:
            pass
        assert out is not None and out.outputs[0].text.startswith('{"k')
        await free_task
        assert_nothing_left(engine)
        await engine.shutdown()
        during = [t for t in arrivals if begin < t < begin + compile_s]
        return compile_s, during, phases

    compile_s, during, phases = asyncio.run(main())
    print(f"\ncompile {compile_s:.3f} s; {len(during)} outputs of another stream meanwhile")
    assert compile_s > 0.2, compile_s  # really slow, or this proves nothing
    # the compile waited off the loop and outside the scheduler; the other stream flowed on
    assert len(during) >= 5, (compile_s, len(during))
    assert phases and set(phases) == {"queued"}


def test_a_grammar_failure_ends_its_request_alone(model_dir, monkeypatch) -> None:
    engine = make_engine(model_dir("llama"))
    manager = engine.engine.structured
    accept = StructuredOutputManager.accept
    poisoned: set[str] = set()

    def failing_accept(self, req, num_tokens: int = 1) -> bool:
        if req.group_id in poisoned and req.num_output_tokens == 2:
            raise RuntimeError("a bug in this request's matcher")
        return accept(self, req, num_tokens)

    monkeypatch.setattr(StructuredOutputManager, "accept", failing_accept)
    regex = constrained("regex", seed=3, n=1)

    async def main() -> list[Any]:
        bad = asyncio.create_task(final(engine, "bad one", regex, "bad"))
        while not engine.engine.is_in_flight("bad"):
            await asyncio.sleep(0.001)
        poisoned.add(engine.engine._states["bad"].group_id)
        results = await asyncio.gather(
            bad,
            final(engine, "good one", regex, "good"),
            final(engine, "free one", free_params(7), "free"),
            return_exceptions=True,
        )
        assert engine.is_running and not engine.errored
        assert_nothing_left(engine)
        await engine.shutdown()
        return list(results)

    bad, good, free = asyncio.run(main())
    assert isinstance(bad, RequestFailedError) and "a bug" not in str(bad)
    assert re.fullmatch(REGEX, good.outputs[0].text)
    assert len(free.outputs[0].token_ids) == 24
    assert not manager.has_requests


def test_length_limited_json_strings_hold_no_raw_control_characters(model_dir) -> None:
    """xgrammar (0.2.9) lets a string with maxLength hold raw control characters; the engine's
    JSON grammar keeps them out, as JSON does."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))
    manager = StructuredOutputManager(tokenizer, 512, (tokenizer.eos_token_id,))
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5}}}
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    grammar = manager.compile(so).grammar
    for text, is_json in (('{"s": "abé🍕"}', True), ('{"s": "ab\x18"}', False)):
        assert xgr.GrammarMatcher(grammar).accept_string(text) is is_json, text
