"""Max-score picker: highest weighted total wins, with a near-tie rule and a hot-spot guard.

Near ties: every candidate whose total is within `slack` (10 %) of the best counts as equally
good; among those the one holding the most of the prompt's blocks wins, then the one with the
fewest requests, then the one with the fewest blocks placed on it so far, then the highest
rendezvous hash of (the prompt's first block, replica name) (reason "tie", or "cold" when no
candidate holds any block); a prompt without block hashes falls back to a seeded random pick.
The rendezvous order is the same in every process, so gateways that share their load (and so
see the same requests and placed blocks) send a new prefix to the same replica. So a burst on a new prefix
stays with the replica already counted as holding it while the load scorers see no real
difference, and new prefixes spread over the fleet's caches even when they arrive one at a time
on an idle fleet; a replica that is clearly slower or busier still loses.
The guard: when the best-scoring replica's load exceeds the least-loaded candidate's by more
than `max_load_gap` requests *and* more than `max_load_ratio` times, rank by load instead
(reason "guard"). Either bound may be null to drop it; `guard: false` disables the guard.

    picker: max_score
    slack: 0.1
    guard: {max_load_gap: 8, max_load_ratio: 2.0}
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from policies.base import BY_SCORE, COLD, GUARD, TIE, SeededPicker
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


_MASK = (1 << 64) - 1
_names: dict[str, int] = {}  # replica name -> 64-bit digest (a cache of a pure function)


def _digest(name: str) -> int:
    d = _names.get(name)
    if d is None:
        if len(_names) >= 4096:
            _names.clear()
        d = _names[name] = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest())
    return d


def rendezvous(first_block: int, name: str) -> float:
    """A number in [0, 1) that depends only on (block, name), equal in every process: a
    splitmix64 finalizer over the name's digest xor the block hash; lower sorts first."""
    z = (_digest(name) ^ first_block) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) / 18446744073709551616.0


class MaxScorePicker(SeededPicker):
    name = "max_score"
    needs_prefix = False  # reads hit_blocks only when another plugin had the prompt hashed

    def __init__(
        self,
        *,
        guard: LoadGuard | Mapping[str, Any] | bool | None = True,
        rng: random.Random | None = None,
        slack: float = 0.1,
    ) -> None:
        if isinstance(slack, bool) or not isinstance(slack, int | float) or not 0 <= slack < 1:
            raise ValueError(f"slack must be a number in [0, 1), got {slack!r}")
        self.slack = float(slack)
        self.guard = LoadGuard.from_config(guard)
        super().__init__(rng=rng)

    def pick(
        self, req: RoutedRequest, views: Sequence[ReplicaView], totals: dict[str, float]
    ) -> tuple[list[str], str]:
        hashes = req.block_hashes
        if hashes:
            first = hashes[0]
            order = [rendezvous(first, v.name) for v in views]
        else:
            rand = self._rng.random
            order = [rand() for _ in views]
        get = totals.get
        best = max(totals.values(), default=0.0)
        floor = best * (1.0 - self.slack)
        # (-total, -hit, load, placed, tiebreak, name); a total within the slack counts as the
        # best; the tiebreak (rendezvous, else random) makes every key unique
        keyed = [
            (-(best if (t := get(v.name, 0.0)) >= floor else t), -v.hit_blocks, v.load,
             v.placed_blocks, o, v.name)
            for v, o in zip(views, order, strict=True)
        ]  # fmt: skip
        keyed.sort()
        guard = self.guard
        if guard is not None:
            min_load = min([k[2] for k in keyed])
            if guard.trips(keyed[0][2], min_load):
                by_load = sorted([(k[2], k[0], k[1], k[3], k[4], k[5]) for k in keyed])
                return [k[5] for k in by_load], GUARD
        ranked = [k[5] for k in keyed]
        if len(keyed) > 1 and keyed[0][0] == keyed[1][0]:
            cold = req.block_hashes and not any(v.hit_blocks for v in views)
            return ranked, COLD if cold else TIE
        return ranked, BY_SCORE
