"""Prefix scorer: hit_blocks / n_blocks, 0 when the request has no full block."""

from __future__ import annotations

import pytest

from policies import ReplicaView, RoutedRequest
from policies.scorers.prefix import PrefixScorer


def _req(n_blocks: int) -> RoutedRequest:
    return RoutedRequest("r", "m", "m", "p", n_blocks * 16, tuple(range(n_blocks)), 16.0)


@pytest.mark.parametrize(
    ("n_blocks", "hits", "expected"),
    [
        (8, [8, 4, 0], [1.0, 0.5, 0.0]),
        (3, [1, 2, 3], [1 / 3, 2 / 3, 1.0]),
        (1, [0, 0], [0.0, 0.0]),
        (0, [0, 0], [0.0, 0.0]),  # no full block: nothing to match
    ],
)
def test_prefix_score(n_blocks: int, hits: list[int], expected: list[float]) -> None:
    views = [ReplicaView(f"r{i}", hit_blocks=h) for i, h in enumerate(hits)]
    scores = PrefixScorer().score(_req(n_blocks), views)
    assert [scores.get(v.name, 0.0) for v in views] == pytest.approx(expected)
