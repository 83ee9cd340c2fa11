"""Tensor parallelism (N=2, gloo on the CPU): greedy parity with Hugging Face and with N=1,
a worker's death or hang kills the engine cleanly, and no worker outlives its engine.

Each N=2 engine starts a worker process (most of its start-up is that process importing
torch), so each test builds as few engines as it can.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from test_model_parity import (
    GREEDY,
    MAX_TOKENS,
    assert_matches_hf,
    assert_nothing_left_behind,
    encode_prompts,
    make_llm,
)

from asyncengine import AsyncLLMEngine, EngineArgs, SamplingParams
from asyncengine.core.scheduler import SchedulerOutput
from asyncengine.distributed.channel import ENCODED_METADATA_FIELDS, _decode_moves, _encode_moves
from asyncengine.distributed.executor import free_init_method
from asyncengine.errors import EngineDeadError
from asyncengine.testing import HF_PROMPTS
from asyncengine.worker.forward_context import AttentionMetadata

if TYPE_CHECKING:
    from conftest import HFGreedy, ModelDirFactory

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# name -> (family, config overrides); one KV head under N=2 is replicated on both ranks
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "one_kv_head": ("llama", {"num_key_value_heads": 1}),
}


def is_running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, dead but not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    """The pids still running after `timeout` seconds (none, when all went in time)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(map(is_running, pids)):
        time.sleep(0.05)
    return [pid for pid in pids if is_running(pid)]


def worker_pids(llm_engine: Any) -> list[int]:
    return list(llm_engine.model_runner.worker_pids)


