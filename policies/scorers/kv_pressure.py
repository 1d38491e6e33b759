"""KV pressure scorer: free KV cache is better.

Formula:

    score = 1 - kv_usage                  (kv_usage from the last scrape, 0..1)
    score = 1 - unknown_usage             (never scraped or stale: unknown is not idle)

Config:

    scorers:
      kv_pressure: {weight: 2, unknown_usage: 0.5}
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from policies.base import Scorer
from policies.types import ReplicaView, RoutedRequest


class KVPressureScorer(Scorer):
    name = "kv_pressure"
    reason = "load"

    def __init__(self, *, unknown_usage: float = 0.5) -> None:
        if not (isinstance(unknown_usage, int | float) and 0.0 <= unknown_usage <= 1.0):
            raise ValueError(f"unknown_usage must be in [0, 1], got {unknown_usage!r}")
        self.unknown_score = 1.0 - float(unknown_usage)

    def score(self, req: RoutedRequest, views: Sequence[ReplicaView]) -> dict[str, float]:
        unknown = self.unknown_score
        out: dict[str, float] = {}
        for v in views:
            usage = v.kv_usage
            out[v.name] = unknown if usage is None or math.isnan(usage) else 1.0 - usage
        return out
