"""`Gateway`: the current `Snapshot`, the parts that outlive snapshots, and the changes.

What outlives a snapshot: metrics, tracing, the rolling window and recent decisions, the upstream
HTTP client and its answer budget, the live streams a shutdown must end, the background work.
Every change (a reload, discovery's answer, the tokens-mode fallback) builds a new snapshot and
swaps it in with one assignment; requests keep the snapshot they took.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from gateway.config import Config, ReplicaConfig
from gateway.fleet.kv_events import KvEvents
from gateway.fleet.metrics import ReplicaCollector
from gateway.fleet.pools import Pool, Update, apply_updates, replica_states, with_set
from gateway.fleet.replicas import ReplicaState
from gateway.fleet.shared_load import FleetLoad, start_fleet_load
from gateway.fleet.tier_metrics import TierCollector
from gateway.limits.admission import Admission, shed_all
from gateway.limits.budgets import AnswerBudget, LiveStreams
from gateway.limits.metrics import AdmissionCollector
from gateway.limits.ratelimit import RateLimiter
from gateway.limits.tenants import TenantDirectory
from gateway.routing.router import Router
from gateway.runtime.background import Background
from gateway.runtime.snapshot import (
    Built,
    Snapshot,
    build_snapshot,
    bytes_chunker,
    close_quietly,
    open_stores,
    save_index,
    warm_start,
)
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.tracing import Tracing
from gateway.telemetry.window import RollingWindow
from gateway.transport.client import HttpClient
from gateway.transport.control import ControlClient, open_control_client
from prefix_index import PrefixIndex
from prefix_index.chunking import Chunker

log = logging.getLogger("gateway")

DECISIONS_KEPT = 200  # routing decisions kept for /debug/decisions and the dashboard


class Gateway:
    def __init__(self, config: Config, *, tracing: Tracing | None = None) -> None:
        self.current: Snapshot = build_snapshot(config, None, self._replica_changed).snapshot
        self.metrics = Metrics()
        self.tracing = tracing if tracing is not None else Tracing(config.tracing)
        self.window = RollingWindow()  # recent per-replica latencies and hit rates, for /dashboard
        self.recent: deque[tuple[Any, ...]] = deque(maxlen=DECISIONS_KEPT)  # see decisions()
        self.answers = AnswerBudget()  # answer bytes held: server.max_answer_bytes_in_flight
        self.live_streams = LiveStreams()  # streams a graceful shutdown ends before it runs out
        self._session: ControlClient | None = None  # probes, scrapes, /v1/models
        self._upstream: HttpClient | None = None  # the request path
        self._background: Background | None = None
        self.fleet: FleetLoad | None = None  # shared load with the fleet's other gateways
        self.metrics.watch(ReplicaCollector(self.all_replicas))
        self.metrics.watch(AdmissionCollector(lambda: self.current.admission))
        self.metrics.watch_index(lambda: (self.current.index, self.kv_events, self.parity))
        self.metrics.watch_redis(
            lambda: (("index", self.current.index), ("ratelimit", self.current.limiter))
        )
        self.metrics.watch_tracing(lambda: self.tracing.sink)
        self.metrics.watch(TierCollector(lambda: self.pools))

    # --- the current snapshot's parts (read-only; a change is a new snapshot) --------------------
    @property
    def config(self) -> Config:
        return self.current.config

    @property
    def pools(self) -> Mapping[str, Pool]:
        return self.current.pools

    @property
    def tenants(self) -> TenantDirectory:
        return self.current.tenants

    @property
    def admission(self) -> Admission:
        return self.current.admission

    @property
    def chunker(self) -> Chunker:
        return self.current.chunker

    @property
    def index(self) -> PrefixIndex | None:
        return self.current.index

    @property
    def limiter(self) -> RateLimiter | None:
        return self.current.limiter

    @property
    def router(self) -> Router:
        return self.current.router

    @property
    def kv_events(self) -> KvEvents | None:
        return self._background.kv_events if self._background is not None else None

    @property
    def parity(self) -> dict[str, int]:
        return self._background.parity if self._background is not None else {}

    def all_replicas(self) -> list[ReplicaState]:
        return self.current.replicas()

    @property
    def session(self) -> ControlClient:
        assert self._session is not None, "Gateway.start() was not awaited"
        return self._session

    @property
    def upstream(self) -> HttpClient:
        assert self._upstream is not None, "Gateway.start() was not awaited"
        return self._upstream

    @property
    def background(self) -> Background:
        assert self._background is not None, "Gateway.start() was not awaited"
        return self._background

    def notify_capacity(self, pool: str) -> None:
        """A request of `pool` ended or a circuit changed: wake its admission queue."""
        self.current.admission.notify(pool)

    def _replica_changed(self, r: ReplicaState) -> None:
        self.notify_capacity(r.pool)  # a closed circuit frees capacity

    def decisions(self, last: int = DECISIONS_KEPT) -> list[dict[str, Any]]:
        """The last routing decisions as JSON-ready dicts, oldest first."""
        out = []
        for t, request_id, pool, prompt_tokens, blocks, decision in list(self.recent)[-last:]:
            d = {
                "t": t,
                "request_id": request_id,
                "pool": pool,
                "prompt_tokens": prompt_tokens,
                "blocks": blocks,
            }
            d.update(decision.explain())
            out.append(d)
        return out

    # --- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        built = Built(self.current, [])  # the same snapshot, now with its index and limiter
        await open_stores(built)
        self.current = built.snapshot
        warm_start(self.current)
        connect_s = max(p.config.timeouts.connect_s for p in self.current.pools.values())
        self._session = open_control_client(connect_s)
        self._upstream = HttpClient(connect_s)
        self._background = Background(
            self._session, lambda: self.current, self.set_endpoints, self.fall_back_to_bytes,
            self._upstream.received,
        )
        self._background.start(self.current)
        self.fleet = start_fleet_load(lambda: self.current, self.notify_capacity, self.metrics.registry)

    async def stop(self) -> None:
        if self.fleet is not None:
            await self.fleet.stop()
        if self._background is not None:
            await self._background.stop()
        snap = self.current
        save_index(snap)
        if snap.index is not None:
            await snap.index.aclose()
        if snap.limiter is not None:
            await snap.limiter.aclose()
        if self._session is not None:
            await self._session.aclose()
        if self._upstream is not None:
            await self._upstream.aclose()
        await self.tracing.aclose()

    def use_index(self, index: PrefixIndex | None) -> None:
        """Route with `index` from now on (a benchmark's own index; nothing is closed)."""
        self.current = self.current.replace(index=index)

    # --- changes while running -------------------------------------------------------------------
    async def reconfigure(self, config: Config) -> None:
        """Swap in a new, already validated config without dropping in-flight requests.

        All or nothing: the new snapshot is built (and its new stores opened) beside the running
        one; if any part fails, the exception propagates and nothing has changed. Then one
        assignment swaps it in; what is left only retires the old parts.
        """
        old = self.current
        built = build_snapshot(config, old, self._replica_changed)
        await open_stores(built)
        new = built.snapshot
        kept = {id(r) for r in new.replicas()}
        gone = [r for r in old.replicas() if id(r) not in kept]
        built.apply()  # kept replicas take their new settings: no await from here to the swap
        self.current = new
        background = self.background
        background.retire(gone, max((p.config.timeouts.total_s for p in new.pools.values()), default=60.0))
        background.sync(new)
        if old.admission is not new.admission:
            shed = shed_all(old.admission)
            if shed:
                log.warning("reload: priority classes changed; %d queued requests were shed", shed)
        if old.index is not new.index and old.index is not None:
            log.warning("reload: index settings changed; the prefix index starts empty")
            background.spawn(close_quietly(old.index, "the old prefix index"))
        if old.limiter is not new.limiter and old.limiter is not None:
            background.spawn(close_quietly(old.limiter, "the old rate limiter"))

    def set_endpoints(
        self, pool_name: str, endpoints: Iterable[tuple[str, str]], role: str | None = None
    ) -> None:
        """Discovery's answer for a pool, or for a P/D pool's `role` set (prefill | decode):
        (name, url) of every ready replica, the whole set."""
        snap = self.current
        whole = snap.pools.get(pool_name)
        if whole is None or (role is None) != (whole.pd is None):  # a reload changed its kind
            return
        pool: Pool = whole if role is None else getattr(whole.pd, role)
        configs = [ReplicaConfig(url=url, name=name) for name, url in endpoints]
        if role is not None:  # a name is one replica of the pool: the other set's names stay its
            others = {r.name for r in whole.replicas if r.name not in pool.by_name}
            if clash := sorted(c.display_name for c in configs if c.display_name in others):
                log.warning("pool %s.%s: discovery found %s, already in the other set; skipped",
                            pool_name, role, clash)  # fmt: skip
                configs = [c for c in configs if c.display_name not in others]
        updates: list[Update] = []
        replicas = replica_states(
            pool_name, pool.config, configs, pool, self._replica_changed, updates
        )
        apply_updates(updates)
        kept = {id(r) for r in replicas}
        gone = [r for r in pool.replicas if id(r) not in kept]
        background = self.background
        added = [r.name for r in replicas if background.is_new(r)]
        new = pool.with_replicas(replicas) if role is None else with_set(whole, role, replicas)
        self.current = snap.replace(pools={**snap.pools, pool_name: new})
        background.retire(gone, pool.config.timeouts.total_s)
        background.sync(self.current)
        if added or gone:
            where = pool_name if role is None else f"{pool_name}.{role}"
            removed = [r.name for r in gone]
            log.info("pool %s: discovery added %s, removed %s", where, added, removed)
        self.notify_capacity(pool_name)

    def fall_back_to_bytes(self) -> None:
        """Token parity failed: route in bytes mode from now on, without KV events."""
        snap = self.current
        self.current = snap.replace(chunker=bytes_chunker(snap.config))
        self.background.stop_kv_events(snap)
