"""Max-score picker: highest weighted total wins, with a hot-spot guard.

Ties on the total go to the least loaded replica, then at random (the policy's seeded rng).
The guard: when the best-scoring replica's load exceeds the least-loaded candidate's by more
than `max_load_gap` requests *and* more than `max_load_ratio` times, rank by load instead
(reason "guard"). Either bound may be null to drop it; `guard: false` disables the guard.

    picker: max_score
    guard: {max_load_gap: 8, max_load_ratio: 2.0}
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from policies.base import BY_SCORE, GUARD, TIE
from policies.types import ReplicaView, RoutedRequest


@dataclass(frozen=True, slots=True)
class LoadGuard:
    """Trips when best_load - min_load > max_load_gap and best_load > max_load_ratio * min_load."""

    max_load_gap: float | None = 8
    max_load_ratio: float | None = 2.0

    def __post_init__(self) -> None:
        for key in ("max_load_gap", "max_load_ratio"):
            value = getattr(self, key)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or value < 0
            ):
                raise ValueError(f"guard.{key} must be a number >= 0 or null, got {value!r}")

    @classmethod
    def from_config(cls, value: LoadGuard | Mapping[str, Any] | bool | None) -> LoadGuard | None:
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, LoadGuard):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"guard must be a mapping, true, false or null, got {value!r}")
        unknown = sorted(set(value) - {"max_load_gap", "max_load_ratio"})
        if unknown:
            raise ValueError(
                f"guard: unknown key {unknown[0]!r}; valid: max_load_gap, max_load_ratio"
            )
        return cls(**value)

    def trips(self, best_load: int, min_load: int) -> bool:
        if self.max_load_gap is None and self.max_load_ratio is None:
            return False
        if self.max_load_gap is not None and best_load - min_load <= self.max_load_gap:
            return False
        return self.max_load_ratio is None or best_load > self.max_load_ratio * min_load


class MaxScorePicker:
    name = "max_score"
    needs_prefix = False  # never reads hit_blocks: the gateway may skip the index lookup

    def __init__(
        self,
        *,
        guard: LoadGuard | Mapping[str, Any] | bool | None = True,
        rng: random.Random | None = None,
    ) -> None:
        self.guard = LoadGuard.from_config(guard)
        self._rng = rng if rng is not None else random.Random()

    def pick(
        self, req: RoutedRequest, views: Sequence[ReplicaView], totals: dict[str, float]
    ) -> tuple[list[str], str]:
        rand = self._rng.random
        get = totals.get
        # (-total, load, tiebreak, name): the random tiebreak makes every key unique
        keyed = [(-get(v.name, 0.0), v.load, rand(), v.name) for v in views]
        keyed.sort()
        guard = self.guard
        if guard is not None:
            min_load = min([k[1] for k in keyed])
            if guard.trips(keyed[0][1], min_load):
                by_load = sorted([(k[1], k[0], k[2], k[3]) for k in keyed])
                return [k[3] for k in by_load], GUARD
        ranked = [k[3] for k in keyed]
        if len(keyed) > 1 and keyed[0][0] == keyed[1][0]:
            return ranked, TIE
        return ranked, BY_SCORE