def preemption_overrides(path: Path, mode: str) -> dict[str, Any]:
    """Engine args that force preemption in `mode` for all of HF_PROMPTS at once."""
    if mode == "plain":
        return {}
    block_size = 16
    per_request = [-(-(len(ids) + MAX_TOKENS) // block_size) for ids in encode_prompts(path)]
    return {
        "block_size": block_size,
        # room for the largest request on its own, far from room for all of them at once
        "num_gpu_blocks_override": max(per_request) + 1,
        "num_cpu_blocks_override": sum(per_request),
        "preemption_mode": mode,
    }


@pytest.mark.parametrize("mode", ["plain", "swap", "recompute"])
@pytest.mark.parametrize("model", list(MODELS))
def test_tp2_greedy_equals_hf_and_tp1(
    model: str, mode: str, model_dir: ModelDirFactory, hf_greedy: HFGreedy
) -> None:
    family, config_overrides = MODELS[model]
    path = model_dir(family, **config_overrides)
    overrides = preemption_overrides(path, mode)
    single = make_llm(path, **overrides).generate(HF_PROMPTS, GREEDY, use_tqdm=False)
    llm = make_llm(path, tensor_parallel_size=2, **overrides)
    pids = worker_pids(llm.llm_engine)
    try:
        outs = llm.generate(HF_PROMPTS, GREEDY, use_tqdm=False)
        assert_matches_hf(outs, path, hf_greedy, f"{model} N=2 {mode}")
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in single]
        stats = llm.get_stats()
        if mode == "swap":
            assert stats.num_preemptions_swap > 0
        elif mode == "recompute":
            assert stats.num_preemptions_recompute > 0 and stats.num_preemptions_swap == 0
        assert_nothing_left_behind(llm)
        # the driver's KV cache holds its own heads: half of 2, or the one head replicated
        runner = llm.llm_engine.model_runner.runner
        assert runner.num_kv_heads == 1
        assert runner.model.model.layers[0].self_attn.num_heads == 2  # of 4 query heads
    finally:
        llm.shutdown()
    assert wait_gone(pids) == []


def test_tp2_forks_copy_blocks_and_prompt_logprobs_match_tp1(model_dir: ModelDirFactory) -> None:
    # n=2 forks a request's blocks, and its samples' first writes copy the shared last block
    # (copy-on-write, a block move every rank applies); prompt logprobs add a logits call for
    # the prompt's rows to the sampling one, each a gather of every rank's vocabulary slice
    path = model_dir("llama")
    forked = SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    prompts = HF_PROMPTS[:6]
    single = make_llm(path)
    expected = single.generate(prompts, forked, use_tqdm=False)
    expected_scores = single.generate(HF_PROMPTS[4], scored, use_tqdm=False)[0]
    llm = make_llm(path, tensor_parallel_size=2)
    executor, copies = llm.llm_engine.model_runner, []
    execute = executor.execute_model

    def recording(plan: Any, *args: Any) -> Any:
        copies.extend(plan.blocks_to_copy)
        return execute(plan, *args)

    executor.execute_model = recording
    try:
        outs = llm.generate(prompts, forked, use_tqdm=False)
        got_scores = llm.generate(HF_PROMPTS[4], scored, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    assert copies, "no copy-on-write block copy ran"
    tokens = [[c.token_ids for c in o.outputs] for o in outs]
    assert tokens == [[c.token_ids for c in o.outputs] for o in expected]
    assert got_scores.outputs[0].token_ids == expected_scores.outputs[0].token_ids
    assert expected_scores.prompt_logprobs is not None and got_scores.prompt_logprobs is not None
    assert len(got_scores.prompt_logprobs) == len(expected_scores.prompt_logprobs) > 200
    for got, want in zip(got_scores.prompt_logprobs[1:], expected_scores.prompt_logprobs[1:]):
        assert got is not None and want is not None and got.keys() == want.keys()
        assert all(abs(got[t].logprob - want[t].logprob) < 1e-4 for t in want)


def test_nodes_must_split_the_ranks_and_know_the_leader(model_dir: ModelDirFactory) -> None:
    args = EngineArgs(model=str(model_dir("llama")), tensor_parallel_size=2, num_nodes=3)
    with pytest.raises(ValueError, match=r"EngineArgs\.num_nodes"):
        args.create_engine_config()
    args = EngineArgs(model=str(model_dir("llama")), tensor_parallel_size=2, num_nodes=2)
    with pytest.raises(ValueError, match=r"EngineArgs\.distributed_init_method"):
        args.create_engine_config()


def test_the_step_message_encodes_every_attention_field_and_the_moves() -> None:
    # a field added to AttentionMetadata must be sent to the workers (channel.py refuses to
    # import otherwise); this names the set that is
    import dataclasses

    assert {f.name for f in dataclasses.fields(AttentionMetadata)} == ENCODED_METADATA_FIELDS
    plan = SchedulerOutput(
        blocks_to_swap_out=[(1, 2), (3, 4)], blocks_to_swap_in=[(5, 6)], blocks_to_copy=[]
    )
    moves, end = _decode_moves(torch.tensor([7, *_encode_moves(plan), 9]), 1)
    assert (moves.blocks_to_swap_out, moves.blocks_to_swap_in) == ([(1, 2), (3, 4)], [(5, 6)])
    assert moves.blocks_to_copy == [] and end == 1 + 3 + 6


# -- faults: a worker dies or hangs ----------------------------------------------------------


def async_engine(path: Path, **overrides: Any) -> AsyncLLMEngine:
    args = EngineArgs(
        model=str(path), device="cpu", dtype="float32", max_num_seqs=4, tensor_parallel_size=2,
        **overrides,
    )  # fmt: skip
    return AsyncLLMEngine.from_engine_args(args)


async def generate_until_dead(engine: AsyncLLMEngine, kill: Any) -> tuple[int, float]:
    """Stream a long request, `kill()` after its first output; (outputs seen, seconds from
    the kill until the stream failed with EngineDeadError)."""
    params = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)
    num_outputs, killed_at = 0, 0.0
    with pytest.raises(EngineDeadError):
        async for _ in engine.generate("Hello, my name is", params, request_id="doomed"):
            num_outputs += 1
            if num_outputs == 1:
                kill()
                killed_at = time.monotonic()
    return num_outputs, time.monotonic() - killed_at


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_worker_that_dies_or_hangs_mid_generation_kills_the_engine_cleanly(
    fault: str, model_dir: ModelDirFactory
) -> None:
    timeout_s = 3.0
    engine = async_engine(model_dir("llama"), distributed_timeout_s=timeout_s)
    (pid,) = worker_pids(engine.engine)
    sig = signal.SIGKILL if fault == "killed" else signal.SIGSTOP

    async def main() -> tuple[int, float]:
        result = await generate_until_dead(engine, lambda: os.kill(pid, sig))
        # dead for good: health says so, and a new request is refused at once
        assert engine.errored
        with pytest.raises(EngineDeadError):
            engine.check_health()
        with pytest.raises(EngineDeadError):
            await engine.add_request("late", "hi", SamplingParams(max_tokens=2))
        await engine.shutdown()
        return result

    num_outputs, seconds = asyncio.run(asyncio.wait_for(main(), 60))
    assert num_outputs < 1500
    # a death is seen at once; a hang when the driver's collective times out
    assert seconds < (5.0 if fault == "killed" else timeout_s + 10.0)
    assert wait_gone([pid]) == []
    cause = engine._dead.__cause__ if engine._dead is not None else None
    assert "tensor parallelism failed" in repr(cause)


def test_a_worker_dying_while_the_engine_is_idle_turns_it_dead(model_dir: ModelDirFactory) -> None:
    engine = async_engine(model_dir("llama"))
    (pid,) = worker_pids(engine.engine)

    async def main() -> None:
        out = [o async for o in engine.generate("hi", GREEDY, request_id="before")]
        assert out[-1].finished and not engine.errored
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not engine.errored and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert engine.errored  # what a server's health reports, with nothing in flight
        await engine.shutdown()

    asyncio.run(main())


# -- no worker outlives its engine -------------------------------------------------------------

_SCRIPT = """
import os, signal, sys, time
import torch
from asyncengine import LLM, SamplingParams

# Ctrl-C as a terminal's foreground job has it, even where this run's SIGINT is ignored (an `&`
# job: Python then keeps ignoring it, and the script ran to its end)
signal.signal(signal.SIGINT, signal.default_int_handler)

if __name__ == "__main__":  # not needed (the workers never re-run it), and still fine
    torch.set_num_threads(1)
    # a fixed cache: sized from free memory, it came out empty where other jobs held the RAM
    llm = LLM(model=sys.argv[1], device="cpu", dtype="float32", max_num_seqs=2,
              tensor_parallel_size=2, num_gpu_blocks_override=256, num_cpu_blocks_override=0)
    print("pids", *llm.llm_engine.model_runner.worker_pids, flush=True)
    ending = sys.argv[2]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(["hi"], params, use_tqdm=False)
    if ending == "shutdown":
        llm.shutdown()
        print("alive after shutdown:", [p.is_alive() for p in llm.llm_engine.model_runner.workers])
    elif ending != "exit":  # stopped by a signal while it generates
        print("generating", flush=True)
        llm.generate(["hi"] * 2, SamplingParams(max_tokens=100000, ignore_eos=True),
                     use_tqdm=False)
"""


# Ctrl-C in a terminal signals the whole process group; a supervisor's SIGTERM or SIGKILL
# reaches the engine's process alone
SIGNALS = {"ctrl-c": signal.SIGINT, "sigterm": signal.SIGTERM, "sigkill": signal.SIGKILL}


@pytest.mark.parametrize("ending", ["shutdown", "exit", *SIGNALS])
def test_no_worker_outlives_an_llm_script(
    ending: str, model_dir: ModelDirFactory, tmp_path: Path
) -> None:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(model_dir("llama")), ending],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert first.startswith("pids"), first + proc.communicate()[1]
    pids = [int(p) for p in first.split()[1:]]
    assert pids and all(map(is_running, pids))
    if ending in SIGNALS:
        assert proc.stdout.readline().strip() == "generating"
        time.sleep(0.5)  # mid-generation
        if ending == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, SIGNALS[ending])
    out, err = proc.communicate(timeout=60)
    if ending == "shutdown":
        assert "alive after shutdown: [False]" in out, err
    if ending in ("shutdown", "exit"):
        assert proc.returncode == 0, err
    elif ending == "ctrl-c":
        assert "KeyboardInterrupt" in err
    assert wait_gone(pids) == [], f"orphaned workers {pids} after {ending}"


