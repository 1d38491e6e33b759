"""SGLang-style cache-aware picker: an imbalance switch, then longest prefix or least loaded.

    imbalanced = max_load - min_load > balance_abs_threshold
                 and max_load > balance_rel_threshold * min_load
    imbalanced                        -> least loaded                  (reason "guard")
    best hit / n_blocks > threshold   -> longest prefix match          (reason "prefix")
    otherwise                         -> least loaded                  (reason "load")

Load is ReplicaView.load. SGLang sends a miss to the replica with the smallest radix tree; the
gateway does not see tree sizes, so a miss goes to the least loaded. Defaults are SGLang's.

    picker: {name: sglang_cache_aware, cache_threshold: 0.3, balance_abs_threshold: 64,
             balance_rel_threshold: 1.5}
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from policies.base import GUARD, SeededPicker
from policies.types import ReplicaView, RoutedRequest


class SGLangCacheAwarePicker(SeededPicker):
    name = "sglang_cache_aware"
    needs_prefix = True  # the longest prefix match wins unless the fleet is imbalanced

    def __init__(
        self,
        *,
        cache_threshold: float = 0.3,
        balance_abs_threshold: float = 64,
        balance_rel_threshold: float = 1.5,
        rng: random.Random | None = None,
    ) -> None:
        if not 0 <= cache_threshold <= 1:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold!r}")
        if not balance_abs_threshold >= 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, got {balance_abs_threshold!r}")
        if not balance_rel_threshold >= 0:
            raise ValueError(f"balance_rel_threshold must be >= 0, got {balance_rel_threshold!r}")
        self.cache_threshold = float(cache_threshold)
        self.balance_abs_threshold = float(balance_abs_threshold)
        self.balance_rel_threshold = float(balance_rel_threshold)
        super().__init__(rng=rng)

    def pick(
        self, req: RoutedRequest, views: Sequence[ReplicaView], totals: dict[str, float]
    ) -> tuple[list[str], str]:
        rand = self._rng.random
        by_load = sorted((v.load, rand(), v.hit_blocks, v.name) for v in views)
        ranked = [k[3] for k in by_load]
        lo, hi = by_load[0][0], by_load[-1][0]
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            return ranked, GUARD
        n = len(req.block_hashes)
        best = max(by_load, key=lambda k: k[2])  # first of the max hits: the least loaded one
        if n and best[2] / n > self.cache_threshold:
            ranked.remove(best[3])
            return [best[3], *ranked], "prefix"
        return ranked, "load"
