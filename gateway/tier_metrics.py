"""The by-tier audit and the learned tier bandwidths on /metrics, read from the pools at scrape
time (the request path only adds to each pool's TierAudit; docs/tiers.md).

    gateway_tier_predicted_tokens_total{pool,tier}   prefix tokens routing expected the replica to
                                                     find there (served answers that reported
                                                     cached tokens)
    gateway_tier_unserved_tokens_total{pool,tier}    the part of them it did not serve (a shortfall
                                                     is charged to the slowest tiers first)
    gateway_tier_short_requests_total{pool}          answers that fell short of the prediction
    gateway_tier_load_gbps{pool,tier}                the bandwidth the ttft scorer prices a tier at
                                                     (learned from TTFTs, else its tier_gbps)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefix_index.tiers import CPU, DISK, GPU, SHARED

if TYPE_CHECKING:
    from .pools import Pool

TIERS = (GPU, CPU, DISK, SHARED)


class TierCollector(Collector):
    def __init__(self, pools: Callable[[], Mapping[str, Pool]]) -> None:
        self._pools = pools

    def collect(self) -> Iterator[Metric]:
        predicted = CounterMetricFamily(
            "gateway_tier_predicted_tokens",
            "Prefix tokens routing predicted the chosen replica would find on each tier (gpu, "
            "cpu, disk, shared), over served answers that reported cached tokens.",
            labels=["pool", "tier"],
        )
        unserved = CounterMetricFamily(
            "gateway_tier_unserved_tokens",
            "Predicted prefix tokens the replica did not serve (its cached tokens fell short), "
            "charged to the slowest predicted tiers first.",
            labels=["pool", "tier"],
        )
        short = CounterMetricFamily(
            "gateway_tier_short_requests",
            "Served answers whose cached tokens fell short of the predicted prefix hit.",
            labels=["pool"],
        )
        gbps = GaugeMetricFamily(
            "gateway_tier_load_gbps",
            "GB/s the ttft scorer prices a load from each lower tier at: learned from TTFTs "
            "(learn_tiers), else its tier_gbps.",
            labels=["pool", "tier"],
        )
        for name, pool in self._pools().items():
            audits = [p.audit for p in pool.parts()]  # a P/D pool: both sets'
            for tier in TIERS:
                predicted.add_metric([name, tier], sum(a.predicted.get(tier, 0) for a in audits))
                unserved.add_metric([name, tier], sum(a.unserved.get(tier, 0) for a in audits))
            short.add_metric([name], sum(a.requests_short for a in audits))
            for tier, g in _learned(pool.parts()[0]).items():  # the set whose prefix hits count
                gbps.add_metric([name, tier], g)
        yield from (predicted, unserved, short, gbps)


def _learned(pool: Pool) -> dict[str, float]:
    """The tier bandwidths of the pool's ttft scorer, if it has one that prices tiers."""
    for scorer, _weight in pool.policy.scorers:
        read = getattr(scorer, "tier_gbps", None)
        if callable(read) and getattr(scorer, "tiers", None) == "seconds":
            got: dict[str, float] = read()
            return {t: g for t, g in got.items() if math.isfinite(g)}
    return {}
