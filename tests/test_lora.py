"""Multi-LoRA against PEFT: mixed batches of the base model and several adapters, token for token.

Each adapter is random (A and B both drawn), with its own rank, targets and scaling rule; the
reference is transformers + peft's `PeftModel` over the same directory, one prompt at a time,
greedy, in float32. The engine runs every prompt in one `generate`, adapters mixed.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncengine import LLM, AsyncLLMEngine, EngineArgs, LoRARequest, SamplingParams
from asyncengine.errors import InvalidRequestError, LoRAInUseError, LoRANotFoundError
from asyncengine.outputs import FinishReason
from asyncengine.sampling_params import StructuredOutputsParams
from asyncengine.server.metrics import _lora_metrics
from asyncengine.testing import make_random_lora

if TYPE_CHECKING:
    from conftest import ModelDirFactory

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# rank, alpha, targets, rsLoRA: attention only, MLP only, everything
ADAPTERS = [
    (4, 8, ("q_proj", "v_proj"), False),
    (8, 16, ("gate_proj", "up_proj", "down_proj"), False),
    (16, 8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), True),
]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path], list[LoRARequest]]:
    """`adapters(model_dir)`: the three ADAPTERS for that model, as LoRARequests (ids 1..3)."""
    cache: dict[Path, list[LoRARequest]] = {}

    def make(model_dir: Path) -> list[LoRARequest]:
        if model_dir not in cache:
            cache[model_dir] = []
            for i, (r, alpha, targets, rslora) in enumerate(ADAPTERS, start=1):
                out = tmp_path_factory.mktemp(f"lora-{i}")
                make_random_lora(
                    out, model_dir, seed=i, r=r, lora_alpha=alpha, target_modules=targets,
                    use_rslora=rslora,
                )  # fmt: skip
                cache[model_dir].append(LoRARequest(f"adapter-{i}", i, str(out)))
        return cache[model_dir]

    return make


_peft_results: dict[tuple[str, str | None, tuple[int, ...]], list[int]] = {}


def peft_greedy(model_dir: Path, lora: LoRARequest | None, prompt: list[int]) -> list[int]:
    """PEFT's greedy tokens for `prompt` with adapter `lora` (None: the base model)."""
    key = (str(model_dir), lora and lora.lora_path, tuple(prompt))
    if key not in _peft_results:
        from peft import PeftModel

        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if lora is not None:
            model = PeftModel.from_pretrained(model, lora.lora_path)
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=2,
            )  # fmt: skip
        _peft_results[key] = out[0, len(prompt) :].tolist()
    return _peft_results[key]


def make_llm(model_dir: Path, **overrides: Any) -> LLM:
    args: dict[str, Any] = {
        "dtype": "float32",
        "device": "cpu",
        "max_num_seqs": 16,
        "enable_lora": True,
        "max_loras": 4,
        "max_lora_rank": 16,
        **overrides,
    }
    return LLM(model=str(model_dir), **args)


def mixed_requests(loras: list[LoRARequest]) -> tuple[list[list[int]], list[LoRARequest | None]]:
    """Two prompts for the base model and for each adapter, interleaved."""
    choices: list[LoRARequest | None] = [None, *loras]
    prompts = [[0, *[3 + (7 * i + 11 * j) % 400 for j in range(5 + i)]] for i in range(8)]
    return prompts, [choices[i % len(choices)] for i in range(len(prompts))]


def assert_matches_peft(
    llm: LLM, model_dir: Path, loras: list[LoRARequest], params: SamplingParams = GREEDY
) -> None:
    prompts, per_prompt = mixed_requests(loras)
    outs = llm.generate(prompts, params, lora_request=per_prompt)
    problems = []
    for i, (out, lora) in enumerate(zip(outs, per_prompt, strict=True)):
        expected = peft_greedy(model_dir, lora, prompts[i])
        for sample in out.outputs:
            if sample.token_ids != expected:
                name = lora and lora.lora_name
                problems.append(f"prompt {i} ({name}): {sample.token_ids} != {expected}")
    assert not problems, "\n".join(problems)
    stats = llm.get_stats()
    assert stats.num_running == stats.num_waiting == stats.num_swapped == 0
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_a_mixed_batch_matches_peft(
    family: str, model_dir: ModelDirFactory, adapters: Callable[[Path], list[LoRARequest]]
) -> None:
    path = model_dir(family)
    loras = adapters(path)
    llm = make_llm(path)
    assert_matches_peft(llm, path, loras)
    # the adapters change the outputs (a no-op adapter would pass the check above)
    prompts, _ = mixed_requests(loras)
    assert len({tuple(peft_greedy(path, lora, prompts[0])) for lora in [None, *loras]}) == 4
    assert llm.list_loras() == {1, 2, 3}
    stats = llm.get_stats()
    assert stats.num_lora_loads == 3
    # 8 prompts over the base and 3 adapters: 2 requests each, counted by name
    assert stats.lora_requests_total == {lora.lora_name: 2 for lora in loras}
    names = [lora.lora_name for lora in loras]
    admitted = {
        s.labels["lora_name"]: s.value
        for family in _lora_metrics(stats, names)
        for s in family.samples
        if s.name == "asyncengine_lora_requests_admitted_total"
    }
    assert admitted == {name: 2 for name in names}


