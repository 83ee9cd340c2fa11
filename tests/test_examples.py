"""examples/: the founding article's three snippets, run as scripts (vLLM code with only the
imports changed), on a tiny random model where the script would fetch a hub id."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
PROMPTS = ["Hello, my name is", "The capital of France is", "The future of AI is"]


def run_example(name: str, *args: str) -> str:
    """Run examples/`name` as a user would; return its stdout (it must exit 0)."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_examples_import_only_asyncengine_and_the_standard_library() -> None:
    scripts = sorted(EXAMPLES.glob("*.py"))
    assert [p.name for p in scripts] == [
        "async_streaming.py",
        "block_manager.py",
        "offline_inference.py",
    ]
    for script in scripts:
        tree = ast.parse(script.read_text())
        modules = {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        }
        modules |= {
            node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
        }
        assert {m.split(".")[0] for m in modules} <= {"asyncengine", "asyncio", "sys"}, script


def test_block_manager_snippet_admits_a_sequence_and_frees_its_table() -> None:
    assert run_example("block_manager.py").splitlines() == [
        "2000 tokens -> 4 blocks: [0, 1, 2, 3]",
        "free GPU blocks: 1020 of 1024",
        "after free: 1024 of 1024",
        "can_allocate(1025 blocks): AllocStatus.NEVER",
    ]


def test_offline_snippet_generates_for_every_prompt_in_order(model_dir) -> None:
    lines = run_example("offline_inference.py", str(model_dir("llama"))).splitlines()
    assert [line.split(", Generated text: ")[0] for line in lines] == [
        f"Prompt: {p!r}" for p in PROMPTS
    ]


def test_async_snippet_streams_three_prompts_at_once(model_dir) -> None:
    lines = run_example("async_streaming.py", str(model_dir("llama"))).splitlines()
    ids = [f"request-{i}" for i in range(3)]
    finished = [line.split()[0] for line in lines if " finished (" in line]
    assert sorted(finished) == ids
    # streamed concurrently, not one after another: the requests' streams overlap in time
    spans = {i: [n for n, line in enumerate(lines) if line.startswith(i)] for i in ids}
    assert any(
        spans[a][0] < spans[b][-1] and spans[b][0] < spans[a][-1]
        for a in ids
        for b in ids
        if a != b
    )
