"""A rolling window of recent per-request samples, per (pool, replica), for the status page.

Time is cut into buckets of `bucket_s`; only the buckets of the last `span_s` are kept, and each
keeps at most `max_samples` latencies per replica (a uniform reservoir), so memory is bounded by
replicas × buckets × max_samples whatever the request rate. `observe` is O(1); the percentiles are
computed when `series()` is asked (every couple of seconds, by a dashboard), not per request.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

Clock = Callable[[], float]
Key = tuple[str, str]  # (pool, replica)


class _Cell:
    """What one replica did during one bucket."""

    __slots__ = (
        "n",
        "errors",
        "ttft",
        "tpot",
        "e2e",
        "seen_ttft",
        "seen_tpot",
        "seen_e2e",
        "prompt_tokens",
        "prompt_blocks",
        "predicted_hit_blocks",
        "observed_input_tokens",
        "observed_cached_tokens",
    )

    def __init__(self) -> None:
        self.n = self.errors = 0
        self.ttft: list[float] = []
        self.tpot: list[float] = []
        self.e2e: list[float] = []
        self.seen_ttft = self.seen_tpot = self.seen_e2e = 0
        self.prompt_tokens = self.prompt_blocks = self.predicted_hit_blocks = 0
        self.observed_input_tokens = self.observed_cached_tokens = 0


class _Totals:
    """Cells added together (a replica over the span, or a pool / the fleet in one bucket)."""

    __slots__ = ("n", "errors", "ttft", "tpot", "e2e", "blocks", "hit_blocks", "obs_in", "obs_hit")

    def __init__(self) -> None:
        self.n = self.errors = self.blocks = self.hit_blocks = self.obs_in = self.obs_hit = 0
        self.ttft: list[float] = []
        self.tpot: list[float] = []
        self.e2e: list[float] = []

    def add(self, c: _Cell) -> None:
        self.n += c.n
        self.errors += c.errors
        self.ttft += c.ttft
        self.tpot += c.tpot
        self.e2e += c.e2e
        self.blocks += c.prompt_blocks
        self.hit_blocks += c.predicted_hit_blocks
        self.obs_in += c.observed_input_tokens
        self.obs_hit += c.observed_cached_tokens

    def latency(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for name, samples in (("ttft", self.ttft), ("tpot", self.tpot), ("e2e", self.e2e)):
            ordered = sorted(samples)
            out[f"{name}_p50"] = quantile(ordered, 0.5)
            out[f"{name}_p99"] = quantile(ordered, 0.99)
        return out

    def hit_rates(self) -> dict[str, float | None]:
        return {
            "predicted_hit_rate": _ratio(self.hit_blocks, self.blocks),
            "observed_hit_rate": _ratio(self.obs_hit, self.obs_in),
        }


class RollingWindow:
    """Recent requests per (pool, replica), bucketed by time; see the module docstring."""

    def __init__(
        self,
        span_s: float = 300.0,
        bucket_s: float = 10.0,
        clock: Clock = time.monotonic,
        *,
        max_samples: int = 256,
        seed: int = 0,
    ) -> None:
        if bucket_s <= 0 or span_s < bucket_s:
            raise ValueError("RollingWindow needs 0 < bucket_s <= span_s")
        self.span_s = span_s
        self.bucket_s = bucket_s
        self.n_buckets = max(1, round(span_s / bucket_s))
        self.max_samples = max_samples
        self._clock = clock
        self._rng = random.Random(seed)  # reservoir sampling; seeded so tests are repeatable
        self._buckets: deque[tuple[int, dict[Key, _Cell]]] = deque()
        self._since: float | None = None

    # --- the hot path ------------------------------------------------------------------------
    def observe(
        self,
        pool: str,
        replica: str,
        *,
        ttft_s: float | None,
        tpot_s: float | None,
        e2e_s: float | None,
        prompt_tokens: int,
        prompt_blocks: int,
        predicted_hit_blocks: int,
        cached_tokens: int | None,
        input_tokens: int | None,
        ok: bool,
    ) -> None:
        """Record one finished request. None means "not measured" (e.g. no TTFT when not streamed);
        the observed hit rate counts only answers that reported both cached and input tokens."""
        now = self._clock()
        if self._since is None:
            self._since = now
        idx = math.floor(now / self.bucket_s)
        buckets = self._buckets
        if not buckets or buckets[-1][0] != idx:
            cells: dict[Key, _Cell] = {}
            buckets.append((idx, cells))
            while buckets[0][0] <= idx - self.n_buckets:
                buckets.popleft()
        else:
            cells = buckets[-1][1]
        key = (pool, replica)
        cell = cells.get(key)
        if cell is None:
            cell = cells[key] = _Cell()
        cell.n += 1
        if not ok:
            cell.errors += 1
        cell.prompt_tokens += prompt_tokens
        cell.prompt_blocks += prompt_blocks
        cell.predicted_hit_blocks += predicted_hit_blocks
        if cached_tokens is not None and input_tokens:
            cell.observed_input_tokens += input_tokens
            cell.observed_cached_tokens += cached_tokens
        if ttft_s is not None:
            cell.seen_ttft += 1
            self._keep(cell.ttft, cell.seen_ttft, ttft_s)
        if tpot_s is not None:
            cell.seen_tpot += 1
            self._keep(cell.tpot, cell.seen_tpot, tpot_s)
        if e2e_s is not None:
            cell.seen_e2e += 1
            self._keep(cell.e2e, cell.seen_e2e, e2e_s)

    def _keep(self, samples: list[float], seen: int, value: float) -> None:
        if len(samples) < self.max_samples:
            samples.append(value)
        else:  # reservoir: every sample of the bucket stays with equal probability
            j = self._rng.randrange(seen)
            if j < self.max_samples:
                samples[j] = value

    # --- what the status page reads -----------------------------------------------------------
    def series(self) -> dict[str, Any]:
        """JSON-ready charts and per-replica recent figures.

        `fleet` and `pools[name]` hold one point per bucket, oldest first, every bucket of the span
        present (`n` 0 and None figures when idle); `age_s` is how long ago the bucket began.
        `replicas[pool][replica]` adds up the whole span: request and error rates, hit rates and
        latency percentiles.
        """
        now = self._clock()
        idx = math.floor(now / self.bucket_s)
        first = idx - self.n_buckets + 1
        live = {i: cells for i, cells in self._buckets if i >= first}
        fleet: list[dict[str, Any]] = []
        pools: dict[str, list[dict[str, Any]]] = {}
        per_replica: dict[Key, _Totals] = {}
        pool_names = sorted({k[0] for cells in live.values() for k in cells})
        for name in pool_names:
            pools[name] = []
        for i in range(first, idx + 1):
            cells = live.get(i, {})
            age = round(now - i * self.bucket_s, 3)
            fleet.append(_point(age, cells.values()))
            for name in pool_names:
                pools[name].append(_point(age, (c for k, c in cells.items() if k[0] == name)))
            for key, cell in cells.items():
                tot = per_replica.get(key)
                if tot is None:
                    tot = per_replica[key] = _Totals()
                tot.add(cell)
        since = self._since if self._since is not None else now
        covered = max(1.0, min(now - since, now - first * self.bucket_s))  # seconds with data
        replicas: dict[str, dict[str, Any]] = {}
        for (pool, name), tot in sorted(per_replica.items()):
            replicas.setdefault(pool, {})[name] = {
                "requests": tot.n,
                "request_rate": tot.n / covered,
                "error_rate": _ratio(tot.errors, tot.n),
                **tot.hit_rates(),
                **tot.latency(),
            }
        return {
            "span_s": self.span_s,
            "bucket_s": self.bucket_s,
            "fleet": fleet,
            "pools": pools,
            "replicas": replicas,
        }


def _point(age_s: float, cells: Iterable[_Cell]) -> dict[str, Any]:
    tot = _Totals()
    for c in cells:
        tot.add(c)
    return {
        "age_s": age_s,
        "n": tot.n,
        "errors": tot.errors,
        **tot.latency(),
        "predicted_hit_rate": _ratio(tot.hit_blocks, tot.blocks),
    }


def quantile(ordered: list[float], q: float) -> float | None:
    """Nearest-rank quantile of an already sorted list; None when empty."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None
