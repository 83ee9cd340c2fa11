"""`asyncengine.processes.start_process`: children that never re-run the user's `__main__`,
while a plain multiprocessing spawn beside them still gets it. (The tensor-parallel workers
it starts are tested from stdin, scripts, -c and -m in test_tensor_parallel.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncengine.processes import start_process

# a marker the parent prints once: printed twice, a child ran the script again
_UNGUARDED = """
import time
from asyncengine.processes import start_process

print("script ran", flush=True)
process = start_process(time.sleep, (0,), name="child")
process.join()
print("exit code", process.exitcode, flush=True)
"""

# start_process and plain spawns of a __main__ function, from several threads at once
_BESIDE_PLAIN_SPAWN = """
import multiprocessing, sys, threading, time
from asyncengine.processes import start_process

def from_main():
    sys.exit(7)

def plain():
    process = multiprocessing.get_context("spawn").Process(target=from_main)
    process.start()
    return process

if __name__ == "__main__":
    processes = []
    def start(make):
        processes.append(make())
    threads = [threading.Thread(target=start, args=(plain,)) for _ in range(3)]
    threads += [threading.Thread(target=start, args=(lambda: start_process(time.sleep, (0,)),))
                for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for process in processes:
        process.join()
    print("exit codes", *sorted(p.exitcode for p in processes), flush=True)
"""


def run_python(
    args: list[str], cwd: Path, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], input=stdin, capture_output=True, text=True, cwd=cwd, timeout=60
    )


@pytest.mark.parametrize("launch", ["stdin", "script"])
def test_a_child_runs_its_target_without_the_unguarded_main(launch: str, tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(_UNGUARDED)
    if launch == "stdin":
        proc = run_python(["-"], tmp_path, stdin=_UNGUARDED)
    else:
        proc = run_python([str(tmp_path / "job.py")], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["script ran", "exit code 0"], proc.stderr


def test_a_plain_spawn_in_other_threads_still_takes_main_along(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(_BESIDE_PLAIN_SPAWN)
    proc = run_python([str(script)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["exit", "codes", "0", "0", "0", "7", "7", "7"], proc.stderr


def test_the_returned_process_is_started_and_named() -> None:
    process = start_process(time.sleep, (0.2,), name="asyncengine-test-child", daemon=True)
    assert process.pid is not None and process.pid != os.getpid()
    assert process.name == "asyncengine-test-child" and process.daemon
    process.join(30)
    assert process.exitcode == 0


def test_a_target_defined_in_main_is_refused() -> None:
    def target() -> None: ...

    target.__module__ = "__main__"
    with pytest.raises(ValueError, match="defined in __main__"):
        start_process(target)
