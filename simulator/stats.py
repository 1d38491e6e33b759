"""Engine counters: monotonic totals behind /metrics, and resettable deltas behind /sim/stats.

A reset never touches the totals (Prometheus counters must not go down); it moves a baseline.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields


@dataclass(slots=True)
class EngineCounters:
    requests_received: int = 0
    requests_served: int = 0
    requests_aborted: int = 0
    finished_length: int = 0
    finished_stop: int = 0
    prompt_tokens: int = 0  # counted once per request, at first admission
    cached_prompt_tokens: int = 0  # prefix hit at first admission
    prefix_queries: int = 0  # tokens looked up, every admission (vLLM's queries counter)
    prefix_hits: int = 0  # tokens found, every admission (vLLM's hits counter)
    generation_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    busy_time_s: float = 0.0

    def copy(self) -> EngineCounters:
        return EngineCounters(**asdict(self))

    def minus(self, base: EngineCounters) -> EngineCounters:
        return EngineCounters(**{f.name: getattr(self, f.name) - getattr(base, f.name)
                                 for f in fields(self)})


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation, as numpy's default; NaN if empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
