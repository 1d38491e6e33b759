"""The series of disaggregated (P/D) pools, per role, registered beside metrics.py's (gateway/forwarding/pd.py
feeds them; docs/operations.md "Metrics" and docs/pd.md list them)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from gateway.telemetry.tallies import CounterTally, HistogramTally, Tallies

TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class PdMetrics:
    """The per-role series (registered once per app, beside metrics.py's)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.legs = CounterTally(
            "gateway_pd_legs_total",
            "Legs of disaggregated requests sent, by pool, role (prefill|decode), replica and "
            "outcome (ok, status_<code>, timeout, connect_error, closed_early, no_kv_params).",
            ["pool", "role", "replica", "outcome"],
        )
        self.prefill = HistogramTally(
            "gateway_pd_prefill_seconds",
            "A disaggregated request's prefill leg, sent to answered, by pool and prefill replica.",
            ["pool", "replica"],
            TRANSFER_BUCKETS,
        )
        self.transfer = HistogramTally(
            "gateway_pd_kv_transfer_seconds",
            "Prefill leg answered to the decode replica's first byte (the KV transfer as the "
            "gateway sees it; serial vllm-nixl streams only), by pool and decode replica.",
            ["pool", "replica"],
            TRANSFER_BUCKETS,
        )
        registry.register(Tallies([self.legs, self.prefill, self.transfer]))
