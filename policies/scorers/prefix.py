"""Prefix scorer: the share of the request's prompt blocks a replica already holds.

    score = hit_blocks / n_blocks        (0 for every replica when the request has no full block)

The prefix index produces `hit_blocks`; this scorer only divides.

    scorers:
      prefix: 3
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import Scorer
from policies.types import ReplicaView, RoutedRequest


class PrefixScorer(Scorer):
    name = "prefix"
    needs_prefix = True  # hit_blocks / n_blocks
    reason = "prefix"

    def score(self, req: RoutedRequest, views: Sequence[ReplicaView]) -> dict[str, float]:
        n = len(req.block_hashes)
        if n == 0:
            return {}
        inv = 1.0 / n
        return {v.name: v.hit_blocks * inv for v in views}
