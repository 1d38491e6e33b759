"""The admission queue's series on /metrics (queue length, oldest wait, admitted, shed), read
from the current admission at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.limits.admission import Admission


class AdmissionCollector(Collector):
    def __init__(self, admission: Callable[[], Admission]) -> None:
        self._admission = admission

    def collect(self) -> Iterator[Metric]:
        st = self._admission().stats()
        qlen = GaugeMetricFamily(
            "gateway_queue_length",
            "Requests waiting at the gateway for a slot.",
            labels=["pool", "priority"],
        )
        oldest = GaugeMetricFamily(
            "gateway_queue_oldest_wait_seconds",
            "How long the oldest waiting request has waited.",
            labels=["pool", "priority"],
        )
        for pool, per in st.queues.items():
            for klass, q in per.items():
                qlen.add_metric([pool, klass], q.queued)
                oldest.add_metric([pool, klass], q.oldest_wait_s)
        admitted = CounterMetricFamily(
            "gateway_admitted",
            "Requests admitted to routing, by pool, class and tenant.",
            labels=["pool", "priority", "tenant"],
        )
        for (pool, klass, tenant), n in st.admitted.items():
            admitted.add_metric([pool, klass, tenant], n)
        shed = CounterMetricFamily(
            "gateway_shed",
            "Requests shed by admission (queue_full or timeout), by pool, class and tenant.",
            labels=["pool", "priority", "tenant", "reason"],
        )
        for (pool, klass, tenant, reason), n in st.shed.items():
            shed.add_metric([pool, klass, tenant, reason], n)
        yield from (qlen, oldest, admitted, shed)
