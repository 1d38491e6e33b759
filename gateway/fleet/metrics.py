"""The per-replica gauges on /metrics (up, circuit, in flight, scraped load, busy timeouts,
silence), read from the live replica state at scrape time: the hot path pays nothing for them."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.fleet.replicas import CLOSED, HALF_OPEN, OPEN, ReplicaState


class ReplicaCollector(Collector):
    def __init__(self, replicas: Callable[[], Iterable[ReplicaState]]) -> None:
        self._replicas = replicas

    def collect(self) -> Iterator[Metric]:
        now = time.monotonic()
        labels = ["pool", "replica"]
        up = GaugeMetricFamily(
            "gateway_replica_up",
            "1 when the replica is proven healthy (circuit closed, not draining); 0 while its "
            "circuit is open or on trial (half-open), so a dead replica reads 0 throughout.",
            labels=labels,
        )
        circuit = GaugeMetricFamily(
            "gateway_replica_circuit_state",
            "Circuit breaker state of the replica: 1 for the current state.",
            labels=[*labels, "state"],
        )
        inflight = GaugeMetricFamily(
            "gateway_replica_inflight_requests",
            "Requests the gateway has in flight on the replica.",
            labels=labels,
        )
        pending = GaugeMetricFamily(
            "gateway_replica_inflight_prompt_tokens",
            "Uncached prompt tokens sent to the replica and not yet prefilled (gateway's count).",
            labels=labels,
        )
        waiting = GaugeMetricFamily(
            "gateway_replica_waiting_requests",
            "Waiting requests scraped from the replica.",
            labels=labels,
        )
        running = GaugeMetricFamily(
            "gateway_replica_running_requests",
            "Running requests scraped from the replica.",
            labels=labels,
        )
        kv = GaugeMetricFamily(
            "gateway_replica_kv_usage_ratio",
            "KV cache usage (0-1) scraped from the replica.",
            labels=labels,
        )
        busy = CounterMetricFamily(
            "gateway_replica_busy_timeouts",
            "Timeouts on the replica (a connect, a first byte, a health probe) while it was "
            "heard from within health.dead_after_s: busy, not dead; not counted against its "
            "circuit.",
            labels=labels,
        )
        silent = GaugeMetricFamily(
            "gateway_replica_silent_seconds",
            "Seconds since the replica last sent a byte of anything (an answer, a probe's, a "
            "scrape's), as of its last look (every scrape or probe).",
            labels=labels,
        )
        for r in self._replicas():
            lv = [r.pool, r.name]
            busy.add_metric(lv, r.busy)
            silent.add_metric(lv, max(0.0, now - r.heard_at))
            state = r.circuit.current(now)
            up.add_metric(lv, 1.0 if r.proven(now) else 0.0)
            for s in (CLOSED, OPEN, HALF_OPEN):
                circuit.add_metric([*lv, s], 1.0 if state == s else 0.0)
            inflight.add_metric(lv, r.inflight)
            pending.add_metric(lv, r.inflight_prompt_tokens)
            fresh = r.scraped is not None and now - r.scraped_at <= r.stale_after_s
            if fresh and r.scraped is not None:
                if r.scraped.waiting is not None:
                    waiting.add_metric(lv, r.scraped.waiting)
                if r.scraped.running is not None:
                    running.add_metric(lv, r.scraped.running)
                if r.scraped.kv_usage is not None:
                    kv.add_metric(lv, r.scraped.kv_usage)
        yield from (up, circuit, inflight, pending, waiting, running, kv, busy, silent)