@pytest.mark.parametrize(
    ("family", "preemption_mode"),
    [("llama", "swap"), ("llama", "recompute"), ("qwen2", "swap"), ("qwen3", "swap")],
)
def test_preemption_with_adapters_matches_peft(
    family: str,
    preemption_mode: str,
    model_dir: ModelDirFactory,
    adapters: Callable[[Path], list[LoRARequest]],
) -> None:
    path = model_dir(family)
    llm = make_llm(
        path, block_size=8, num_gpu_blocks_override=8, preemption_mode=preemption_mode,
        max_loras=2,
    )  # fmt: skip
    assert_matches_peft(llm, path, adapters(path))
    stats = llm.get_stats()
    assert stats.num_preemptions_swap + stats.num_preemptions_recompute > 0
    assert stats.num_lora_evictions > 0  # 3 adapters over 2 slots


def test_parallel_samples_with_an_adapter_match_peft(
    model_dir: ModelDirFactory, adapters: Callable[[Path], list[LoRARequest]]
) -> None:
    path = model_dir("llama")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    assert_matches_peft(make_llm(path), path, adapters(path), params)


def peft_choice_greedy(
    model_dir: Path, lora: LoRARequest | None, prompt: list[int], choices: list[str]
) -> list[int]:
    """PEFT's greedy tokens under a choice constraint: at each step the argmax of PEFT's
    logits among the tokens an xgrammar matcher (built here from the tokenizer) allows."""
    import xgrammar as xgr
    from peft import PeftModel
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora is not None:
        model = PeftModel.from_pretrained(model, lora.lora_path)
    vocab_size = model.config.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=[tokenizer.eos_token_id]
    )
    ebnf = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(ebnf))
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    tokens: list[int] = []
    while not matcher.is_terminated() and len(tokens) < MAX_TOKENS:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, -1]
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask[0])
        tokens.append(int(logits.argmax()))
        assert matcher.accept_token(tokens[-1])
    return tokens


def test_a_constrained_request_follows_its_adapter(
    model_dir: ModelDirFactory, adapters: Callable[[Path], list[LoRARequest]]
) -> None:
    # a choice between texts that the adapters and the base model would each start with: in
    # one batch, each constrained request takes its own model's allowed argmax at every step
    path = model_dir("llama")
    llm = make_llm(path)
    loras = adapters(path)
    prompts = mixed_requests([])[0][:4]
    choices = ["the", " a", "x", "ex", " reple", "Wning P", "um~ke", "\\ar"]
    per_prompt: list[LoRARequest | None] = [None, *loras]
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS,
        structured_outputs=StructuredOutputsParams(choice=choices),
    )  # fmt: skip
    outs = llm.generate(prompts, params, lora_request=per_prompt)
    expected = [peft_choice_greedy(path, lora, p, choices) for p, lora in zip(prompts, per_prompt)]
    for out, want in zip(outs, expected, strict=True):
        assert out.outputs[0].token_ids == want
        assert out.outputs[0].text in choices
    # the adapters decide: their choices are not all the base model's
    assert len({tuple(want) for want in expected}) > 1
    assert [peft_choice_greedy(path, None, p, choices) for p in prompts] != expected
    stats = llm.get_stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks


