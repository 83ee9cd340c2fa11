"""The CPU ops' first build is announced (issue 25): a log line before the compiler runs, with the
seconds it may take, and one after, with the seconds it took; a cached build says nothing.

The compiler is a stand-in that writes its outputs: what is checked is the announcement, not
C++ (tests/test_cpu_ops.py builds the real thing)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from asyncengine.worker import cpu_ops

FAKE_COMPILER = """#!/bin/sh
while [ $# -gt 0 ]; do
  if [ "$1" = -o ]; then : > "$2"; fi
  shift
done
"""


def test_a_build_is_announced_before_the_compiler_runs_and_timed_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiler = tmp_path / "fake-c++"
    compiler.write_text(FAKE_COMPILER)
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    popen = subprocess.Popen

    with capture_logs() as records:

        def recorded_popen(*args: Any, **kwargs: Any) -> Any:
            records.append({"event": "compiler_ran"})  # in order with the log lines
            return popen(*args, **kwargs)

        monkeypatch.setattr(subprocess, "Popen", recorded_popen)
        library, was_built = cpu_ops._build()
        monkeypatch.setattr(subprocess, "Popen", popen)
        assert was_built and library.is_file()
        num_first = len(records)
        assert cpu_ops._build() == (library, False)  # cached: loaded as is, nothing said

    events = [r["event"] for r in records]
    assert num_first == len(records)
    assert events[0] == "cpu_ops_compiling" and events[-1] == "cpu_ops_compiled", events
    assert set(events[1:-1]) == {"compiler_ran"}, events
    compiling, compiled = records[0], records[-1]
    assert isinstance(compiling["expected_s"], int) and compiling["expected_s"] >= 1
    assert compiling["library"] == str(library) and "later starts" in compiling["note"]
    assert isinstance(compiled["seconds"], float)
