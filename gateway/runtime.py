"""`Gateway`: everything the request path runs on, built once from a Config and passed down.

Pools (replica state + policy), the prefix index and chunker, the upstream HTTP session, metrics,
tracing and the background monitors. `start()`/`stop()` belong to the app's lifespan.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import aiohttp

from policies import Policy, build_policy
from prefix_index import PrefixIndex, open_index
from prefix_index.chunking import Chunker, make_chunker

from .admission import Admission
from .config import Config, PoolConfig
from .proxy import make_session
from .ratelimit import RateLimiter, open_rate_limiter
from .replicas import ReplicaMonitor, ReplicaState
from .telemetry import Metrics
from .tenants import TenantDirectory
from .tracing import Tracing


@dataclass(slots=True)
class Pool:
    name: str
    config: PoolConfig
    replicas: list[ReplicaState]
    policy: Policy
    by_name: dict[str, ReplicaState]

    def has_capacity(self) -> bool:
        """Some replica can take a request now (admission's gate; synchronous, cheap)."""
        now = time.monotonic()
        return any(r.inflight < r.max_inflight and r.available(now) for r in self.replicas)

    def any_available(self) -> bool:
        now = time.monotonic()
        return any(r.available(now) for r in self.replicas)


class Gateway:
    def __init__(self, config: Config, *, tracing: Tracing | None = None) -> None:
        self.config = config
        self.metrics = Metrics()
        self.tracing = tracing if tracing is not None else Tracing(config.tracing)
        ch = config.index.chunking
        self.chunker: Chunker = make_chunker(
            ch.mode, block_bytes=ch.block_bytes, tokenizer=ch.tokenizer, block_size=ch.block_size
        )
        self.tenants = TenantDirectory(config.auth, config.tenants, config.priority_classes)
        self.admission = Admission(
            config.priority_classes, shed_status=config.admission.shed_status
        )
        self.limiter: RateLimiter | None = None
        self.pools: dict[str, Pool] = {}
        for i, (name, pc) in enumerate(config.pools.items()):
            replicas = [ReplicaState.from_config(name, pc, rc) for rc in pc.replicas]
            for r in replicas:  # a circuit that closes may let queued requests through
                r.on_change = lambda r: self.admission.notify(r.pool)
            policy = build_policy(pc.policy, seed=i)
            self.pools[name] = Pool(name, pc, replicas, policy, {r.name: r for r in replicas})
        self.metrics.watch_replicas(self.all_replicas)
        self.metrics.watch_admission(self.admission)
        self.recent: deque[dict[str, Any]] = deque(maxlen=200)  # last routing decisions
        self.index: PrefixIndex | None = None
        self._session: aiohttp.ClientSession | None = None
        self._monitors: list[ReplicaMonitor] = []

    def all_replicas(self) -> list[ReplicaState]:
        return [r for p in self.pools.values() for r in p.replicas]

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Gateway.start() was not awaited"
        return self._session

    async def start(self) -> None:
        ic = self.config.index
        self.index = open_index(
            ic.backend, redis_url=ic.redis_url, capacity_blocks=ic.capacity_blocks, ttl_s=ic.ttl_s
        )
        rl = self.config.ratelimit
        if any(t.limits.rules() or t.limits.per_model for t in self.config.tenants):
            self.limiter = open_rate_limiter(rl.backend, rl.redis_url)
        set_capacity = getattr(self.index, "set_capacity", None)
        self._session = make_session(max(p.config.timeouts.connect_s for p in self.pools.values()))
        for pool in self.pools.values():
            for r in pool.replicas:
                if set_capacity is not None and r.capacity_blocks:
                    set_capacity(r.name, r.capacity_blocks)
                m = ReplicaMonitor(r, self._session, pool.config.health, pool.config.scrape)
                m.start()
                self._monitors.append(m)

    async def stop(self) -> None:
        for m in self._monitors:
            await m.stop()
        self._monitors.clear()
        if self.index is not None:
            await self.index.aclose()
        if self.limiter is not None:
            await self.limiter.aclose()
        if self._session is not None:
            await self._session.close()
        await self.tracing.aclose()
