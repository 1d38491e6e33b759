"""Baseline pickers, so every benchmark compares policies like with like (same filters).

Config:

    picker: round_robin      # cycles through the candidates in the order the gateway lists them
    picker: least_loaded     # fewest requests ahead (ReplicaView.load), ties at random
    picker: random           # uniform, from the policy's seeded rng
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import Picker, SeededPicker
from policies.types import ReplicaView, RoutedRequest


class RoundRobinPicker(Picker):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def pick(
        self, req: RoutedRequest, views: Sequence[ReplicaView], totals: dict[str, float]
    ) -> tuple[list[str], str]:
        names = [v.name for v in views]
        i = self._next % len(names)
        self._next += 1
        return names[i:] + names[:i], "round_robin"


class LeastLoadedPicker(SeededPicker):
    name = "least_loaded"

    def pick(
        self, req: RoutedRequest, views: Sequence[ReplicaView], totals: dict[str, float]
    ) -> tuple[list[str], str]:
        rand = self._rng.random
        return [k[2] for k in sorted((v.load, rand(), v.name) for v in views)], "load"


class RandomPicker(SeededPicker):
    name = "random"

    def pick(
        self, req: RoutedRequest, views: Sequence[ReplicaView], totals: dict[str, float]
    ) -> tuple[list[str], str]:
        names = [v.name for v in views]
        self._rng.shuffle(names)
        return names, "random"
