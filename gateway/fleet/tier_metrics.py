"""The by-tier audit and the learned tier bandwidths on /metrics, read from the pools at scrape
time (the request path only adds to each pool's TierAudit; docs/tiers.md).

    gateway_tier_predicted_tokens_total{pool,tier}   prefix tokens routing expected the replica to
                                                     find there (served answers that reported
                                                     cached tokens)
    gateway_tier_unserved_tokens_total{pool,tier}    the part of them it did not serve (a shortfall
                                                     is charged to the slowest tiers first)
    gateway_tier_short_requests_total{pool}          answers that fell short of the prediction
    gateway_tier_load_gbps{pool,tier}                the bandwidth the ttft scorer prices a tier at
                                                     where the replica measures none (learned from
                                                     TTFTs, else its tier_gbps)
    gateway_replica_tier_load_gbps{pool,replica,tier}
                                                     the bandwidth the replica's engine measured
                                                     for its loads from a tier, which the ttft
                                                     scorer prices it at (gateway/fleet/tier_load.py)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from policies.scorers.ttft import TTFTScorer
from prefix_index.tiers import CPU, DISK, GPU, SHARED

if TYPE_CHECKING:
    from gateway.fleet.pools import Pool

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
        measured = GaugeMetricFamily(
            "gateway_replica_tier_load_gbps",
            "GB/s the replica's engine measured for its loads from each lower tier (vLLM's "
            "kv_offload counters, LMCache's retrieve time), which the ttft scorer prices it at.",
            labels=["pool", "replica", "tier"],
        )
        for name, pool in self._pools().items():
            audits = [p.audit for p in pool.parts()]  # a P/D pool: both sets'
            for tier in TIERS:
                predicted.add_metric([name, tier], sum(a.predicted.get(tier, 0) for a in audits))
                unserved.add_metric([name, tier], sum(a.unserved.get(tier, 0) for a in audits))
            short.add_metric([name], sum(a.requests_short for a in audits))
            scorer = _pricing(pool.parts()[0])  # the set whose prefix hits count
            if scorer is not None:
                for tier, g in scorer.tier_gbps().items():
                    if math.isfinite(g):
                        gbps.add_metric([name, tier], g)
            kvb = scorer.kv_bytes_per_token if scorer is not None else None
            for part in pool.parts():
                for r in part.replicas:
                    for tier, g in measured_gbps(r.tier_load.rates, kvb).items():
                        measured.add_metric([name, r.name, tier], g)
        yield from (predicted, unserved, short, gbps, measured)


def _pricing(pool: Pool) -> TTFTScorer | None:
    """The pool's ttft scorer, if it has one that prices tiers in seconds."""
    for scorer, _weight in pool.policy.scorers:
        if isinstance(scorer, TTFTScorer) and scorer.tiers == "seconds":
            return scorer
    return None


def measured_gbps(
    rates: Mapping[str, tuple[float, float]] | None, kv_bytes_per_token: float | None
) -> dict[str, float]:
    """A replica's measured rates as GB/s: seconds per byte directly, seconds per token (LMCache)
    at the pool's `kv_bytes_per_token` (none without a scorer that prices in seconds)."""
    out: dict[str, float] = {}
    for tier, (per_byte, per_token) in (rates or {}).items():
        if per_byte > 0:
            out[tier] = 1e-9 / per_byte
        elif per_token > 0 and kv_bytes_per_token is not None:
            out[tier] = kv_bytes_per_token * 1e-9 / per_token
    return out
