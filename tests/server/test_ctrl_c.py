"""Ctrl-C stops the test suite: one ends a run using the shared test servers within seconds,
leaving no server, engine or worker process behind; a second one ends any teardown at once.

Each test runs pytest on ctrl_c_target.py in a process group of its own, as a terminal's
foreground job, and interrupts it: a Ctrl-C signals the whole group, a `kill -INT` pytest alone.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from interrupts import descendant_pids, describe, start_time

TARGET = Path(__file__).with_name("ctrl_c_target.py")
STARTED_TIMEOUT_S = 300.0  # the shared servers start on first use, four at once
# the bound on an interrupted run's end: killing the servers is instant, and what is left is
# pytest's report and interpreter exit (3 s on these 2 cores at load 2, 5-7 s at load 8)
ENDED_WITHIN_S = 15.0


_PYTEST_WITH_SIGINT = (
    "import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.exit(pytest.console_main())"
)


class Run:
    """pytest on one test of ctrl_c_target.py; its output lines arrive on `lines`."""

    def __init__(self, test_name: str) -> None:
        # SIGINT as in a terminal's foreground job, even where this run's is ignored (an `&` job)
        command = [sys.executable, "-c", _PYTEST_WITH_SIGINT, "-q", "-s", "-p", "no:cacheprovider"]
        self.proc = subprocess.Popen(
            [*command, f"{TARGET}::{test_name}"],
            cwd=Path(__file__).parents[2],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, marker: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                pytest.fail(f"pytest ended before {marker!r}:\n{''.join(self.output)}")
            if marker in line:
                return
        self.kill()
        pytest.fail(f"no {marker!r} after {timeout} s:\n{''.join(self.output)}")

    def interrupt(self, how: str) -> None:
        if how == "ctrl-c":
            os.killpg(self.proc.pid, signal.SIGINT)
        else:
            self.proc.send_signal(signal.SIGINT)

    def seconds_to_end(self, timeout: float) -> float:
        """How long until pytest exited (killing all it started past `timeout`, and failing)."""
        started = time.monotonic()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"pytest still running {timeout} s after the interrupt")
        return time.monotonic() - started

    def kill(self) -> None:
        for pid in [self.proc.pid, *descendant_pids(self.proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()


def processes_under(pid: int) -> dict[int, int | None]:
    """pid -> start time of each process under `pid`."""
    return {child: start_time(child) for child in descendant_pids(pid)}


def still_running(processes: dict[int, int | None], timeout: float = 5.0) -> list[int]:
    """Those of `processes` still running (the same pid and start time) after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        left = [pid for pid, started in processes.items() if start_time(pid) == started]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@pytest.mark.parametrize(
    ("server", "how"),
    # a stopped server stands for one too loaded or wedged to answer its calls or its SIGTERM
    [("serving", "ctrl-c"), ("stopped", "kill-int-pytest")],
)
def test_one_interrupt_ends_a_run_on_the_shared_servers(server: str, how: str) -> None:
    run = Run(f"test_streams_from_{'a_stopped' if server == 'stopped' else 'the'}_shared_server")
    run.wait_for("streaming", STARTED_TIMEOUT_S)
    processes = processes_under(run.proc.pid)
    # the shared servers, each with its engine process (and multiprocessing's resource tracker)
    assert len(processes) >= 8, processes
    run.interrupt(how)
    seconds = run.seconds_to_end(60.0)
    output = "".join(run.output)
    assert seconds < ENDED_WITHIN_S, f"{seconds:.1f} s:\n{output}"
    left = still_running(processes)
    assert left == [], "\n".join([*describe(left), output])
    assert run.proc.returncode == pytest.ExitCode.INTERRUPTED, output


def test_a_second_interrupt_ends_the_run_at_once() -> None:
    # the first leaves the inner `with`, whose exit waits for its thread (120 s)
    run = Run("test_two_threads_left_waiting")
    run.wait_for("waiting", STARTED_TIMEOUT_S)
    run.interrupt("ctrl-c")
    time.sleep(2.0)
    assert run.proc.poll() is None, "".join(run.output)
    run.interrupt("ctrl-c")
    seconds = run.seconds_to_end(30.0)
    assert seconds < ENDED_WITHIN_S, f"{seconds:.1f} s:\n{''.join(run.output)}"
    assert run.proc.returncode == pytest.ExitCode.INTERRUPTED
