"""Tier load rates learned from TTFTs: seconds per token loaded from each lower KV tier, per pool.

The TTFT scorer prices a lower-tier hit at tokens x kv_bytes_per_token / tier_gbps. The
bandwidth an operator configures is a guess (the PCIe generation, the NVMe drive, the store's
link, contention with other traffic). Where the engine measures its loads (vLLM's transfer
counters, LMCache's retrieve time) the scorer prices at that (gateway/fleet/tier_load.py); this
learner is opt-in (`learn_tiers: true`) for engines that do not, because the residual it
learns from also holds the queueing the prefill fit does not model: in bench/tiers.py --quick,
where nearly every answer queued, it learned the tiers 3 to 11 times too slow. Each outcome whose replica
served every predicted prefix token (its cached tokens cover the GPU hit and the tier tokens)
leaves, after the prefill fit,

    residual = ttft - (a + b * recomputed + c * queued)  ~  sum over tiers of s_tier * loaded_tier

and s (seconds per token, per tier) is fitted by exponentially weighted ridge least squares,
pulled toward the configured prior (kv_bytes_per_token / tier_gbps). An outcome that fell short
(the replica recomputed part of what was predicted loadable) or that reports no cached tokens is
not used: its TTFT holds recompute the fit does not see. All replicas of a pool share one rate
per tier (they have the same links and drives). The sums are kept per replica, so that the
gateways of a fleet can share them (the scorer's `share` / `absorb`) and a replica's can go.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from policies.scorers.ridge import solve3

LEARNED = ("cpu", "disk", "shared")  # the tiers a rate is learned for (docs/tiers.md)
WIDTH = 10  # numbers a replica's shared sums carry: xx (6), xy (3), n
_KTOK = 1000.0  # features in thousands of tokens, like the prefill fit


class TierSums:
    """Decayed sums X'X (upper triangle) and X'y for features (cpu_k, disk_k, shared_k) and
    y = the TTFT residual in seconds."""

    __slots__ = ("xx", "xy", "n")

    def __init__(self) -> None:
        self.xx = [0.0] * 6  # 00 01 02 11 12 22
        self.xy = [0.0] * 3
        self.n = 0

    def add(self, x: tuple[float, float, float], y: float, decay: float) -> None:
        c, d, s = x
        for i, term in enumerate((c * c, c * d, c * s, d * d, d * s, s * s)):
            self.xx[i] = decay * self.xx[i] + term
        for i, term in enumerate((c * y, d * y, s * y)):
            self.xy[i] = decay * self.xy[i] + term
        self.n += 1

    def numbers(self) -> list[float]:
        return [*self.xx, *self.xy, float(self.n)]


class TierRates:
    """One pool's seconds per token for each tier: the prior until outcomes say otherwise.

    `rates` is updated in place (the scorer prices with it on the hot path); tiers outside
    LEARNED (a name only the config gives) keep their configured rate."""

    def __init__(self, prior: Mapping[str, float], prior_weight: float, decay: float) -> None:
        self.prior = dict(prior)
        self.rates = dict(prior)
        self._w = prior_weight
        self._decay = decay
        self._prior_k = [prior.get(t, 0.0) * _KTOK for t in LEARNED]  # seconds per 1k tokens
        self._own: dict[str, TierSums] = {}  # this process's observations, per replica
        self._peer: dict[str, list[float]] = {}  # the other gateways' sums, per replica

    def learn(self, replica: str, tokens: Mapping[str, int], residual_s: float) -> None:
        """One served outcome: `tokens` loaded per tier, `residual_s` of its TTFT left to them."""
        c, d, s = (max(0, tokens.get(t, 0)) / _KTOK for t in LEARNED)
        if not (c or d or s) or not math.isfinite(residual_s):
            return
        sums = self._own.get(replica)
        if sums is None:
            sums = self._own[replica] = TierSums()
        sums.add((c, d, s), residual_s, self._decay)
        self._solve()

    def own(self, replica: str) -> list[float] | None:
        """This process's sums for `replica` (None: no tier observation of it)."""
        sums = self._own.get(replica)
        return None if sums is None else sums.numbers()

    def absorb(self, peer: Mapping[str, Sequence[float]]) -> None:
        """The other gateways' sums per replica (already added up across them)."""
        got = {name: [float(x) for x in nums] for name, nums in peer.items()}
        if got != self._peer:
            self._peer = got
            self._solve()

    def forget(self, replica: str) -> None:
        if self._own.pop(replica, None) is not None:
            self._solve()

    def gbps(self, kv_bytes_per_token: float) -> dict[str, float]:
        """The learned rates as bandwidths, GB/s per tier (what the config's tier_gbps means)."""
        return {
            t: kv_bytes_per_token / (s * 1e9) if s > 0 else math.inf
            for t in LEARNED
            if (s := self.rates.get(t)) is not None
        }

    def _solve(self) -> None:
        # ridge toward the prior: (X'X + w I) s = X'y + w s0, every replica's sums added (fsum:
        # the same result in any order, so on every gateway of the fleet)
        parts = [s.numbers() for s in self._own.values()] + list(self._peer.values())
        tot = [math.fsum(p[i] for p in parts) for i in range(9)]
        w, p = self._w, self._prior_k
        m = tot[:6]
        m[0] += w
        m[3] += w
        m[5] += w
        v = [tot[6] + w * p[0], tot[7] + w * p[1], tot[8] + w * p[2]]
        theta = solve3(m, v) or (p[0], p[1], p[2])
        for tier, s in zip(LEARNED, theta, strict=True):
            if tier in self.prior:
                self.rates[tier] = max(0.0, s) / _KTOK
