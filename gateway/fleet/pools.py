"""`Pool`: one pool's replicas and policy, and `build_pools`, which makes them from a config.

A pool keeps the state of its replicas (`ReplicaState`: circuit, load, counters) across reloads
and discovery: a replica that stays (same name and URL) keeps its state object, one that is new
gets a fresh one. Building never touches a running replica: the new settings of kept replicas
are returned as `updates`, applied only when the new snapshot is swapped in. Its by-tier audit
(predicted vs served prefix tokens, docs/tiers.md) carries over too, so its counters only grow.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from gateway.config import Config, PoolConfig, ReplicaConfig
from gateway.fleet.replicas import ReplicaState
from policies import Policy, build_policy
from prefix_index.tiers import TierAudit

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
    pd: PdSets | None = None  # a disaggregated pool's two sets (its `replicas`: both, together)
    # predicted vs served prefix tokens by tier, fed by Dispatch.finished (a P/D pool's: its sets')
    audit: TierAudit = field(default_factory=TierAudit)

    def has_capacity(self) -> bool:
        """Some replica can take a request now (admission's gate; synchronous, cheap)."""
        if self.pd is not None:
            return self.pd.prefill.has_capacity() and self.pd.decode.has_capacity()
        now = time.monotonic()
        return any(r.has_slot() and r.available(now) for r in self.replicas)

    def any_available(self) -> bool:
        if self.pd is not None:
            return self.pd.prefill.any_available() and self.pd.decode.any_available()
        now = time.monotonic()
        return any(r.available(now) for r in self.replicas)

    def max_model_len(self) -> int | None:
        """The longest context its replicas' engines report (None: none reported one yet)."""
        best = None
        for r in self.replicas:
            n = r.max_model_len
            if n is not None and (best is None or n > best):
                best = n
        return best

    def answer_bound(self, prompt_tokens: int) -> int:
        """What the answer of a request without max_tokens may cost: `default_max_tokens`, no
        more than the engine's context leaves after the prompt (its `max_model_len` from
        /v1/models); 0 when neither is known (the prompt alone is charged)."""
        default = self.config.default_max_tokens
        context = self.max_model_len()
        room = None if context is None else max(0, context - prompt_tokens)
        if default is None:
            return room or 0
        return default if room is None else min(default, room)

    def parts(self) -> tuple[Pool, ...]:
        """The pools whose settings its replicas run under: itself, or a P/D pool's two sets."""
        return (self,) if self.pd is None else (self.pd.prefill, self.pd.decode)

    def with_replicas(self, replicas: Iterable[ReplicaState]) -> Pool:
        """The same pool (config, policy and its learned state) over another replica set."""
        kept = tuple(replicas)
        by_name = {r.name: r for r in kept}
        return Pool(
            self.name, self.config, kept, self.policy, by_name, self.dispatches, audit=self.audit
        )


@dataclass(slots=True)
class PdSets:
    """A disaggregated pool's sets, each a pool of the same name over its role's replicas."""

    protocol: str  # vllm-nixl | sglang
    prefill: Pool
    decode: Pool


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
        if pc.prefill is not None:
            pools[name] = pd_pool(name, pc, prev, on_change, updates, i)
            continue
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
        audit = prev.audit if prev is not None and prev.pd is None else TierAudit()
        pools[name] = Pool(name, pc, replicas, policy, {r.name: r for r in replicas}, audit=audit)
    return pools


def pd_pool(
    name: str,
    pc: PoolConfig,
    prev: Pool | None,
    on_change: OnChange,
    updates: list[Update],
    seed: int,
) -> Pool:
    """A disaggregated pool: a prefill and a decode pool (each with its set's settings), and the
    pool that holds both (what health, metrics and status iterate)."""
    from gateway.config.sections import role_config

    parts = []
    for role in ("prefill", "decode"):
        rpc = role_config(pc, role)
        old = getattr(prev.pd, role) if prev is not None and prev.pd is not None else None
        configs: Iterable[ReplicaConfig] = rpc.replicas
        if rpc.discovery is not None:  # what discovery found, while its settings are unchanged
            kept = old is not None and old.config.discovery == rpc.discovery
            configs = replica_configs(old) if kept and old is not None else []
        replicas = replica_states(name, rpc, configs, old, on_change, updates)
        same = old is not None and old.config.policy == pc.policy
        policy = old.policy if same and old is not None else build_policy(pc.policy, seed=seed)
        audit = old.audit if old is not None else TierAudit()
        parts.append(Pool(name, rpc, replicas, policy, {r.name: r for r in replicas}, audit=audit))
    return pd_whole(PdSets(pc.protocol or "vllm-nixl", parts[0], parts[1]), pc)


def pd_whole(sets: PdSets, pc: PoolConfig, dispatches: int = 0) -> Pool:
    """The pool that holds both sets (its `replicas`: the prefill set's, then the decode set's)."""
    both = sets.prefill.replicas + sets.decode.replicas
    by_name = {r.name: r for r in both}
    return Pool(sets.prefill.name, pc, both, sets.prefill.policy, by_name, dispatches, sets)


def with_set(pool: Pool, role: str, replicas: Iterable[ReplicaState]) -> Pool:
    """A disaggregated pool whose `role` set (prefill | decode) has other replicas (discovery's)."""
    assert pool.pd is not None
    pd = pool.pd
    prefill, decode = pd.prefill, pd.decode
    if role == "prefill":
        prefill = prefill.with_replicas(replicas)
    else:
        decode = decode.with_replicas(replicas)
    return pd_whole(PdSets(pd.protocol, prefill, decode), pool.config, pool.dispatches)


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

