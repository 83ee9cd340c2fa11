"""A Prometheus histogram observed many values at a time: the step figures of a server whose
engine steps in its own process come in batches (one message carries every step made while the
serving loop was busy), dozens of steps per message. prometheus_client's `observe` takes a
lock and searches the buckets per value: three histograms per step cost the serving loop more
than writing the streams did."""

from __future__ import annotations

import itertools
import math
import threading
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class BatchHistogram(Collector):
    """One unlabelled histogram (the same series as `prometheus_client.Histogram`, less
    `_created`), updated by `observe_all` under one lock per batch."""

    def __init__(
        self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._bounds = [*buckets, math.inf]
        self._counts = [0] * len(self._bounds)  # per bucket, not cumulative
        self._sum = 0.0
        self._lock = threading.Lock()  # the scrape reads from the HTTP thread
        registry.register(self)

    def observe_all(self, values: Iterable[float]) -> None:
        bounds, counts = self._bounds, self._counts
        with self._lock:
            total = self._sum
            for value in values:
                counts[bisect_left(bounds, value)] += 1  # the first bound >= value: "le"
                total += value
            self._sum = total

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        family = HistogramMetricFamily(self._name, self._documentation)
        cumulative = itertools.accumulate(counts)
        buckets = [(floatToGoString(b), c) for b, c in zip(self._bounds, cumulative, strict=True)]
        family.add_metric([], buckets, total)
        yield family
