"""`Gateway`: everything the request path runs on, built from a Config and passed down.

Pools (replica state + policy), the prefix index and chunker, tenants, rate limiter, admission,
the upstream HTTP session, metrics, tracing and the per-replica monitors. `start()`/`stop()`
belong to the app's lifespan; `reconfigure()` (hot reload) and `set_endpoints()` (discovery)
swap pools atomically, keeping the state of replicas that stay and draining those that go.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp

from policies import Policy, build_policy
from prefix_index import PrefixIndex, open_index
from prefix_index.chunking import Chunker, make_chunker

from .admission import Admission, shed_all
from .config import Config, PoolConfig, ReplicaConfig
from .discovery import DiscoveryConfig, DiscoveryError
from .http_client import HttpClient
from .kv_subscriber import KvEvents, check_parity
from .metrics import Metrics
from .proxy import AnswerBudget, LiveStreams
from .ratelimit import RateLimiter, open_rate_limiter
from .replicas import ReplicaMonitor, ReplicaState
from .router import Router
from .tenants import TenantDirectory
from .tracing import Tracing
from .window import RollingWindow

log = logging.getLogger("gateway")


@dataclass(slots=True)
class Pool:
    name: str
    config: PoolConfig
    replicas: list[ReplicaState]
    policy: Policy
    by_name: dict[str, ReplicaState]
    dispatches: int = 0  # dispatches counted so far (a match older than the last is re-checked)

    def has_capacity(self) -> bool:
        """Some replica can take a request now (admission's gate; synchronous, cheap)."""
        now = time.monotonic()
        return any(r.inflight < r.max_inflight and r.available(now) for r in self.replicas)

    def any_available(self) -> bool:
        now = time.monotonic()
        return any(r.available(now) for r in self.replicas)


def _chunker(config: Config) -> Chunker:
    ch = config.index.chunking
    return make_chunker(
        ch.mode,
        block_bytes=ch.block_bytes,
        tokenizer=ch.tokenizer,
        block_size=ch.block_size,
        chat_template=ch.chat_template,
    )


def _needs_limiter(config: Config) -> bool:
    return any(t.limits.rules() or t.limits.per_model for t in config.tenants)


_Update = tuple[ReplicaState, PoolConfig, ReplicaConfig]  # a kept replica's settings, deferred


async def _close_quietly(part: PrefixIndex | RateLimiter, what: str) -> None:
    try:
        await part.aclose()
    except Exception:
        log.warning("reload: closing %s failed", what, exc_info=True)


class Gateway:
    def __init__(self, config: Config, *, tracing: Tracing | None = None) -> None:
        self.config = config
        self.metrics = Metrics()
        self.tracing = tracing if tracing is not None else Tracing(config.tracing)
        self.chunker: Chunker = _chunker(config)
        self.router = Router(self)  # reads chunker and index from here on every request
        self.kv_events: KvEvents | None = None
        self.parity: dict[str, int] = {}  # replica -> 1 same token ids, 0 different, -1 unknown
        self.tenants = TenantDirectory(config.auth, config.tenants, config.priority_classes)
        self.admission = Admission(
            config.priority_classes, shed_status=config.admission.shed_status
        )
        self.limiter: RateLimiter | None = None
        self.pools: dict[str, Pool] = self._build_pools(config, {})
        self.metrics.watch_replicas(self.all_replicas)
        self.metrics.watch_admission(lambda: self.admission)
        self.recent: deque[tuple[Any, ...]] = deque(
            maxlen=200
        )  # last routing decisions, see decisions()
        self.window = RollingWindow()  # recent per-replica latencies and hit rates, for /dashboard
        self.index: PrefixIndex | None = None
        self.metrics.watch_index(lambda: (self.index, self.kv_events, self.parity))
        self._session: aiohttp.ClientSession | None = None  # probes, scrapes, /v1/models
        self._upstream: HttpClient | None = None  # the request path
        self._monitors: dict[int, ReplicaMonitor] = {}  # id(ReplicaState) -> its monitor
        self._discovery: dict[str, tuple[Any, asyncio.Task[None]]] = {}  # pool -> (config, watcher)
        self._retiring: set[asyncio.Task[Any]] = set()
        self._parity_task: asyncio.Task[None] | None = None
        self.answers = AnswerBudget()  # answer bytes held: server.max_answer_bytes_in_flight
        self.live_streams = LiveStreams()  # streams a graceful shutdown ends before it runs out

    # --- building ------------------------------------------------------------------------------
    def _build_pools(
        self, config: Config, old: dict[str, Pool], updates: list[_Update] | None = None
    ) -> dict[str, Pool]:
        """Pools for `config`, reusing replica states of `old`; with `updates`, the new settings
        of reused states are collected there instead of applied (see `_replicas`)."""
        pools: dict[str, Pool] = {}
        for i, (name, pc) in enumerate(config.pools.items()):
            prev = old.get(name)
            if pc.discovery is not None:  # keep what discovery found until it answers again
                same = prev is not None and prev.config.discovery == pc.discovery
                configs = self._configs_of(prev) if same else ()
                replicas = self._replicas(name, pc, configs, prev, updates)
            else:
                replicas = self._replicas(name, pc, pc.replicas, prev, updates)
            policy = (
                prev.policy
                if prev is not None and prev.config.policy == pc.policy
                else build_policy(pc.policy, seed=i)
            )
            pools[name] = Pool(name, pc, replicas, policy, {r.name: r for r in replicas})
        return pools

    def _replicas(
        self,
        pool: str,
        pc: PoolConfig,
        configs: Iterable[ReplicaConfig],
        prev: Pool | None,
        updates: list[_Update] | None = None,
    ) -> list[ReplicaState]:
        """Replica states for `configs`, reusing (and updating) those that already exist.

        With `updates`, a reused state is not touched: its update is appended there, to be applied
        at the swap, so that building pools for a config that then fails changes nothing.
        """
        out = []
        for rc in configs:
            old = prev.by_name.get(rc.display_name) if prev is not None else None
            if old is not None and old.url == rc.url:
                if updates is None:
                    old.update(pc, rc)
                else:
                    updates.append((old, pc, rc))
                out.append(old)
                continue
            r = ReplicaState.from_config(pool, pc, rc)
            r.on_change = lambda r: self.admission.notify(r.pool)  # a closed circuit frees capacity
            out.append(r)
        return out

    @staticmethod
    def _configs_of(pool: Pool | None) -> list[ReplicaConfig]:
        return [ReplicaConfig(url=r.url, name=r.name) for r in pool.replicas] if pool else []

    def decisions(self, last: int = 200) -> list[dict[str, Any]]:
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

    def all_replicas(self) -> list[ReplicaState]:
        return [r for p in self.pools.values() for r in p.replicas]

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Gateway.start() was not awaited"
        return self._session

    @property
    def upstream(self) -> HttpClient:
        assert self._upstream is not None, "Gateway.start() was not awaited"
        return self._upstream

    # --- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        self.index = self._open_index(self.config)
        if _needs_limiter(self.config):
            self.limiter = open_rate_limiter(
                self.config.ratelimit.backend, self.config.ratelimit.redis_url
            )
        connect_s = max(p.config.timeouts.connect_s for p in self.pools.values())
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=connect_s)
        )
        self._upstream = HttpClient(connect_s)
        if self.config.index.events.enabled:
            self.kv_events = KvEvents()
        self._sync_monitors()
        self._sync_discovery()
        if self.config.index.chunking.mode == "tokens":
            self._parity_task = asyncio.create_task(self._parity_loop(), name="token-parity")

    async def _parity_loop(self) -> None:
        """Token parity, at start and then periodically: a mismatch means precise routing would
        silently never hit, so fall back to bytes mode, loudly."""
        while True:
            chunker = self.chunker
            if getattr(chunker, "encode", None) is None:  # already fell back
                return
            for r in self.all_replicas():
                model = await self.served_model(r)
                same = await check_parity(self.session, r.url, model, chunker)
                self.parity[r.name] = -1 if same is None else int(same)
                if same is False:
                    log.error(
                        "TOKEN PARITY FAILED: replica %s tokenizes (or renders chats) differently "
                        "from index.chunking.tokenizer / chat_template; falling back to bytes mode (prefix routing "
                        "keeps working from routing decisions; KV events are ignored)",
                        r.name,
                    )
                    self.fall_back_to_bytes()
                    return
            await asyncio.sleep(self.config.index.events.parity_interval_s)

    def fall_back_to_bytes(self) -> None:
        self.chunker = make_chunker("bytes", block_bytes=self.config.index.chunking.block_bytes)
        if self.kv_events is not None:
            events, self.kv_events = self.kv_events, None
            for name in list(events.subscribers):
                set_precise = getattr(self.index, "set_precise", None)
                if set_precise is not None:
                    set_precise(name, False)
            task = asyncio.create_task(events.aclose())
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    async def served_model(self, r: ReplicaState) -> str | None:
        """The model a replica serves: from config, else its /v1/models (first card)."""
        if r.models:
            return sorted(r.models)[0]
        try:
            async with self.session.get(
                r.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=5)
            ) as res:
                data = await res.json() if res.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        cards = data.get("data") if isinstance(data, dict) else None
        if cards and isinstance(cards[0], dict) and isinstance(cards[0].get("id"), str):
            return str(cards[0]["id"])
        return None

    def _sync_discovery(self) -> None:
        """One watcher per pool that uses discovery; restarted when its settings change."""
        for name in list(self._discovery):
            cfg, task = self._discovery[name]
            pool = self.pools.get(name)
            if pool is None or pool.config.discovery != cfg:
                task.cancel()
                del self._discovery[name]
        for name, pool in self.pools.items():
            cfg = pool.config.discovery
            if cfg is not None and name not in self._discovery:
                task = asyncio.create_task(self._watch(name, cfg), name=f"discovery:{name}")
                self._discovery[name] = (cfg, task)

    async def _watch(self, pool: str, cfg: DiscoveryConfig) -> None:
        try:
            async with contextlib.aclosing(cfg.build().watch()) as found:
                async for endpoints in found:
                    self.set_endpoints(pool, [(e.name, e.url) for e in endpoints])
        except DiscoveryError as exc:
            log.error("pool %s: discovery cannot run: %s", pool, exc)

    @staticmethod
    def _open_index(config: Config) -> PrefixIndex:
        ic = config.index
        return open_index(
            ic.backend,
            redis_url=ic.redis_url,
            capacity_blocks=ic.capacity_blocks,
            ttl_s=ic.ttl_s,
            routed_ttl_s=ic.events.routed_ttl_s,
            max_blocks=ic.max_blocks,
        )

    async def stop(self) -> None:
        if self._parity_task is not None:
            self._parity_task.cancel()
        if self.kv_events is not None:
            await self.kv_events.aclose()
        for _, task in self._discovery.values():
            task.cancel()
        await asyncio.gather(*(t for _, t in self._discovery.values()), return_exceptions=True)
        self._discovery.clear()
        for m in self._monitors.values():
            await m.stop()
        self._monitors.clear()
        for t in list(self._retiring):
            t.cancel()
        await asyncio.gather(*self._retiring, return_exceptions=True)
        if self.index is not None:
            await self.index.aclose()
        if self.limiter is not None:
            await self.limiter.aclose()
        if self._session is not None:
            await self._session.close()
        if self._upstream is not None:
            await self._upstream.aclose()
        await self.tracing.aclose()

    def _sync_monitors(self) -> None:
        """Monitors for every live replica; a replica's index capacity set when it appears."""
        set_capacity = getattr(self.index, "set_capacity", None)
        for pool in self.pools.values():
            for r in pool.replicas:
                if id(r) in self._monitors:
                    continue
                if set_capacity is not None and r.capacity_blocks:
                    set_capacity(r.name, r.capacity_blocks)
                m = ReplicaMonitor(r, self.session, pool.config.health, pool.config.scrape)
                m.start()
                self._monitors[id(r)] = m
                if self.kv_events is not None and r.kv_events:
                    self._track(self._subscribe(r))

    async def _subscribe(self, r: ReplicaState) -> None:
        if self.kv_events is not None and r.kv_events:
            model = await self.served_model(r)
            self.kv_events.add(
                r.name, r.kv_events, r.kv_events_replay, self.index, self.chunker, model
            )

    def _track(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def _retire(self, gone: Iterable[ReplicaState], grace_s: float) -> None:
        """Stop routing to replicas that left: in-flight requests finish, then the index forgets them."""
        for r in gone:
            r.draining = True
            monitor = self._monitors.pop(id(r), None)
            task = asyncio.create_task(self._drain(r, monitor, grace_s), name=f"drain:{r.name}")
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    async def _drain(self, r: ReplicaState, monitor: ReplicaMonitor | None, grace_s: float) -> None:
        if monitor is not None:
            await monitor.stop()
        if not await r.drained(grace_s):
            log.warning(
                "replica %s: %d requests still in flight after %.0f s of draining",
                r.name,
                r.inflight,
                grace_s,
            )
        live = {x.name for x in self.all_replicas()}
        if self.kv_events is not None and r.name not in live:
            await self.kv_events.remove(r.name)
        if self.index is not None and r.name not in live:  # a replica of that name may be back
            await self.index.forget(r.name)
        log.info("replica %s removed (pool %s)", r.name, r.pool)

    # --- changes while running -------------------------------------------------------------------
    async def reconfigure(self, config: Config) -> None:
        """Swap in a new, already validated config without dropping in-flight requests.

        All or nothing: every new part (pools, tenants, chunker, index, limiter, admission) is
        built first, and only then swapped in; if building any raises, the exception propagates
        and nothing has changed (parts built so far are closed). Kept: replicas that stay
        (circuit, load, counters), policies whose spec is unchanged (their learned state), the
        index and the rate limiter when their settings are unchanged.
        """
        old = self.config
        updates: list[_Update] = []
        pools = self._build_pools(config, self.pools, updates)
        tenants = TenantDirectory(config.auth, config.tenants, config.priority_classes)
        chunker = self.chunker if config.index.chunking == old.index.chunking else _chunker(config)
        admission = self.admission
        if config.priority_classes != old.priority_classes or config.admission != old.admission:
            admission = Admission(config.priority_classes, shed_status=config.admission.shed_status)
        index, limiter = await self._open_stores(config)
        kept = {id(r) for p in pools.values() for r in p.replicas}
        gone = [r for r in self.all_replicas() if id(r) not in kept]
        # the swap: no await between these lines, so every request sees one config or the other
        old_index, old_limiter, old_admission = self.index, self.limiter, self.admission
        for state, pc, rc in updates:
            state.update(pc, rc)
        self.config, self.pools, self.tenants, self.chunker = config, pools, tenants, chunker
        self.index, self.limiter, self.admission = index, limiter, admission
        self._retire(gone, max((p.config.timeouts.total_s for p in pools.values()), default=60.0))
        self._sync_monitors()
        self._sync_discovery()
        # what is left only retires the old parts: the new config is active whatever happens here
        if old_admission is not admission:
            shed = shed_all(old_admission)
            if shed:
                log.warning("reload: priority classes changed; %d queued requests were shed", shed)
        if old_index is not index and old_index is not None:
            log.warning("reload: index settings changed; the prefix index starts empty")
            await _close_quietly(old_index, "the old prefix index")
        if old_limiter is not limiter and old_limiter is not None:
            await _close_quietly(old_limiter, "the old rate limiter")

    async def _open_stores(self, config: Config) -> tuple[PrefixIndex | None, RateLimiter | None]:
        """The index and rate limiter for `config`: the running ones when their settings are
        unchanged, else new ones; if one fails to open, the other new one is closed again."""
        old = self.config
        index, limiter = self.index, self.limiter
        opened: list[PrefixIndex | RateLimiter] = []
        try:
            if config.index != old.index:
                index = self._open_index(config)
                opened.append(index)
            if not _needs_limiter(config):
                limiter = None
            elif limiter is None or config.ratelimit != old.ratelimit:
                limiter = open_rate_limiter(config.ratelimit.backend, config.ratelimit.redis_url)
                opened.append(limiter)
        except BaseException:
            for part in opened:
                await _close_quietly(part, "a part of the config that was not applied")
            raise
        return index, limiter

    def set_endpoints(self, pool_name: str, endpoints: Iterable[tuple[str, str]]) -> None:
        """Discovery's answer for a pool: (name, url) of every ready replica, the whole set."""
        pool = self.pools.get(pool_name)
        if pool is None:
            return
        configs = [ReplicaConfig(url=url, name=name) for name, url in endpoints]
        replicas = self._replicas(pool_name, pool.config, configs, pool)
        kept = {id(r) for r in replicas}
        gone = [r for r in pool.replicas if id(r) not in kept]
        added = [r.name for r in replicas if id(r) not in self._monitors]
        pool.replicas, pool.by_name = replicas, {r.name: r for r in replicas}
        self._retire(gone, pool.config.timeouts.total_s)
        self._sync_monitors()
        if added or gone:
            log.info(
                "pool %s: discovery added %s, removed %s", pool_name, added, [r.name for r in gone]
            )
        self.admission.notify(pool_name)