def test_one_slot_and_one_host_copy_run_every_adapter_in_turn(
    model_dir: ModelDirFactory, adapters: Callable[[Path], list[LoRARequest]]
) -> None:
    path = model_dir("llama")
    llm = make_llm(path, max_loras=1, max_cpu_loras=1)
    steps: list[set[int]] = []
    engine = llm.llm_engine
    schedule = engine.schedule

    def recording_schedule() -> Any:
        plan = schedule()
        steps.append({req.lora_int_id for req in plan.scheduled} - {0})
        return plan

    engine.schedule = recording_schedule  # type: ignore[method-assign]
    loras = adapters(path)
    for lora in loras:
        llm.add_lora(lora)
    assert llm.get_stats().num_cached_loras == 1
    assert_matches_peft(llm, path, loras)
    assert max(len(ids) for ids in steps) == 1
    # evicted host copies were read again, off the step, and operators see both counts
    stats = llm.get_stats()
    assert stats.num_lora_host_evictions >= len(loras) - 1
    assert stats.num_lora_disk_reads > len(loras)
    samples = {s.name: s.value for family in _lora_metrics(stats, []) for s in family.samples}
    assert samples["asyncengine_lora_host_evictions_total"] == stats.num_lora_host_evictions
    assert samples["asyncengine_lora_disk_reads_total"] == stats.num_lora_disk_reads


def _first_adapter_evicted(path: Path, loras: list[LoRARequest]) -> tuple[LLM, LoRARequest]:
    """An LLM with one adapter slot and one host copy, the first two adapters registered:
    the first's host copy evicted by the second's, so its next request reads it again."""
    llm = make_llm(path, max_loras=1, max_cpu_loras=1)
    llm.add_lora(loras[0])
    llm.add_lora(loras[1])
    return llm, loras[0]


