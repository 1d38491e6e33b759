"""Queue scorer: fewer requests ahead is better, relative to the least-loaded candidate.

    load  = max(inflight, waiting + running)        (ReplicaView.load: the gateway's own count
                                                     covers dispatches the last scrape missed)
    score = (1 + min_load) / (1 + load)             (1.0 for the least loaded)

Unlike (max - q) / (max - min), one extra request on an idle fleet does not swing the score
from 1 to 0, and at high load the score reflects the ratio between replicas.

    scorers:
      queue: 2
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import Scorer
from policies.types import ReplicaView, RoutedRequest


class QueueScorer(Scorer):
    name = "queue"
    reason = "load"

    def score(self, req: RoutedRequest, views: Sequence[ReplicaView]) -> dict[str, float]:
        loads = {v.name: v.load for v in views}
        floor = 1.0 + min(loads.values(), default=0)
        return {name: floor / (1.0 + load) for name, load in loads.items()}
