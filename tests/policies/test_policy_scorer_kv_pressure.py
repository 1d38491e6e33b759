"""KV pressure scorer: 1 - kv_usage, and a pessimistic value when usage is unknown."""

from __future__ import annotations

import math

import pytest

from policies import ReplicaView, RoutedRequest
from policies.scorers.kv_pressure import KVPressureScorer

REQ = RoutedRequest("r", "m", "m", "p", 64, (1, 2, 3, 4), 16.0)


@pytest.mark.parametrize(
    ("options", "usage", "expected"),
    [
        ({}, 0.0, 1.0),
        ({}, 0.2, 0.8),
        ({}, 1.0, 0.0),
        ({}, None, 0.5),  # unknown is not idle
        ({}, math.nan, 0.5),
        ({"unknown_usage": 0.8}, None, 0.2),
        ({"unknown_usage": 0.8}, 0.1, 0.9),
    ],
)
def test_kv_pressure_score(options: dict[str, float], usage: float | None, expected: float) -> None:
    scores = KVPressureScorer(**options).score(REQ, [ReplicaView("a", kv_usage=usage)])
    assert scores["a"] == pytest.approx(expected)


@pytest.mark.parametrize("bad", [-0.1, 1.5, "half"])
def test_kv_pressure_rejects_bad_unknown_usage(bad: object) -> None:
    with pytest.raises(ValueError, match="unknown_usage"):
        KVPressureScorer(unknown_usage=bad)  # type: ignore[arg-type]
