"""BatchHistogram exposes what prometheus_client's Histogram does for the same values."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from asyncengine.server.batch_histogram import BatchHistogram

BUCKETS = (0.001, 0.01, 0.1, 1.0)
# on a bound, between bounds, below the first, past the last
VALUES = [0.001, 0.0005, 0.05, 0.01, 0.1, 0.7, 1.0, 3.0, 0.02, 0.0]


def exposition(registry: CollectorRegistry) -> list[str]:
    lines = generate_latest(registry).decode().splitlines()
    return [line for line in lines if "_created" not in line]


def test_observed_in_batches_it_reads_as_one_observed_value_by_value() -> None:
    reference, batched = CollectorRegistry(), CollectorRegistry()
    histogram = Histogram("step_seconds", "Seconds per step", buckets=BUCKETS, registry=reference)
    for value in VALUES:
        histogram.observe(value)
    batch = BatchHistogram("step_seconds", "Seconds per step", BUCKETS, batched)
    batch.observe_all(VALUES[:3])
    batch.observe_all([])
    batch.observe_all(VALUES[3:])

    assert exposition(batched) == exposition(reference)
    assert 'step_seconds_bucket{le="0.01"} 4.0' in exposition(batched)
