"""What test_ctrl_c.py interrupts, in a pytest of its own (no `test_` prefix: the suite never
collects it). Each test prints a line once it is where the Ctrl-C is to land, then waits.

They wait as test_fuzz.py does, in `with pool, Bystander(...)`: an interrupted test first
leaves each `with`, and each exit waits for its thread's call to end.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .utils import ServerProcess, greedy_request, stubs


def stream_until_interrupted(server: ServerProcess, stop_the_server: bool = False) -> None:
    """Streams from `server` in a thread, one after another; with `stop_the_server`, SIGSTOP
    it once the first is under way (a server too loaded or wedged to answer in time)."""
    started = []

    def stream() -> None:
        with server.channel() as channel:
            generation, _ = stubs(channel)
            while True:  # each to the model's length
                for _ in generation.GenerateStream(greedy_request("Hello", None), timeout=60):
                    started.append(True)

    with ThreadPoolExecutor(1) as pool:
        pool.submit(stream)
        while not started:
            time.sleep(0.01)
        if stop_the_server:
            os.kill(server.proc.pid, signal.SIGSTOP)
        print("streaming", flush=True)
        time.sleep(600)


def test_streams_from_the_shared_server(server_pool: Any) -> None:
    stream_until_interrupted(server_pool["main"])


def test_streams_from_a_stopped_shared_server(server_pool: Any) -> None:
    stream_until_interrupted(server_pool["main"], stop_the_server=True)


def test_two_threads_left_waiting() -> None:
    with ThreadPoolExecutor(1) as calls, ThreadPoolExecutor(1) as bystander:
        calls.submit(time.sleep, 120)
        bystander.submit(time.sleep, 120)
        print("waiting", flush=True)
        time.sleep(600)
