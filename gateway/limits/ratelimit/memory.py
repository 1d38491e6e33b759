"""The in-process backend: buckets in a dict, for one gateway process."""

from __future__ import annotations

import time
from collections.abc import Sequence

from gateway.limits.ratelimit.base import EPS, Clock, Rule, Verdict, check_costs, rule_state


class MemoryRateLimiter:
    """Buckets in a dict, for one gateway process; full buckets are swept once a minute."""

    def __init__(self, clock: Clock = time.monotonic, sweep_s: float = 60.0) -> None:
        self._clock = clock
        self._sweep_s = sweep_s
        self._swept = clock()
        # (key, rule name) -> [level, time of level, rate, burst]
        self._buckets: dict[tuple[str, str], list[float]] = {}

    def __len__(self) -> int:
        return len(self._buckets)

    def _level(self, key: str, rule: Rule, now: float) -> float:
        b = self._buckets.get((key, rule.name))
        if b is None:
            return rule.burst
        return min(rule.burst, b[0] + max(0.0, now - b[1]) * rule.rate_per_s)

    async def acquire(self, key: str, rules: Sequence[Rule], costs: Sequence[float]) -> Verdict:
        check_costs(rules, costs)
        now = self._clock()
        self._maybe_sweep(now)
        levels = [self._level(key, r, now) for r in rules]
        needs = [max(0.0, c) for c in costs]
        wait = 0.0
        blocked: list[str] = []
        oversized: list[tuple[str, float]] = []
        for r, level, need in zip(rules, levels, needs, strict=True):
            if need > r.burst + EPS:  # never fits: refused, and no wait would help
                blocked.append(r.name)
                oversized.append((r.name, need))
            elif level + EPS < need:
                wait = max(wait, (need - level) / r.rate_per_s)
                blocked.append(r.name)
        allowed = not blocked
        if allowed:
            for i, (r, need) in enumerate(zip(rules, needs, strict=True)):
                levels[i] -= need
                self._buckets[(key, r.name)] = [levels[i], now, r.rate_per_s, r.burst]
        states = tuple(rule_state(r, lv) for r, lv in zip(rules, levels, strict=True))
        return Verdict(allowed, wait, states, tuple(blocked), oversized=tuple(oversized))

    async def adjust(self, key: str, rule: Rule, delta: float) -> None:
        now = self._clock()
        level = min(rule.burst, self._level(key, rule, now) - delta)
        self._buckets[(key, rule.name)] = [level, now, rule.rate_per_s, rule.burst]

    def _maybe_sweep(self, now: float) -> None:
        if now - self._swept < self._sweep_s:
            return
        self._swept = now
        full = [
            k
            for k, (level, t, rate, burst) in self._buckets.items()
            if level + (now - t) * rate >= burst
        ]
        for k in full:
            del self._buckets[k]

    async def aclose(self) -> None:
        self._buckets.clear()
