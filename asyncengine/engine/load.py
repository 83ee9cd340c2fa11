"""The engine's load as routers read it (SMG's GetLoads, HTTP-mode routers' load report): counts
from the core's stats plus a generation rate measured over the last steps."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from asyncengine.engine.llm_engine import EngineStats

# the rate is measured over this many seconds of steps: long enough to smooth single steps,
# short enough that a router polling every few seconds sees a burst end
THROUGHPUT_WINDOW_S = 10.0


@dataclass(frozen=True)
class LoadReport:
    """One snapshot of the engine's load; token counts are KV slots (blocks x block size)."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_used_tokens: int
    num_total_tokens: int
    token_usage: float  # used / total KV blocks on the device, in [0, 1]
    gen_throughput: float  # tokens generated per second over the last THROUGHPUT_WINDOW_S
    cache_hit_rate: float  # prompt tokens found in the prefix cache / looked up, since start
    # prompt tokens of waiting requests not yet computed. A prefix-cache hit is found only
    # when a request is admitted to run, so a waiting prompt's cached part counts here too
    num_waiting_uncached_tokens: int
    max_running_requests: int


class ThroughputMeter:
    """Tokens per second over a sliding window of the steps that made them."""

    def __init__(self, window_s: float = THROUGHPUT_WINDOW_S) -> None:
        self._window_s = window_s
        self._steps: deque[tuple[float, int]] = deque()
        self._num_in_window = 0

    def add(self, num_tokens: int, now: float | None = None) -> None:
        if num_tokens:
            self._steps.append((time.monotonic() if now is None else now, num_tokens))
            self._num_in_window += num_tokens
        self._expire(time.monotonic() if now is None else now)

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._expire(now)
        return self._num_in_window / self._window_s

    def _expire(self, now: float) -> None:
        while self._steps and self._steps[0][0] < now - self._window_s:
            self._num_in_window -= self._steps.popleft()[1]


def load_report(
    stats: EngineStats, block_size: int, max_num_seqs: int, gen_throughput: float
) -> LoadReport:
    num_used_blocks = stats.num_gpu_blocks - stats.num_free_gpu_blocks
    queries = stats.num_prefix_cache_queries
    return LoadReport(
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_swapped=stats.num_swapped,
        num_used_tokens=num_used_blocks * block_size,
        num_total_tokens=stats.num_gpu_blocks * block_size,
        token_usage=stats.gpu_block_usage,
        gen_throughput=gen_throughput,
        cache_hit_rate=stats.num_prefix_cache_hits / queries if queries else 0.0,
        num_waiting_uncached_tokens=stats.num_waiting_prompt_tokens,
        max_running_requests=max_num_seqs,
    )
