"""tests/failure_reports.py: a report that CPython 3.11's ast bug breaks is one failure, and the
run goes on (without the plugin, pytest stops at INTERNALERROR)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_TESTS = Path(__file__).parent
_BROKEN_FILE = "test_broken_ast.py"

# ast.parse raising as CPython 3.11 can (python/cpython#106905) while the failure is reported
_BROKEN_AST = """
import ast

import pytest


def _parse(*args, **kwargs):
    raise SystemError("AST constructor recursion depth mismatch (before=78, after=133)")


@pytest.fixture
def broken_ast():
    original = ast.parse
    yield
    ast.parse = original


def test_fails(broken_ast):
    ast.parse = _parse
    assert 1 == 2


def test_passes():
    pass
"""


def _run(tmp_path: Path, *plugin: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / _BROKEN_FILE).write_text(_BROKEN_AST)
    env = {**os.environ, "PYTHONPATH": str(_TESTS)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin, _BROKEN_FILE],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_without_the_plugin_the_ast_bug_ends_the_session(tmp_path: Path) -> None:
    result = _run(tmp_path)
    assert result.returncode == pytest.ExitCode.INTERNAL_ERROR, result.stdout
    assert "INTERNALERROR" in result.stdout


def test_with_it_the_failure_is_reported_and_the_run_goes_on(tmp_path: Path) -> None:
    result = _run(tmp_path, "-p", "failure_reports")
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, result.stdout
    assert "INTERNALERROR" not in result.stdout
    assert "1 failed, 1 passed" in result.stdout
    assert "could not draw this failure's traceback" in result.stdout
    assert "assert 1 == 2" in result.stdout