# -- workers start however the user's program was started ------------------------------------

# no main guard: the workers must not re-run it (spawn re-imported `__main__` in each child)
_UNGUARDED_SCRIPT = """
import json
import torch
from asyncengine import LLM, SamplingParams

torch.set_num_threads(1)
llm = LLM(model={model!r}, device="cpu", dtype="float32", seed=0, block_size=16,
          max_num_seqs=16, tensor_parallel_size=2, num_gpu_blocks_override=256,
          num_cpu_blocks_override=0)
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
outs = llm.generate({prompts!r}, params, use_tqdm=False)
print("tokens", json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
llm.shutdown()
"""

LAUNCHES = ["stdin", "script", "python-c", "python-m"]  # python -m: a notebook kernel's way


@pytest.mark.parametrize("launch", LAUNCHES)
def test_workers_start_from_stdin_a_script_without_a_guard_c_and_m(
    launch: str, model_dir: ModelDirFactory, tmp_path: Path
) -> None:
    path = model_dir("llama")
    prompts = HF_PROMPTS[:3]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    single = make_llm(path).generate(prompts, params, use_tqdm=False)
    script = _UNGUARDED_SCRIPT.format(model=str(path), prompts=prompts)
    (tmp_path / "tp_job.py").write_text(script)
    command, stdin = {
        "stdin": (["-"], script),
        "script": ([str(tmp_path / "tp_job.py")], None),
        "python-c": (["-c", script], None),
        "python-m": (["-m", "tp_job"], None),
    }[launch]
    proc = subprocess.run(
        [sys.executable, *command],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("tokens ")]
    assert json.loads(line.removeprefix("tokens ")) == [o.outputs[0].token_ids for o in single]


