"""The gateway's plain-number tallies expose exactly what prometheus-client's own Counter and
Histogram expose for the same observations (less the `_created` series)."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from gateway.tallies import CounterTally, HistogramTally, Tallies

BUCKETS = (0.0, 0.005, 0.01, 0.5, 1, 64, 131072)


def exposition(registry: CollectorRegistry) -> list[str]:
    return sorted(
        line
        for line in generate_latest(registry).decode().splitlines()
        if "_created" not in line
    )


def test_tallies_expose_what_the_library_metrics_expose() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    c = CounterTally("x_requests_total", "Requests.", ["pool", "status"])
    h = HistogramTally("x_latency_seconds", "Latency.", ["pool"], BUCKETS)
    empty = CounterTally("x_unused_total", "Never counted.", ["pool"])
    ours.register(Tallies([c, h, empty]))
    lc = Counter("x_requests_total", "Requests.", ["pool", "status"], registry=theirs)
    lh = Histogram("x_latency_seconds", "Latency.", ["pool"], buckets=BUCKETS, registry=theirs)
    Counter("x_unused_total", "Never counted.", ["pool"], registry=theirs)
    rng = random.Random(7)
    for _ in range(500):
        pool, status = rng.choice("ab"), rng.choice(["200", "503"])
        n = rng.choice([1, 1, 3, 0.5])
        c.labels(pool, status).inc(n)
        lc.labels(pool, status).inc(n)
        v = rng.choice([0.0, 0.005, 0.0051, 0.7, 64, 1e6, rng.random()])  # bounds themselves too
        h.labels(pool).observe(v)
        lh.labels(pool).observe(v)
    assert exposition(ours) == exposition(theirs)


def test_a_wrong_label_count_is_refused() -> None:
    with pytest.raises(ValueError, match="labels"):
        CounterTally("x_total", "X.", ["a", "b"]).labels("only-one")
