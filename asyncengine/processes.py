"""Start the engine's own child processes so that they never re-run the user's `__main__`.

multiprocessing's spawn records the parent's `__main__` (`spawn.get_preparation_data`: its
`__spec__.name`, else its `__file__`) and re-imports it in the child before unpickling the
target, so that targets defined in `__main__` resolve. The engine's targets are module-level
functions of asyncengine, so that re-import only does harm: from standard input the child
looks for a file named `<stdin>` (FileNotFoundError); from a script or `python -m` module
without an `if __name__ == "__main__":` guard, the child runs the user's script again, which
builds another engine and starts processes during bootstrapping (RuntimeError); from a
notebook (`python -m ipykernel_launcher`), it imports the kernel's launcher once more.
`start_process` starts a spawn-context process whose child skips that step.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.spawn
import threading
from collections.abc import Callable
from multiprocessing.context import SpawnProcess
from typing import Any

# the keys of the preparation data that make a spawned child re-import the parent's __main__
_MAIN_KEYS = ("init_main_from_name", "init_main_from_path")

_local = threading.local()
_install_lock = threading.Lock()


def start_process(
    target: Callable[..., object],
    args: tuple[Any, ...] = (),
    *,
    name: str | None = None,
    daemon: bool = False,
) -> SpawnProcess:
    """Start `target(*args)` in a new spawned process (not a fork) and return it, started.

    The child imports `target`'s module and unpickles `args`, but not the parent's
    `__main__`, so this works from a script without a main guard, from standard input,
    `python -c`, `python -m` and a notebook or REPL. Hence `target` and everything in `args`
    must be importable without `__main__`: a target defined there is refused (ValueError).
    The returned process is an ordinary `multiprocessing` one (`pid`, `sentinel`, `join`,
    `terminate`, `exitcode`).

    Safe to call from any thread, at the same time too: what the child is told to skip is
    decided per calling thread, so a plain `multiprocessing` spawn running at the same time in
    another thread still takes `__main__` along, and the `__main__` module is never altered.
    """
    if getattr(target, "__module__", None) in ("__main__", "__mp_main__"):
        raise ValueError(
            f"{target!r} is defined in __main__, which start_process does not send to the "
            "child: give it a module of its own"
        )
    _install()
    process = multiprocessing.get_context("spawn").Process(
        target=target, args=args, name=name, daemon=daemon
    )
    _local.is_without_main = True
    try:
        process.start()
    finally:
        _local.is_without_main = False
    return process


def _install() -> None:
    """Wrap spawn's `get_preparation_data` once: unchanged, except in a thread inside
    `start_process`, where it leaves out the keys that re-import `__main__` in the child."""
    with _install_lock:
        original = multiprocessing.spawn.get_preparation_data
        if getattr(original, "_is_asyncengine_wrapper", False):
            return

        def get_preparation_data(name: str) -> dict[str, Any]:
            data: dict[str, Any] = original(name)
            if getattr(_local, "is_without_main", False):
                for key in _MAIN_KEYS:
                    data.pop(key, None)
            return data

        get_preparation_data._is_asyncengine_wrapper = True  # type: ignore[attr-defined]
        multiprocessing.spawn.get_preparation_data = get_preparation_data