# -- ranks on another node ---------------------------------------------------------------------


def start_node(path: Path, init_method: str, *flags: str) -> subprocess.Popen[str]:
    """`asyncengine worker` for node 1 of 2 (this host stands in for the other node)."""
    command = [
        sys.executable, "-m", "asyncengine.server.cli", "worker", "--node-rank", "1",
        "--model", str(path), "--device", "cpu", "--dtype", "float32",
        "--tensor-parallel-size", "2", "--num-nodes", "2",
        "--distributed-init-method", init_method, *flags,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)


def test_ranks_of_another_node_join_through_asyncengine_worker(
    model_dir: ModelDirFactory, hf_greedy: HFGreedy
) -> None:
    path = model_dir("qwen2")
    init_method = free_init_method()
    node = start_node(path, init_method, "--max-num-seqs", "16")
    llm = make_llm(path, tensor_parallel_size=2, num_nodes=2, distributed_init_method=init_method)
    try:
        assert llm.llm_engine.model_runner.worker_pids == []  # none of its own
        outs = llm.generate(HF_PROMPTS, GREEDY, use_tqdm=False)
        assert_matches_hf(outs, path, hf_greedy, "qwen2 N=2 over two nodes")
    finally:
        llm.shutdown()
    _, err = node.communicate(timeout=60)
    assert node.returncode == 0, err[-3000:]  # the leader shut it down


def test_a_node_started_with_other_flags_is_refused(model_dir: ModelDirFactory) -> None:
    path = model_dir("llama")
    init_method = free_init_method()
    node = start_node(path, init_method, "--block-size", "32")
    with pytest.raises(RuntimeError, match="different engine flags"):
        make_llm(path, tensor_parallel_size=2, num_nodes=2, distributed_init_method=init_method)
    _, err = node.communicate(timeout=60)
    assert node.returncode == 1, err[-3000:]


def test_one_rank_builds_the_plain_modules_and_no_process_group(model_dir: ModelDirFactory) -> None:
    # N=1 runs no parallel code at all: the same nn modules as before tensor parallelism
    import torch.distributed as dist
    from torch import nn

    from asyncengine.models import tp_layers
    from asyncengine.worker.model_runner import ModelRunner

    llm = make_llm(model_dir("qwen3"))
    runner = llm.llm_engine.model_runner
    assert type(runner) is ModelRunner and not dist.is_initialized()
    parallel = (
        tp_layers.RowParallelLinear,
        tp_layers.VocabParallelEmbedding,
        tp_layers.ParallelLMHead,
    )
    assert not any(isinstance(m, parallel) for m in runner.model.modules())
    assert type(runner.model.model.embed_tokens) is nn.Embedding


def test_the_leaderworkerset_example_gives_every_node_the_same_engine_flags() -> None:
    import yaml

    from asyncengine.server.cli import build_parser, engine_args_from

    path = Path(__file__).parents[1] / "deploy/kubernetes/tensor-parallel/leaderworkerset.yaml"
    spec = yaml.safe_load(path.read_text())["spec"]["leaderWorkerTemplate"]
    env = {"$(LWS_LEADER_ADDRESS)": "leader.example", "$(LWS_WORKER_INDEX)": "1"}

    def parsed(template: dict[str, Any], command: str) -> tuple[Any, dict[str, Any]]:
        (container,) = template["spec"]["containers"]
        args = []
        for arg in container["args"]:
            for name, value in env.items():
                arg = arg.replace(name, value)
            args.append(arg)
        return build_parser().parse_args([command, *args]), container

    leader, leader_container = parsed(spec["leaderTemplate"], "serve")
    worker, worker_container = parsed(spec["workerTemplate"], "worker")
    assert worker_container["command"] == ["asyncengine", "worker"] and worker.node_rank == 1
    assert engine_args_from(leader) == engine_args_from(worker)
    args = engine_args_from(leader)
    assert args.num_nodes == spec["size"]
    gpus = int(leader_container["resources"]["limits"]["nvidia.com/gpu"])
    assert args.tensor_parallel_size == gpus * spec["size"]
    assert args.distributed_init_method == "tcp://leader.example:29500"
