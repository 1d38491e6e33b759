"""Cost-in-blocks scorer: prefill blocks still to do plus blocks held; lowest cost scores 1."""

from __future__ import annotations

import pytest

from policies import ReplicaView, RoutedRequest
from policies.scorers.cost_blocks import CostBlocksScorer

# 128 prompt tokens in 16-token blocks: 8 incoming blocks
REQ = RoutedRequest("r", "m", "m", "p", 128, tuple(range(8)), 16.0)
A = ReplicaView("a", hit_blocks=8)  # all cached, idle: cost 0
B = ReplicaView("b", hit_blocks=0)  # nothing cached, idle: cost 8
C = ReplicaView("c", hit_blocks=8, inflight=2, inflight_prompt_tokens=32)  # 2 + 2 * per_request


@pytest.mark.parametrize(
    ("options", "costs"),
    [
        ({}, [0.0, 8.0, 2.0 + 2 * 8.0]),
        ({"blocks_per_request": 1}, [0.0, 8.0, 4.0]),
        ({"prefill_load_scale": 0.5}, [0.0, 4.0, 1.0 + 16.0]),
    ],
)
def test_cost_blocks(options: dict[str, float], costs: list[float]) -> None:
    scorer = CostBlocksScorer(**options)
    assert [scorer.cost(REQ, v) for v in (A, B, C)] == pytest.approx(costs)
    scores = scorer.score(REQ, [A, B, C])
    lowest = min(costs)
    assert [scores[v.name] for v in (A, B, C)] == pytest.approx(
        [(1 + lowest) / (1 + c) for c in costs]
    )


def test_cost_blocks_rejects_negative_scale() -> None:
    with pytest.raises(ValueError, match="prefill_load_scale"):
        CostBlocksScorer(prefill_load_scale=-1)
