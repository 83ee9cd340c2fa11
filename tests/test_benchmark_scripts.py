"""The benchmark scripts that run the model start and finish on a tiny load, as their users run
them: `python benchmarks/NAME.py` from the checkout, the benchmarks folder first on the path
(where a script named like a package another library probes for, as `kernels.py` was for
transformers' hub kernels, broke both scripts before either measured anything)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_json(script: str, *args: str) -> dict:
    done = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args, "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.usefixtures("one_torch_thread")
def test_lora_benchmark_runs_mixed_and_merged() -> None:
    report = run_json(
        "lora.py", "--quick", "--adapters", "0,2", "--max-loras", "2", "--threads", "1"
    )
    systems = {(r["system"], r["num_adapters"]) for r in report["results"]}
    assert systems == {("mixed", 0), ("mixed", 2), ("merged", 2)}
    assert all(r["tokens_per_s"] > 0 for r in report["results"])
    assert report["machine"]["threads"] == 1


@pytest.mark.usefixtures("one_torch_thread")
def test_speculative_benchmark_runs_both_loads() -> None:
    report = run_json(
        "speculative.py", "--batches", "1", "--rounds", "1", "--repeat", "1", "--output-len", "16",
        "--threads", "1",
    )  # fmt: skip
    loads = {row["load"] for row in report["results"]}
    assert loads == {"grounded", "mixed"}
    for row in report["results"]:
        assert row["tok_s"] > 0 and row["spec_tok_s"] > 0
        assert row["same_tokens"], row  # greedy: speculation changes no token
        if row["load"] == "grounded":
            assert 0 <= row["copied"] <= 1
        else:
            assert row["copied"] is None


def test_cpu_kernels_benchmark_runs_its_attention_tables() -> None:
    report = run_json(
        "cpu_kernels.py", "--only", "attention", "--dtypes", "float32", "--block-sizes", "16",
        "--num-seqs", "4", "--repeats", "1",
    )  # fmt: skip
    assert {r["candidate"] for r in report["attention"]} >= {"padded + masked SDPA"}
    report = run_json(
        "cpu_kernels.py", "--only", "prefill", "--dtypes", "float32", "--prompt-lens", "40",
        "--prefill-seqs", "2", "--repeats", "1",
    )  # fmt: skip
    (sdpa, *ops) = report["prefill"]
    assert sdpa["candidate"] == "gather + SDPA per sequence"
    for row in ops:  # the C++ op, where it builds: the same attention
        assert row["max_abs_diff_vs_sdpa"] < 1e-4 and row["gflops"] > 0


@pytest.mark.usefixtures("one_torch_thread")
def test_chunk_budget_benchmark_serves_and_generates_at_each_budget(tmp_path: Path) -> None:
    from asyncengine.testing import make_random_model

    model = make_random_model(tmp_path / "model", "llama")
    report = run_json(
        "chunk_budget.py", "--model", str(model), "--budgets", "64,128", "--concurrency", "2",
        "--waves", "2", "--prompt-len", "40", "--output-len", "8", "--offline-requests", "4",
        "--threads", "1", "--max-num-seqs", "4", "--max-model-len", "128",
    )  # fmt: skip
    rows = {(r["budget"], r["concurrency"]): r for r in report["summary"]}
    assert set(rows) == {(64, 2), (64, "offline"), (128, 2), (128, "offline")}
    for (_, n), row in rows.items():
        if n == "offline":
            assert row["offline_tokens_per_s"] > 0
        else:
            assert row["tokens_per_s"] > 0 and 0 < row["ttft_p50_ms"] <= row["e2e_p50_ms"]
