"""`Pool`: one pool's replicas and policy, and `build_pools`, which makes them from a config.

A pool keeps the state of its replicas (`ReplicaState`: circuit, load, counters) across reloads
and discovery: a replica that stays (same name and URL) keeps its state object, one that is new
gets a fresh one. Building never touches a running replica: the new settings of kept replicas
are returned as `updates`, applied only when the new snapshot is swapped in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from policies import Policy, build_policy

from .config import Config, PoolConfig, ReplicaConfig
from .replicas import ReplicaState

Update = tuple[ReplicaState, PoolConfig, ReplicaConfig]  # a kept replica's new settings, deferred
OnChange = Callable[[ReplicaState], None]  # a replica's circuit changed (frees or takes capacity)


@dataclass(slots=True)
class Pool:
    name: str
    config: PoolConfig
    replicas: tuple[ReplicaState, ...]
    policy: Policy
    by_name: Mapping[str, ReplicaState]
    dispatches: int = 0  # dispatches counted so far (a match older than the last is re-checked)

    def has_capacity(self) -> bool:
        """Some replica can take a request now (admission's gate; synchronous, cheap)."""
        now = time.monotonic()
        return any(r.has_slot() and r.available(now) for r in self.replicas)

    def any_available(self) -> bool:
        now = time.monotonic()
        return any(r.available(now) for r in self.replicas)

    def with_replicas(self, replicas: Iterable[ReplicaState]) -> Pool:
        """The same pool (config, policy and its learned state) over another replica set."""
        kept = tuple(replicas)
        return Pool(
            self.name, self.config, kept, self.policy, {r.name: r for r in kept}, self.dispatches
        )


def build_pools(
    config: Config, old: Mapping[str, Pool], on_change: OnChange, updates: list[Update]
) -> dict[str, Pool]:
    """Pools for `config`, reusing the replica states and unchanged policies of `old`.

    A pool under discovery keeps the replicas discovery found until it answers again (when its
    discovery settings are unchanged).
    """
    pools: dict[str, Pool] = {}
    for i, (name, pc) in enumerate(config.pools.items()):
        prev = old.get(name)
        if pc.discovery is not None:
            same = prev is not None and prev.config.discovery == pc.discovery
            configs = replica_configs(prev) if same and prev is not None else []
        else:
            configs = list(pc.replicas)
        replicas = replica_states(name, pc, configs, prev, on_change, updates)
        policy = (
            prev.policy
            if prev is not None and prev.config.policy == pc.policy
            else build_policy(pc.policy, seed=i)
        )
        pools[name] = Pool(name, pc, replicas, policy, {r.name: r for r in replicas})
    return pools


def replica_states(
    pool: str,
    pc: PoolConfig,
    configs: Iterable[ReplicaConfig],
    prev: Pool | None,
    on_change: OnChange,
    updates: list[Update],
) -> tuple[ReplicaState, ...]:
    """Replica states for `configs`: those of `prev` with the same name and URL are kept (their
    new settings appended to `updates`), the others are new."""
    out = []
    for rc in configs:
        old = prev.by_name.get(rc.display_name) if prev is not None else None
        if old is not None and old.url == rc.url:
            updates.append((old, pc, rc))
            out.append(old)
            continue
        r = ReplicaState.from_config(pool, pc, rc)
        r.on_change = on_change
        out.append(r)
    return tuple(out)


def apply_updates(updates: Iterable[Update]) -> None:
    """Kept replicas take their new settings (at the swap: nothing awaits in between)."""
    for state, pc, rc in updates:
        state.update(pc, rc)


def replica_configs(pool: Pool) -> list[ReplicaConfig]:
    """What discovery found for `pool`, as replica configs (to rebuild it under a new config)."""
    return [ReplicaConfig(url=r.url, name=r.name) for r in pool.replicas]
