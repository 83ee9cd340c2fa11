"""KV cache sizing: the memory rule, the start-up failures with their numbers, the practice
warnings. The rule is pure arithmetic (tested with made-up devices); the CPU path runs for real
on a tiny model with the host memory it sees replaced; the CUDA path runs only with a GPU."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from asyncengine import EngineArgs
from asyncengine.engine.llm_engine import LLMEngine
from asyncengine.worker import kv_sizing
from asyncengine.worker.kv_sizing import GiB, MemoryBreakdown
from asyncengine.worker.model_runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MiB = 1 << 20


def breakdown(**overrides: Any) -> MemoryBreakdown:
    """An 80 GiB device at 0.9: 72 GiB budget, 17 GiB used, 55 GiB of 2 MiB blocks."""
    values: dict[str, Any] = {
        "device": "cuda",
        "total_bytes": 80 * GiB,
        "gpu_memory_utilization": 0.9,
        "weights_bytes": 14 * GiB,
        "activation_peak_bytes": 2 * GiB,
        "non_torch_bytes": 1 * GiB,
        "swap_bytes": 0,
        "bytes_per_block": 2 * MiB,
        "is_activation_measured": True,
    }
    return MemoryBreakdown(**{**values, **overrides})


def engine_args(model_dir: Path, **overrides: Any) -> EngineArgs:
    values: dict[str, Any] = {
        "model": str(model_dir),
        "device": "cpu",
        "max_model_len": 256,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
    }
    return EngineArgs(**{**values, **overrides})


def test_blocks_are_total_times_utilization_minus_weights_activations_non_torch() -> None:
    b = breakdown()
    assert b.kv_cache_bytes == 72 * GiB - 17 * GiB
    assert b.num_blocks == 55 * 512
    assert breakdown(swap_bytes=5 * GiB).num_blocks == 50 * 512  # the CPU device's swap pool
    assert breakdown(weights_bytes=80 * GiB).num_blocks == 0  # never negative


def test_start_up_fails_with_the_numbers_when_one_max_len_request_does_not_fit() -> None:
    b = breakdown(weights_bytes=71 * GiB + 1000 * MiB)  # leaves ~ -20 GiB: nothing
    kv_sizing.check_one_request_fits(
        breakdown().describe(), 2048, 16, 32768
    )  # 2048 x 16 = 32768: fits
    with pytest.raises(RuntimeError) as error:
        kv_sizing.check_one_request_fits(b.describe(), 2047, 16, 32768)
    message = str(error.value)
    for text in ("max_model_len (32768)", "2047 blocks of 16 tokens", "2048 blocks are needed",
                 "gpu_memory_utilization 0.9", "weights 71.977 GiB", "activation peak 2.0 GiB",
                 "non-torch 1.0 GiB", "at most 32752"):  # fmt: skip
        assert text in message, (text, message)
    # a sliding window holds the window (plus the block it starts in), not max_model_len
    kv_sizing.check_one_request_fits(b.describe(), 65, 16, 32768, sliding_window=1024)
    with pytest.raises(RuntimeError):
        kv_sizing.check_one_request_fits(b.describe(), 64, 16, 32768, sliding_window=1024)


def test_swap_pool_is_capped_by_host_memory_with_a_start_up_error() -> None:
    blocks = kv_sizing.num_swap_blocks(4 * GiB, 2 * MiB, 10**9, 32 * GiB, 64 * GiB, True)
    assert blocks == 2048
    assert kv_sizing.num_swap_blocks(4 * GiB, 2 * MiB, 100, 32 * GiB, 64 * GiB, True) == 100
    # 16 GiB pinned, with 20 GiB available of which 6.4 GiB are kept for the process and OS
    with pytest.raises(RuntimeError, match=r"swap_space asks for 16.00 GiB of pinned host") as e:
        kv_sizing.num_swap_blocks(16 * GiB, 2 * MiB, 10**9, 20 * GiB, 64 * GiB, True)
    assert "only 20.00 GiB are available" in str(e.value) and "0 disables" in str(e.value)
    assert kv_sizing.num_swap_blocks(0, 2 * MiB, 10**9, 0, 64 * GiB, True) == 0


def test_memory_held_by_other_processes_is_refused_before_sizing() -> None:
    kv_sizing.check_device_free(73 * GiB, 80 * GiB, 0.9)
    busy = r"only 60.00 GiB were free .* \(20.00 GiB held by other processes and this one"
    with pytest.raises(RuntimeError, match=busy):
        kv_sizing.check_device_free(60 * GiB, 80 * GiB, 0.9)


def test_cpu_device_sizes_from_available_host_memory(
    model_dir: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a 1 GiB host with 200 MiB available: budget 0.9 GiB, "used" 824 MiB (weights included)
    monkeypatch.setattr(kv_sizing, "host_memory", lambda: (200 * MiB, 1 * GiB))
    args = engine_args(
        model_dir("llama"), max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=256,
        swap_space=16 / 1024,
    )  # fmt: skip
    runner = ModelRunner(args.create_engine_config())
    per_block = runner.bytes_per_block()
    with capture_logs() as logs:
        num_gpu, num_cpu = runner.determine_num_blocks()
    assert num_cpu == 16 * MiB // per_block
    (line,) = [r for r in logs if r["event"] == "kv_cache_sized"]
    assert (line["num_gpu_blocks"], line["num_cpu_blocks"]) == (num_gpu, num_cpu)
    estimate = runner._estimate_cpu(per_block, num_cpu * per_block)
    budget = int(0.9 * GiB) - (GiB - 200 * MiB)
    expected = (budget - estimate.activation_peak_bytes - 16 * MiB) // per_block
    assert num_gpu == expected > 0 and not line["capped_at_max_useful"]
    assert line["swap_in_budget_gib"] == round(16 * MiB / GiB, 3)
    assert not line["activation_measured"]


def test_start_up_fails_on_a_host_without_room_and_overrides_always_win(
    model_dir: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kv_sizing, "host_memory", lambda: (50 * MiB, 1 * GiB))
    path = model_dir("llama")
    with pytest.raises(RuntimeError, match=r"cannot hold one max_model_len \(256\) request"):
        LLMEngine.from_engine_args(engine_args(path, swap_space=0))
    with pytest.raises(RuntimeError, match="swap_space asks for"):
        LLMEngine.from_engine_args(engine_args(path, swap_space=1.0))
    engine = LLMEngine.from_engine_args(
        engine_args(path, num_gpu_blocks_override=3, num_cpu_blocks_override=5)
    )
    assert (engine.block_manager.num_gpu_blocks, engine.block_manager.num_cpu_blocks) == (3, 5)


def test_a_fixed_kv_cache_size_past_what_running_requests_use_is_kept_for_the_prefix_cache(
    model_dir: Callable[..., Path],
) -> None:
    """8 requests of 256 tokens use at most 128 blocks; the other blocks asked for hold cached
    prefixes of finished requests, so they are made unless prefix caching is off."""
    args = engine_args(model_dir("llama"), num_cpu_blocks_override=0)
    per_block = ModelRunner(args.create_engine_config()).bytes_per_block()
    sized = dataclasses.replace(args, kv_cache_memory_bytes=300 * per_block)
    assert LLMEngine.from_engine_args(sized).block_manager.num_gpu_blocks == 300
    uncached = dataclasses.replace(sized, enable_prefix_caching=False)
    assert LLMEngine.from_engine_args(uncached).block_manager.num_gpu_blocks == 8 * 256 // 16


def test_a_fixed_kv_cache_size_ignores_what_other_processes_hold(
    model_dir: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shared host with 50 MiB available still gets the KV cache asked for, no more."""
    monkeypatch.setattr(kv_sizing, "host_memory", lambda: (50 * MiB, 1 * GiB))
    args = engine_args(model_dir("llama"), num_cpu_blocks_override=0)
    per_block = ModelRunner(args.create_engine_config()).bytes_per_block()
    sized = dataclasses.replace(args, kv_cache_memory_bytes=40 * per_block + per_block // 2)
    engine = LLMEngine.from_engine_args(sized)
    assert engine.block_manager.num_gpu_blocks == 40
    # a size that cannot hold one max_model_len (256 = 16 blocks) request fails at start-up
    with pytest.raises(RuntimeError, match=r"kv_cache_memory_bytes \d+ at \d+ bytes per block"):
        LLMEngine.from_engine_args(dataclasses.replace(args, kv_cache_memory_bytes=15 * per_block))
    both = dataclasses.replace(sized, num_gpu_blocks_override=3)
    assert LLMEngine.from_engine_args(both).block_manager.num_gpu_blocks == 3  # the override wins


def test_profile_forward_runs_the_largest_batches(model_dir: Callable[..., Path]) -> None:
    """The profile batches go through the real input path (on CPU there is no peak to read)."""
    args = engine_args(model_dir("llama"), max_num_seqs=5, max_num_batched_tokens=37)
    assert ModelRunner(args.create_engine_config()).profile_forward() == 0


def test_configuration_against_practice_warns_once_per_problem(
    model_dir: Callable[..., Path],
) -> None:
    path = model_dir("llama")

    def checks(**overrides: Any) -> list[str]:
        config = engine_args(path, **overrides).create_engine_config()
        return [w["check"] for w in kv_sizing.practice_warnings(config)]

    assert checks() == []
    assert checks(expected_concurrency=6) == []  # 8 seqs for a peak of 6: 1.33x
    assert checks(expected_concurrency=2) == ["max_num_seqs"]  # 4x: KV for nobody
    assert checks(expected_concurrency=20) == ["max_num_seqs"]  # peak requests would queue
    assert checks(gpu_memory_utilization=0.95) == ["gpu_memory_utilization"]
    assert checks(block_size=512, max_model_len=1024) == ["block_size"]
    assert checks(block_size=8) == ["block_size"]
    with capture_logs() as logs:
        LLMEngine.from_engine_args(
            engine_args(path, expected_concurrency=100, num_gpu_blocks_override=64)
        )
    (warning,) = [r for r in logs if r["event"] == "config_warning"]
    assert warning["log_level"] == "warning" and "120-150" in warning["advice"]
    with pytest.raises(ValueError, match="expected_concurrency"):
        engine_args(path, expected_concurrency=0).create_engine_config()


def test_cuda_breakdown_is_wired_from_the_allocator_readings(
    model_dir: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA arithmetic on made-up allocator readings (the real ones need a GPU, below)."""
    runner = ModelRunner(engine_args(model_dir("llama")).create_engine_config())
    # before loading: 75 GiB free of 80, 1 GiB reserved, 0.5 GiB allocated
    runner._baseline = (75 * GiB, 80 * GiB, 1 * GiB, GiB // 2)
    readings = {"memory_allocated": GiB // 2 + 14 * GiB, "memory_reserved": 16 * GiB,
                "mem_get_info": (80 * GiB - 20 * GiB, 80 * GiB)}  # fmt: skip
    for name, reading in readings.items():
        monkeypatch.setattr(torch.cuda, name, lambda reading=reading: reading)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(runner, "profile_forward", lambda: 3 * GiB)
    b = runner._profile_cuda(2 * MiB)
    assert (b.weights_bytes, b.activation_peak_bytes) == (14 * GiB, 3 * GiB)
    # outside torch's allocator: 20 - 16 = 4 GiB now, 5 - 1 = 4 GiB before: no growth
    assert b.non_torch_bytes == 0 and b.swap_bytes == 0 and b.is_activation_measured
    readings["mem_get_info"] = (80 * GiB - 21 * GiB, 80 * GiB)  # 1 GiB more outside torch
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: readings["mem_get_info"])
    assert runner._profile_cuda(2 * MiB).non_torch_bytes == 1 * GiB
    runner._baseline = (70 * GiB, 80 * GiB, 1 * GiB, GiB // 2)  # others hold 10 GiB: refused
    with pytest.raises(RuntimeError, match=r"gpu_memory_utilization 0\.9 asks for 72\.00 GiB"):
        runner._profile_cuda(2 * MiB)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_sizing_measures_the_profile_and_fits_the_budget(
    model_dir: Callable[..., Path],
) -> None:
    args = engine_args(model_dir("llama"), device="cuda", gpu_memory_utilization=0.5)
    runner = ModelRunner(args.create_engine_config())
    with capture_logs() as logs:
        num_gpu, _ = runner.determine_num_blocks()
    (line,) = [r for r in logs if r["event"] == "kv_cache_sized"]
    assert line["activation_measured"] and line["activation_peak_gib"] > 0
    _, total = torch.cuda.mem_get_info()
    assert num_gpu * runner.bytes_per_block() <= 0.5 * total
