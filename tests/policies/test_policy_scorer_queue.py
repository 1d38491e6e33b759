"""Queue scorer: (1 + min_load) / (1 + load), load = max(inflight, waiting + running)."""

from __future__ import annotations

import pytest

from policies import ReplicaView, RoutedRequest
from policies.scorers.queue import QueueScorer

REQ = RoutedRequest("r", "m", "m", "p", 64, (1, 2, 3, 4), 16.0)


@pytest.mark.parametrize(
    ("views", "expected"),
    [
        (
            [ReplicaView("a"), ReplicaView("b", inflight=1), ReplicaView("c", inflight=3)],
            [1.0, 0.5, 0.25],
        ),
        ([ReplicaView("a", inflight=5), ReplicaView("b", inflight=5)], [1.0, 1.0]),
        # the scrape sees more than the gateway sent (another gateway, or requests still queued)
        (
            [ReplicaView("a", inflight=1, waiting=4, running=2), ReplicaView("b", inflight=2)],
            [3 / 7, 1.0],
        ),
        # a stale scrape that says idle does not hide the gateway's own dispatches
        (
            [ReplicaView("a", inflight=3, waiting=0, running=0), ReplicaView("b", inflight=1)],
            [0.5, 1.0],
        ),
        ([ReplicaView("a", inflight=10), ReplicaView("b", inflight=11)], [1.0, 11 / 12]),
    ],
)
def test_queue_score(views: list[ReplicaView], expected: list[float]) -> None:
    scores = QueueScorer().score(REQ, views)
    assert [scores[v.name] for v in views] == pytest.approx(expected)
