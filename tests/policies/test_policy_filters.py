"""Filters: healthy (half-open allowed), serves the model, not saturated."""

from __future__ import annotations

import pytest

from policies import ReplicaView, RoutedRequest
from policies.filters import Healthy, NotSaturated, ServesModel

REQ = RoutedRequest("r", "llama", "llama", "p", 64, (1, 2, 3, 4), 16.0)


@pytest.mark.parametrize(
    ("plugin", "view", "removed_because"),
    [
        (Healthy(), ReplicaView("a"), None),
        (Healthy(), ReplicaView("a", circuit="half_open"), None),
        (Healthy(), ReplicaView("a", healthy=False), "unhealthy"),
        (Healthy(), ReplicaView("a", circuit="open"), "circuit open"),
        (Healthy(), ReplicaView("a", draining=True), "draining"),
        (ServesModel(), ReplicaView("a"), None),
        (ServesModel(), ReplicaView("a", models=frozenset({"llama", "qwen"})), None),
        (ServesModel(), ReplicaView("a", models=frozenset({"qwen"})), "does not serve model"),
        (NotSaturated(), ReplicaView("a", inflight=63, max_inflight=64), None),
        (NotSaturated(), ReplicaView("a", inflight=64, max_inflight=64), "saturated (64/64"),
        (NotSaturated(), ReplicaView("a", inflight=0, max_inflight=0), "saturated"),
    ],
)
def test_filter(
    plugin: Healthy | ServesModel | NotSaturated, view: ReplicaView, removed_because: str | None
) -> None:
    why = plugin.keep(REQ, view)
    if removed_because is None:
        assert why is None
    else:
        assert why is not None and removed_because in why
