"""Prefix scorer: the share of the request's prompt blocks a replica already holds.

    score = hit_blocks / n_blocks        (0 for every replica when the request has no full block)

The prefix index produces `hit_blocks`; this scorer only divides. With `tiers` (a weight per
lower KV tier, llm-d style: `{cpu: 0.8}`), blocks a replica holds on its host memory, disk or
the pool's shared store (`ReplicaView.tier_hits`, docs/tiers.md) count with that weight; a
tier not named counts 0. Without it (the default) only GPU blocks count.

    scorers:
      prefix: 3
      # or: prefix: {weight: 3, tiers: {cpu: 0.8, disk: 0.25, shared: 0.5}}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from policies.base import Scorer
from policies.types import ReplicaView, RoutedRequest


class PrefixScorer(Scorer):
    name = "prefix"
    needs_prefix = True  # hit_blocks / n_blocks
    reason = "prefix"

    def __init__(self, *, tiers: Mapping[str, float] | None = None) -> None:
        weights = dict(tiers or {})
        if not all(0.0 <= w <= 1.0 for w in weights.values()):
            raise ValueError(f"tier weights must be in [0, 1], got {weights!r}")
        self.tiers = weights

    def score(self, req: RoutedRequest, views: Sequence[ReplicaView]) -> dict[str, float]:
        n = len(req.block_hashes)
        if n == 0:
            return {}
        inv = 1.0 / n
        weights = self.tiers
        if not weights:
            return {v.name: v.hit_blocks * inv for v in views}
        out: dict[str, float] = {}
        for v in views:
            held = float(v.hit_blocks)
            if v.tier_hits:
                held += sum(b * weights.get(t, 0.0) for t, b in v.tier_hits.items())
            out[v.name] = min(1.0, held * inv)
        return out
