"""The gateway's background work: health probes and scrapes, discovery, KV events, token parity,
and draining the replicas a change removed.

`Background.sync(snapshot)` runs after every swap: it starts what the new snapshot needs (a
monitor per new replica, a watcher per pool under discovery, a KV-event subscription per
replica that publishes them) and stops what it no longer has. It reads the snapshot it is given,
never a global; what it finds (discovery's endpoints, a token-parity failure) goes back to the
gateway through the two callbacks, which make a new snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Iterable, Iterator
from typing import Any, Protocol

from gateway.fleet.discovery import DiscoveryConfig, DiscoveryError, open_discovery
from gateway.fleet.kv_events import KvEvents, check_parity
from gateway.fleet.pools import Pool
from gateway.fleet.replicas import ReplicaMonitor, ReplicaState
from gateway.runtime.snapshot import Snapshot
from gateway.transport.control import ControlClient, model_cards

log = logging.getLogger("gateway")

# the index holds at most this many entries per KV block its replicas have together (a
# replica's blocks are shared by all its scopes; an engine-reported entry and the routed guess
# of the same block count twice), and no more than index.max_blocks
ENTRIES_PER_KV_BLOCK = 2
MIN_INDEX_BOUND = 1_000
Endpoints = list[tuple[str, str]]  # (name, url) of every ready replica of a pool
Source = tuple[str, str | None]  # what a watcher discovers: (pool, None) or (pool, P/D role)


class SetEndpoints(Protocol):
    def __call__(self, pool: str, endpoints: Endpoints, role: str | None = None, /) -> None: ...


class Background:
    def __init__(
        self,
        session: ControlClient,
        current: Callable[[], Snapshot],
        set_endpoints: SetEndpoints,
        fall_back_to_bytes: Callable[[], None],
        received: Callable[[str], int] | None = None,
    ) -> None:
        """`received(url)`: bytes the request path received from a replica (its monitor hears
        the replica while they move)."""
        self.session = session
        self._received = received
        self._current = current
        self._set_endpoints = set_endpoints
        self._fall_back = fall_back_to_bytes
        self.kv_events: KvEvents | None = None
        self.parity: dict[str, int] = {}  # replica -> 1 same token ids, 0 different, -1 unknown
        self._monitors: dict[int, ReplicaMonitor] = {}  # id(ReplicaState) -> its monitor
        self._discovery: dict[Source, tuple[DiscoveryConfig, asyncio.Task[None]]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()  # subscriptions, drains, closes
        self._parity: asyncio.Task[None] | None = None
        self._index: object = None  # the index the replicas were last sized in
        self._bound_set = 0  # the bound last given that index (ENTRIES_PER_KV_BLOCK)

    def start(self, snap: Snapshot) -> None:
        if snap.config.index.events.enabled:
            self.kv_events = KvEvents()
        self.sync(snap)
        if snap.config.index.chunking.mode == "tokens":
            self._parity = asyncio.create_task(self._parity_loop(), name="token-parity")

    async def stop(self) -> None:
        if self._parity is not None:
            self._parity.cancel()
        if self.kv_events is not None:
            await self.kv_events.aclose()
        for _, task in self._discovery.values():
            task.cancel()
        await asyncio.gather(*(t for _, t in self._discovery.values()), return_exceptions=True)
        self._discovery.clear()
        for m in self._monitors.values():
            await m.stop()
        self._monitors.clear()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def busy(self) -> bool:
        """Some drain, subscription or close is still running."""
        return bool(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> None:
        """Run `coro` in the background, cancelled at `stop()`."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- what a snapshot needs ----------------------------------------------------------------
    def sync(self, snap: Snapshot) -> None:
        self._sync_monitors(snap)
        self._sync_discovery(snap)

    def _sync_monitors(self, snap: Snapshot) -> None:
        """Monitors for every live replica; a replica's index capacity set when it appears, and
        every replica's again when the snapshot brings a new index (a reload that changed it)."""
        fresh_index, self._index = snap.index is not self._index, snap.index
        if fresh_index:
            self._bound_set = 0
        for pool in (part for p in snap.pools.values() for part in p.parts()):
            for r in pool.replicas:
                known = id(r) in self._monitors
                if fresh_index or not known:
                    self._size(snap, r)
                if known:
                    continue
                m = ReplicaMonitor(
                    r, self.session, pool.config.health, pool.config.scrape, self._engine_kv,
                    self._lost, self._received,
                )
                m.models_refresh_s = pool.config.lora.refresh_s
                m.start()
                self._monitors[id(r)] = m
                if self.kv_events is not None and r.kv_events:
                    self.spawn(self._subscribe(r))
        self._bound(snap)

    def _size(self, snap: Snapshot, r: ReplicaState) -> None:
        """A replica's bound in the index: its configured `capacity_blocks`, else the KV its
        engine reports (`cache_config_info`, in index blocks), else the index's default."""
        if snap.index is None:
            return
        if r.capacity_blocks or r.engine_kv is not None:
            snap.index.set_capacity(r.name, capacity(snap, r))

    def _bound(self, snap: Snapshot) -> None:
        """The whole index's bound: `index.max_blocks`, and no more than ENTRIES_PER_KV_BLOCK
        entries per KV block of all the replicas together. Scopes are the clients' choice (a
        `cache_salt` per request), but an engine's KV is shared by all its scopes: more entries
        than that cannot all be true, and would only cost memory."""
        if snap.index is None:
            return
        kv = sum(
            capacity(snap, r)
            for p in snap.pools.values()
            for part in p.parts()
            for r in part.replicas
        )
        bound = min(snap.config.index.max_blocks, max(MIN_INDEX_BOUND, ENTRIES_PER_KV_BLOCK * kv))
        if bound != self._bound_set:
            self._bound_set = bound
            snap.index.set_max_blocks(bound)

    def _lost(self, r: ReplicaState, why: str) -> None:
        """The replica's prefix cache is gone: the index forgets it (in the background)."""
        index = self._current().index
        if index is not None:
            self.spawn(index.forget(r.name), name=f"forget:{r.name}")

    def _engine_kv(self, r: ReplicaState) -> None:
        """The engine reported its KV cache geometry (first, or changed): size the replica in the
        index by it, and name a block size that differs from tokens mode's (then no index block
        is an engine block, so precise routing cannot match)."""
        assert r.engine_kv is not None
        block_size, tokens = r.engine_kv
        snap = self._current()
        self._size(snap, r)
        self._bound(snap)
        chunker = snap.chunker
        log.info("replica %s: the engine holds %d tokens of KV in %d-token blocks", r.name, tokens, block_size)
        if chunker.mode == "tokens" and block_size != int(chunker.tokens_per_block):
            log.warning(
                "replica %s: the engine's KV block is %d tokens, index.chunking.block_size is %d: "
                "set them equal, or precise routing and KV events cannot match its blocks",
                r.name, block_size, int(chunker.tokens_per_block),
            )  # fmt: skip

    async def _subscribe(self, r: ReplicaState) -> None:
        model = await self.served_model(r)
        snap = self._current()
        if self.kv_events is not None and r.kv_events:
            self.kv_events.add(
                r.name, r.kv_events, r.kv_events_replay, snap.index, snap.chunker, model
            )

    def _sync_discovery(self, snap: Snapshot) -> None:
        """One watcher per pool, or P/D set, that uses discovery; restarted when its settings
        change."""
        wanted = dict(_discovered(snap))
        for source in list(self._discovery):
            cfg, task = self._discovery[source]
            if wanted.get(source) != cfg:
                task.cancel()
                del self._discovery[source]
        for source, dc in wanted.items():
            if source not in self._discovery:
                what = ".".join(filter(None, source))
                task = asyncio.create_task(self._watch(source, dc), name=f"discovery:{what}")
                self._discovery[source] = (dc, task)

    async def _watch(self, source: Source, cfg: DiscoveryConfig) -> None:
        pool, role = source
        try:
            async with contextlib.aclosing(open_discovery(cfg).watch()) as found:
                async for endpoints in found:
                    eps = [(e.name, e.url) for e in endpoints]
                    if role is None:
                        self._set_endpoints(pool, eps)
                    else:
                        self._set_endpoints(pool, eps, role)
        except DiscoveryError as exc:
            log.error("pool %s: discovery cannot run: %s", ".".join(filter(None, source)), exc)

    def is_new(self, r: ReplicaState) -> bool:
        return id(r) not in self._monitors

    # --- replicas that left -------------------------------------------------------------------
    def retire(self, gone: Iterable[ReplicaState], grace_s: float) -> None:
        """Stop watching replicas that left: requests already routed to them (or holding the
        snapshot that still has them) finish, then the index forgets them."""
        for r in gone:
            r.draining = True
            r.hand_over()  # its streams go on elsewhere (pools.<p>.resume)
            monitor = self._monitors.pop(id(r), None)
            self.spawn(self._drain(r, monitor, grace_s), name=f"drain:{r.name}")

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
        snap = self._current()
        if r.name not in {x.name for x in snap.replicas()}:  # a replica of that name may be back
            if self.kv_events is not None:
                await self.kv_events.remove(r.name)
            if snap.index is not None:
                await snap.index.forget(r.name)
        log.info("replica %s removed (pool %s)", r.name, r.pool)

    # --- token parity -------------------------------------------------------------------------
    async def _parity_loop(self) -> None:
        """Token parity, at start and then periodically: a mismatch means precise routing would
        silently never hit, so fall back to bytes mode, loudly."""
        while True:
            snap = self._current()
            if snap.chunker.mode != "tokens":  # already fell back
                return
            for r in snap.replicas():
                model = await self.served_model(r)
                same = await check_parity(self.session, r.url, model, snap.chunker)
                self.parity[r.name] = -1 if same is None else int(same)
                if same is False:
                    log.error(
                        "TOKEN PARITY FAILED: replica %s tokenizes (or renders chats) differently "
                        "from index.chunking.tokenizer / chat_template; falling back to bytes mode "
                        "(prefix routing keeps working from routing decisions; KV events are "
                        "ignored)",
                        r.name,
                    )
                    self._fall_back()
                    return
            await asyncio.sleep(snap.config.index.events.parity_interval_s)

    def stop_kv_events(self, snap: Snapshot) -> None:
        """The index no longer takes engine events (bytes mode cannot read them)."""
        if self.kv_events is None:
            return
        events, self.kv_events = self.kv_events, None
        if snap.index is not None:
            for name in list(events.subscribers):
                snap.index.set_precise(name, False)
        self.spawn(events.aclose())

    async def served_model(self, r: ReplicaState) -> str | None:
        """The model a replica serves: from config, else its /v1/models (first card)."""
        if r.models:
            return sorted(r.models)[0]
        cards = await model_cards(self.session, r.url, timeout_s=5.0)
        return str(cards[0]["id"]) if cards else None


def capacity(snap: Snapshot, r: ReplicaState) -> int:
    """A replica's KV in index blocks: its configured `capacity_blocks`, else what its engine
    reports, else `index.capacity_blocks`."""
    if r.capacity_blocks:
        return r.capacity_blocks
    if r.engine_kv is not None:
        return max(1, int(r.engine_kv[1] / snap.chunker.tokens_per_block))
    return snap.config.index.capacity_blocks


def _discovered(snap: Snapshot) -> Iterator[tuple[Source, DiscoveryConfig]]:
    """Every pool, and every P/D set, that uses discovery, with its settings."""
    for name, pool in snap.pools.items():
        sets: list[tuple[str | None, Pool]] = [(None, pool)]
        if pool.pd is not None:
            sets = [("prefill", pool.pd.prefill), ("decode", pool.pd.decode)]
        for role, part in sets:
            if part.config.discovery is not None:
                yield (name, role), part.config.discovery
