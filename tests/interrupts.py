"""Ctrl-C during a test run, and the processes it started (read from /proc, Linux).

The first SIGINT runs the callbacks given to `on_first_interrupt` (the subprocess servers are
killed there: a test waiting on one of their calls then fails at once, where it would wait out
the call's deadline) and raises KeyboardInterrupt as Python's own handler does: pytest tears
down and reports. A second SIGINT kills every process under pytest and exits at once (code 2,
pytest's "interrupted"), however long the teardown would take.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType

_callbacks: list[Callable[[], None]] = []
_num_interrupts = 0
_pytest_pid: int | None = None  # a forked child inherits the handler, not the role
_EXIT_INTERRUPTED = 2  # pytest.ExitCode.INTERRUPTED


def on_first_interrupt(callback: Callable[[], None]) -> None:
    """Run `callback` on the first SIGINT, in the main thread, before KeyboardInterrupt is
    raised; it must be quick and must not wait for processes."""
    _callbacks.append(callback)


def install() -> None:
    """Take over SIGINT for this process (from the main thread), unless it is ignored: as
    Python does, a run started with SIGINT ignored (a shell script's `&` job) keeps ignoring
    it, rather than ignoring it until this call and obeying it after."""
    global _pytest_pid
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return
    _pytest_pid = os.getpid()
    signal.signal(signal.SIGINT, _on_sigint)


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    global _num_interrupts
    if os.getpid() != _pytest_pid:
        raise KeyboardInterrupt
    _num_interrupts += 1
    if _num_interrupts == 1:
        for callback in _callbacks:
            callback()
        raise KeyboardInterrupt
    sys.stderr.write("\nsecond interrupt: killing what the run started, exiting now\n")
    for pid in descendant_pids(os.getpid()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT_INTERRUPTED)


def descendant_pids(pid: int) -> list[int]:
    """The processes under `pid` now: its children, theirs, and so on."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None:
                children.setdefault(int(stat[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot), or None once it is gone or a zombie: with
    the pid, it names one process even after the pid is reused."""
    stat = _stat(pid)
    if stat is None or stat[0] in ("Z", "X"):
        return None
    return int(stat[19])


def describe(pids: list[int]) -> list[str]:
    """`pid: command line` of each (for failure messages)."""
    lines = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            command = "(gone)"
        lines.append(f"{pid}: {command[:200]}")
    return lines


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command's name (state first), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except (OSError, IndexError):
        return None
