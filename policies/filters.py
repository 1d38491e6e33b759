"""The built-in filters: a replica that is down, serves another model, or is full gets nothing.

Pool selection happens in the gateway before a policy runs: every view passed in is in the pool.
"""

from __future__ import annotations

from policies.base import Filter
from policies.types import ReplicaView, RoutedRequest


class Healthy(Filter):
    """Keeps replicas that pass health checks, are not draining and whose circuit is not open.

    A half-open circuit is kept: its trial requests are how the circuit closes again.

        filters: [healthy]
    """

    name = "healthy"

    def keep(self, req: RoutedRequest, view: ReplicaView) -> str | None:
        if view.healthy and not view.draining and view.circuit != "open":
            return None
        if not view.healthy:
            return "unhealthy"
        if view.draining:
            return "draining"
        return "circuit open"


class ServesModel(Filter):
    """Keeps replicas whose model list is empty (serves the pool's model) or names the request's.

    Config:

        filters: [serves_model]
    """

    name = "serves_model"

    def keep(self, req: RoutedRequest, view: ReplicaView) -> str | None:
        if not view.models or req.model in view.models:
            return None
        return f"does not serve model {req.model!r}"


class NotSaturated(Filter):
    """Keeps replicas with a free slot: gateway in-flight count below `max_inflight`.

    When every replica is full the decision has no candidates; the gateway's admission queue
    waits for a slot rather than overfilling one.

        filters: [not_saturated]
    """

    name = "not_saturated"

    def keep(self, req: RoutedRequest, view: ReplicaView) -> str | None:
        if view.inflight < view.max_inflight:
            return None
        return f"saturated ({view.inflight}/{view.max_inflight} in flight)"
