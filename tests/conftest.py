"""`pytest -n 2` runs the suite on two pytest-xdist workers, split by folder into two sides that
never share a worker (`make test` runs one process: with the vLLM replicas busy on both cores a
few timing-sensitive gateway tests failed now and then on two):

- `redis`: the folders whose tests use the machine's Redis at 127.0.0.1:6379 (gateway, chaos,
  prefix_index, redis_ha): their fleet names, tenants and keys are shared, so they run one at a
  time, as before;
- `engine`: the real vLLM replicas (started once for tests/engine), the benches' smoke runs, the
  simulator, the policies and the repository checks, none of which touch that Redis.

A plain `pytest` (no `-n`) runs everything in one process, in the same order."""

from __future__ import annotations

from typing import Any

import pytest

REDIS_FOLDERS = frozenset({"gateway", "chaos", "prefix_index", "redis_ha"})


def side(nodeid: str) -> str:
    """The worker side of a test, by its folder under tests/."""
    parts = nodeid.split("::", 1)[0].split("/")
    return "redis" if len(parts) > 2 and parts[1] in REDIS_FOLDERS else "engine"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    # xdist's own --dist loadgroup reads a node id pytest 9 no longer keeps: a scheduler of
    # our own, each side one scope (one worker)
    from xdist.scheduler import LoadScopeScheduling

    class TwoSides(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return side(nodeid)

    return TwoSides(config, log)
