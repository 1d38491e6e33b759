"""What a discrete-event run produces: one record per request, busy time per replica.

`RunResult.summary()` condenses it into the numbers benchmarks compare.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from simulator.stats import percentile


@dataclass(frozen=True, slots=True)
class RequestRecord:
    id: str
    replica: int
    arrival_s: float
    first_token_s: float
    finish_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    preemptions: int
    priority: int = 0

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (NaN for one-token outputs)."""
        if self.output_tokens < 2:
            return math.nan
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)


@dataclass(slots=True)
class RunResult:
    records: list[RequestRecord]  # in arrival order
    busy_s: list[float]  # per replica, simulated seconds spent in steps

    def summary(self) -> dict[str, float]:
        recs = self.records
        if not recs:
            return {"requests": 0}
        prompt = sum(r.prompt_tokens for r in recs)
        out = sum(r.output_tokens for r in recs)
        span = max(r.finish_s for r in recs) - min(r.arrival_s for r in recs)
        ttft = [r.ttft_s for r in recs]
        tpot = [r.tpot_s for r in recs if r.output_tokens > 1]
        e2e = [r.finish_s - r.arrival_s for r in recs]
        mean_busy = sum(self.busy_s) / len(self.busy_s)
        return {
            "requests": len(recs),
            "hit_ratio": sum(r.cached_tokens for r in recs) / prompt if prompt else 0.0,
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "tpot_p50": percentile(tpot, 50), "tpot_p99": percentile(tpot, 99),
            "e2e_p50": percentile(e2e, 50), "e2e_p99": percentile(e2e, 99),
            "throughput_tok_s": out / span if span > 0 else math.nan,
            "throughput_req_s": len(recs) / span if span > 0 else math.nan,
            "imbalance": max(self.busy_s) / mean_busy if mean_busy > 0 else 1.0,
            "preemptions": sum(r.preemptions for r in recs),
            "makespan_s": span,
        }