def test_an_adapter_that_cannot_be_read_again_fails_its_requests_only(
    model_dir: ModelDirFactory,
    adapters: Callable[[Path], list[LoRARequest]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its files gone after registration, an evicted adapter's read fails: the requests
    waiting for it end with an error, once each, and others run on. Before, they waited for
    good while the engine read it again on every step (lora_load_failed in a hot loop)."""
    path = model_dir("llama")
    llm, first = _first_adapter_evicted(path, adapters(path))
    engine = llm.llm_engine
    assert engine.loras is not None
    num_reads = 0

    def unreadable(lora_request: LoRARequest) -> Any:
        nonlocal num_reads
        num_reads += 1
        raise InvalidRequestError("lora_request.lora_path", "has no adapter_config.json")

    monkeypatch.setattr(engine.loras, "read", unreadable)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request("tuned-a", [0, 5, 6, 7], params, lora_request=first)
    engine.add_request("tuned-b", [0, 5, 8], params, lora_request=first)
    engine.add_request("base", [0, 5, 6, 7], params)
    finals: dict[str, Any] = {}
    for _ in range(200):
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals, "a second final output"
                finals[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert set(finals) == {"tuned-a", "tuned-b", "base"}
    for name in ("tuned-a", "tuned-b"):
        assert finals[name].outputs[0].finish is FinishReason.ERROR
        assert "could not be read" in (finals[name].error or ""), finals[name].error
    assert finals["base"].outputs[0].token_ids == peft_greedy(path, None, [0, 5, 6, 7])
    assert num_reads == 1
    stats = llm.get_stats()
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks


def test_a_slow_adapter_read_holds_only_its_own_request(
    model_dir: ModelDirFactory,
    adapters: Callable[[Path], list[LoRARequest]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # adapter 1's host copy is evicted (one host slot), so its request must read it again;
    # that read blocks until released, and the base model's request steps on meanwhile
    path = model_dir("llama")
    llm, first = _first_adapter_evicted(path, adapters(path))
    engine = llm.llm_engine
    assert engine.loras is not None
    release, reading = threading.Event(), threading.Event()
    read = engine.loras.read

    def slow_read(lora_request: LoRARequest) -> Any:
        reading.set()
        assert release.wait(60), "never released"
        return read(lora_request)

    monkeypatch.setattr(engine.loras, "read", slow_read)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request("base", [0, 5, 6, 7], params)
    engine.add_request("tuned", [0, 5, 6, 7], params, lora_request=first)
    finished: dict[str, list[int]] = {}
    while "base" not in finished:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    assert reading.is_set() and "tuned" not in finished  # the read is still blocked
    # with nothing else to run, the steps wait for the read rather than spin on empty plans
    threading.Timer(0.5, release.set).start()
    num_steps = 0
    while "tuned" not in finished:
        num_steps += 1
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    assert num_steps < 50 + MAX_TOKENS, num_steps
    assert finished["tuned"] == peft_greedy(path, first, [0, 5, 6, 7])
    assert finished["base"] == peft_greedy(path, None, [0, 5, 6, 7])


def test_prefix_cache_is_never_shared_between_adapters(
    model_dir: ModelDirFactory, adapters: Callable[[Path], list[LoRARequest]]
) -> None:
    path = model_dir("llama")
    lora_a, lora_b = adapters(path)[:2]
    llm = make_llm(path, block_size=8)
    prompt = [0, *range(10, 40)]  # three full blocks
    for lora in (lora_a, lora_b, None):
        out = llm.generate([prompt], GREEDY, lora_request=lora)[0]
        assert out.outputs[0].token_ids == peft_greedy(path, lora, prompt)
    assert llm.get_stats().num_prefix_cache_hits == 0
    out = llm.generate([prompt], GREEDY, lora_request=lora_a)[0]
    assert out.outputs[0].token_ids == peft_greedy(path, lora_a, prompt)
    assert llm.get_stats().num_prefix_cache_hits == 24  # its own three blocks


def test_bad_adapters_and_calls_are_refused_with_the_field(
    model_dir: ModelDirFactory,
    adapters: Callable[[Path], list[LoRARequest]],
    tmp_path: Path,
) -> None:
    path = model_dir("llama")
    lora = adapters(path)[0]
    llm = make_llm(path, max_lora_rank=8)

    def refused(request: LoRARequest) -> InvalidRequestError:
        with pytest.raises(InvalidRequestError) as caught:
            llm.add_lora(request)
        assert caught.value.field.startswith("lora_request")
        return caught.value

    assert "adapter_config.json" in str(refused(LoRARequest("x", 9, str(tmp_path / "nope"))))
    too_big = adapters(path)[2]  # rank 16
    assert "max_lora_rank" in str(refused(LoRARequest("big", 9, too_big.lora_path)))
    embed = make_random_lora(tmp_path / "embed", path, target_modules=["q_proj", "lm_head"])
    assert "lm_head" in str(refused(LoRARequest("embed", 9, str(embed))))
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads(Path(lora.lora_path, "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    assert "use_dora" in str(refused(LoRARequest("dora", 9, str(dora))))
    assert refused(LoRARequest("x", 0, lora.lora_path)).field == "lora_request.lora_int_id"

    assert llm.add_lora(lora) and not llm.add_lora(lora)
    assert refused(LoRARequest("other", lora.lora_int_id, lora.lora_path))
    with pytest.raises(LoRANotFoundError):
        llm.remove_lora(42)
    llm.llm_engine.add_request("r", [0, 5, 6], GREEDY, lora_request=lora)
    with pytest.raises(LoRAInUseError):
        llm.remove_lora(lora.lora_int_id)
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    assert llm.remove_lora(lora.lora_int_id) and llm.list_loras() == set()

    base_only = make_llm(path, enable_lora=False)
    with pytest.raises(InvalidRequestError) as caught:
        base_only.generate([[0, 5]], GREEDY, lora_request=lora)
    assert caught.value.field == "lora_request" and "enable_lora" in str(caught.value)


def test_engine_args_bound_the_lora_settings(model_dir: ModelDirFactory) -> None:
    with pytest.raises(ValueError, match="max_cpu_loras"):
        make_llm(model_dir("llama"), max_loras=4, max_cpu_loras=2)


@pytest.mark.parametrize("engine_process", [False, True], ids=["in-process", "engine-process"])
def test_the_async_engine_adds_runs_and_removes_adapters(
    engine_process: bool,
    model_dir: ModelDirFactory,
    adapters: Callable[[Path], list[LoRARequest]],
) -> None:
    path = model_dir("llama")
    loras = adapters(path)
    args = EngineArgs(
        model=str(path), device="cpu", dtype="float32", enable_lora=True, max_loras=2,
        max_lora_rank=16, block_size=8, num_gpu_blocks_override=64,
    )  # fmt: skip
    options = {"torch_threads": 1} if engine_process else {}
    engine = AsyncLLMEngine.from_engine_args(args, engine_process=engine_process, **options)
    prompts, per_prompt = mixed_requests(loras)

    async def tokens(i: int) -> list[int]:
        params = GREEDY
        async for out in engine.generate(prompts[i], params, f"r{i}", lora_request=per_prompt[i]):
            final = out
        return final.outputs[0].token_ids

    async def main() -> None:
        assert await engine.add_lora(loras[0]) and not await engine.add_lora(loras[0])
        assert await engine.add_lora(loras[1])
        # the third adapter is registered by its first request
        got = await asyncio.gather(*(tokens(i) for i in range(len(prompts))))
        for i, lora in enumerate(per_prompt):
            assert got[i] == peft_greedy(path, lora, prompts[i]), f"prompt {i} ({lora})"
        assert await engine.list_loras() == {1, 2, 3}
        assert set(engine.lora_requests()) == {"adapter-1", "adapter-2", "adapter-3"}

        stream = await engine.add_request("long", [0, 5, 6], GREEDY, lora_request=loras[0])
        with pytest.raises(LoRAInUseError):
            await engine.remove_lora(1)
        while not (await stream.get()).finished:
            pass
        assert await engine.remove_lora(1)
        assert await engine.list_loras() == {2, 3} and "adapter-1" not in engine.lora_requests()
        with pytest.raises(LoRANotFoundError):
            await engine.remove_lora(1)
        with pytest.raises(InvalidRequestError) as caught:
            await engine.add_lora(LoRARequest("gone", 7, str(path / "no-such-adapter")))
        assert caught.value.field == "lora_request.lora_path"
        stats = engine.get_stats()
        assert stats.num_lora_loads >= 3 and stats.num_lora_evictions >= 1
        assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (0, 0, 0)
        assert stats.num_free_gpu_blocks == stats.num_gpu_blocks and engine.num_requests == 0

    try:
        asyncio.run(main())
    finally:
        asyncio.run(engine.shutdown())


def test_the_lora_flags_set_the_engine_args() -> None:
    import argparse

    from asyncengine.server.engine_flags import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "32", "--max-cpu-loras", "8"]
    args = engine_args_from(parser.parse_args(flags))
    assert (args.enable_lora, args.max_loras, args.max_lora_rank, args.max_cpu_loras) == (
        True, 4, 32, 8,
    )  # fmt: skip
    assert not engine_args_from(parser.parse_args([])).enable_lora


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tensor_parallel_size_2_with_forced_swaps_matches_peft(
    family: str, model_dir: ModelDirFactory, adapters: Callable[[Path], list[LoRARequest]]
) -> None:
    path = model_dir(family)
    llm = make_llm(
        path, tensor_parallel_size=2, max_loras=2, block_size=8, num_gpu_blocks_override=8,
        preemption_mode="swap",
    )  # fmt: skip
    try:
        assert_matches_peft(llm, path, adapters(path))
        stats = llm.get_stats()
        assert stats.num_preemptions_swap > 0 and stats.num_lora_evictions > 0
    finally:
        llm.shutdown()


def test_an_unknown_adapters_long_name_is_not_echoed_whole() -> None:
    """The error's text travels in the call's status: a 32 KiB name outgrew the client's
    16 KiB metadata limit, and the client saw no status (the fuzz test's find)."""
    error = LoRANotFoundError("a" * 32768)
    assert len(str(error)) < 200 and error.name_or_id == "a" * 32768


class _GatedEngine:
    """What LoRAAdapters asks of the engine, with each call held until the test lets it go."""

    def __init__(self, adapter: LoRARequest) -> None:
        self.loras = {adapter.lora_name: adapter}
        self.removing = asyncio.Event()
        self.may_remove = asyncio.Event()
        self.calls: list[str] = []

    def lora_requests(self) -> dict[str, LoRARequest]:
        return dict(self.loras)

    async def remove_lora(self, lora_int_id: int) -> bool:
        self.calls.append("remove")
        self.removing.set()
        await self.may_remove.wait()
        self.loras = {n: a for n, a in self.loras.items() if a.lora_int_id != lora_int_id}
        return True


def test_an_unload_and_a_request_naming_its_adapter_are_ordered() -> None:
    """A request naming an adapter holds it until the engine has the request; an unload waits
    for that (the engine then refuses it: in use), and a request that meets an unload in flight
    waits for it, then is refused NOT_FOUND. Before, the request could reach the engine after
    the adapter left it: a server error ("the request could not be queued")."""
    from asyncengine.server.lora import LoRAAdapters

    adapter = LoRARequest("tuned", 1, "/nowhere")

    async def main() -> None:
        engine = _GatedEngine(adapter)
        adapters = LoRAAdapters(engine, frozenset({"base"}), allow_runtime_updates=True)  # type: ignore[arg-type]
        handed = asyncio.Event()
        # a request mid-hand-over: the unload waits for it to reach the engine
        async with adapters.handing(adapter):
            unloading = asyncio.create_task(adapters.unload("tuned"))
            await asyncio.sleep(0.05)
            assert engine.calls == []
            engine.calls.append("queued")
            handed.set()
        await engine.removing.wait()
        assert engine.calls == ["queued", "remove"]
        # a request that meets the unload in flight waits for it, then finds no adapter
        waiting = asyncio.create_task(_hand_over(adapters, adapter))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        engine.may_remove.set()
        await unloading
        with pytest.raises(LoRANotFoundError):
            await waiting

    asyncio.run(main())


async def _hand_over(adapters: Any, adapter: LoRARequest) -> None:
    async with adapters.handing(adapter):
        raise AssertionError("handed over an adapter being unloaded")
