"""The shared prefix index: the memory backend's semantics kept in Redis for many gateways.

One round trip per match (a binary search in Lua); writes batched; an outage degrades, logs once.
One node, Sentinel or Cluster (prefix_index/redis_client.py opens the URL). A lost index (flush,
restart or failover to an empty node) is noticed by a marker key and refilled from this
gateway's journal of recent records (prefix_index/_rebuild.py).
Bounded like the memory backend: every key expires with the TTL, and a namespace-wide scope
LRU (kept by the flusher after the writes, off the request path) trims the least recently
recorded scopes when the entries of all scopes exceed `max_blocks`.

This module is the index's contract (and its local view and cache); the connection through
outages is prefix_index/_link.py, the writes' sender, outage buffer and journal replay
prefix_index/_flusher.py, the scope accounts and the bound prefix_index/_accounts.py. Precise
mode (KV events, lower tiers) keeps the engine's entries per gateway: prefix_index/_redis_local.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import RedisError

from prefix_index._accounts import ScopeAccounts
from prefix_index._bound import check_bounds
from prefix_index._fastlane import pack_chain
from prefix_index._flusher import Flusher
from prefix_index._link import SHA, RedisLink, RedisTuning
from prefix_index._redis_local import LocalEntries
from prefix_index._writes import Write
from prefix_index.base import IndexStats, PrefixIndex
from prefix_index.constants import (
    DEFAULT_CAPACITY_BLOCKS,
    DEFAULT_LOCAL_CACHE_S,
    DEFAULT_MAX_BLOCKS,
    DEFAULT_NAMESPACE,
    DEFAULT_REDIS_TTL_S,
    DEFAULT_ROUTED_TTL_S,
    ScopeKeys,
    replica_scopes_key,
    replicas_key,
)
from prefix_index.memory import MemoryIndex
from prefix_index.redis_client import OUTAGE, RedisHealth, parse_redis_url, redact_url

__all__ = ["REDIS_BYTES_PER_ENTRY", "RedisIndex", "RedisTuning"]

# Redis memory per (replica, block) entry for `stats()`, measured by bench/index.py on Redis
# 7.0: about 330-420 B for a block one replica holds, about 100-120 B per further replica.
REDIS_BYTES_PER_ENTRY = 300

_MATCH_SHA = SHA["match"].encode()
_CACHE_MAX = 8192
_KEYS_MAX = 4096
_HINTS_MAX = 4
_log = logging.getLogger("prefix_index")


class RedisIndex(LocalEntries, PrefixIndex):
    """A PrefixIndex in Redis, shared by every gateway that uses the same url and namespace.

    `capacity_blocks` per replica and scope, `ttl_s` (None: entries never age out), `namespace`
    prefixes every key, `local_cache_s` (0: off) lets an identical lookup skip Redis for that
    long (this gateway's own writes to the scope invalidate it), `clock` gives wall-clock
    seconds shared by all gateways. Never raises on an outage: see docs/prefix_index.md.

    `max_blocks` bounds the namespace as MemoryIndex bounds itself (entries of all scopes plus
    SCOPE_COST_BLOCKS per scope; the least recently recorded scopes lose entries first). Each
    write's reply says how many entries it added; the flusher sends these to the namespace's
    scope accounts when the queue empties (or every second under load) and trims there, so a
    match stays one round trip and a batch of writes one pipeline. The bound may be overshot by
    what all gateways wrote since their last account. With a TTL every key the backend writes
    expires, and scopes idle past it are swept from the accounts (their keys deleted).

    Precise mode (EngineEventSink, prefix_index/_redis_local.py): engine-reported entries and
    tiers stay in this process; routed records of a replica marked with `set_precise` are
    written to Redis with `routed_ttl_s` (or `ttl_s` if shorter) as their life.
    """

    def __init__(
        self,
        url: str,
        *,
        capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
        ttl_s: float | None = DEFAULT_REDIS_TTL_S,
        namespace: str = DEFAULT_NAMESPACE,
        local_cache_s: float = DEFAULT_LOCAL_CACHE_S,
        clock: Callable[[], float] = time.time,
        tuning: RedisTuning | None = None,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        routed_ttl_s: float = DEFAULT_ROUTED_TTL_S,
    ) -> None:
        check_bounds(capacity_blocks, max_blocks, ttl_s, routed_ttl_s)
        if not namespace or "{" in namespace or "}" in namespace:
            raise ValueError(f"namespace must be non-empty and without braces, got {namespace!r}")
        self.url = url
        self.namespace = namespace
        self._target = target = parse_redis_url(url)  # RedisUrlError (a ValueError) if bad
        self._tuning = t = tuning or RedisTuning()
        self._default_capacity = capacity_blocks
        self._capacity: dict[str, int] = {}
        self._ttl_ms = 0 if ttl_s is None else max(1, round(ttl_s * 1000))
        routed_ms = max(1, round(routed_ttl_s * 1000))
        self._routed_ttl_ms = min(routed_ms, self._ttl_ms) if self._ttl_ms else routed_ms
        self._cache_s = local_cache_s
        self._clock = clock
        # the local view (this gateway's own routed writes) also holds the engine's entries
        engine = MemoryIndex(
            capacity_blocks, ttl_s, clock, routed_ttl_s=routed_ttl_s, max_blocks=max_blocks
        )
        self._local = engine if t.local_view else None
        self._engine = engine
        self._engine_fed = False
        self._precise: set[str] = set()
        view = "this gateway's own view" if self._local is not None else "zero hits"
        self._link = link = RedisLink(target, namespace, t, self._ttl_ms, view, self._on_down,
                                      self._on_back, self._on_lost)  # fmt: skip
        self.health: RedisHealth = link.health
        self._accounts = ScopeAccounts(link, namespace, self._ttl_ms, max_blocks, t.forget_batch)
        self._flusher = Flusher(link, self._accounts, t, self._now_ms)
        self._keys: dict[str, ScopeKeys] = {}
        self._cache: dict[tuple[Any, ...], tuple[float, dict[str, int]]] = {}
        self._generation: dict[str, int] = {}  # scope -> count of this gateway's writes
        self._hints: dict[str, bytes] = {}  # scope -> depths recent matches stopped at

    @property
    def healthy(self) -> bool:
        return not self._link.down

    # -- lifecycle ----------------------------------------------------------------------------

    async def connect(self) -> bool:
        """Check Redis and load the scripts; optional (the first call connects). Never raises:
        returns False and starts recovering in the background when Redis is out."""
        try:
            await self._link.ping()
            await self._link.check_marker()
        except OUTAGE as exc:
            self._link.went_down(exc)
            return False
        return True

    async def flush(self) -> bool:
        """Wait until queued writes reached Redis; False if some stay buffered (Redis out)."""
        return await self._flusher.flush()

    async def aclose(self) -> None:
        if self._link.closed:
            return
        if not self._link.down:
            try:
                async with asyncio.timeout(self._tuning.write_timeout_s):
                    await self.flush()
            except TimeoutError:
                pass
        self._link.closed = True
        await self._flusher.stop()
        await self._link.aclose()
        self._flusher.queue.resolve_all()

    # -- the contract -------------------------------------------------------------------------

    async def match(
        self, scope: str, hashes: Sequence[int], replicas: Sequence[str]
    ) -> dict[str, int]:
        if not hashes or not replicas:
            return dict.fromkeys(replicas, 0)
        link = self._link
        if link.down or link.closed:
            return self._local_answer(scope, hashes, replicas)
        answer: dict[str, int] | None = None
        generation = self._generation.get(scope, 0)
        cache_key: tuple[Any, ...] | None = None
        if self._cache_s > 0:
            cache_key = (scope, len(hashes), hashes[-1], generation, *replicas)
            hit = self._cache.get(cache_key)
            if hit is not None and hit[0] > time.monotonic():
                answer = dict(hit[1])
        if answer is None:
            keys = self._scope_keys(scope)
            command = link.lane.command(
                (b"EVALSHA", _MATCH_SHA, b"1", keys.seq, keys.prefix, b"%d" % self._now_ms(),
                 pack_chain(hashes), self._hints.get(scope, b"")),
                replicas,
            )  # fmt: skip
            try:
                reply = await link.lane.call(command, link.load_scripts)
            except OUTAGE as exc:
                link.went_down(exc)
                return self._local_answer(scope, hashes, replicas)
            except RedisError as exc:
                link.complain("match", exc)
                return self._local_answer(scope, hashes, replicas)
            depths = [int(d) for d in reply.split(b",")]
            answer = dict(zip(replicas, depths, strict=True))
            self._remember_depths(scope, depths)
            if cache_key is not None and self._generation.get(scope, 0) == generation:
                if len(self._cache) >= _CACHE_MAX:
                    self._cache.clear()
                self._cache[cache_key] = (time.monotonic() + self._cache_s, answer)
                answer = dict(answer)
        if self._engine_fed:  # KV events: the engine's word is kept here, not in Redis
            return self._with_engine(scope, hashes, replicas, answer)
        local = self._local
        if local is not None and self._flusher.pending:
            # this gateway's own records still on their way to Redis count as they will: the
            # next request of a burst on a new prefix finds its first one's blocks
            for name, depth in local.match_now(scope, hashes, replicas).items():
                if depth > answer[name]:
                    answer[name] = depth
        return answer

    async def record(self, scope: str, replica: str, hashes: Sequence[int]) -> None:
        write = self._record_write(scope, replica, hashes)
        if write is not None:
            await self._write(scope, write)

    def record_nowait(self, scope: str, replica: str, hashes: Sequence[int]) -> bool:
        """`record` queued without waiting for Redis (the local view has it at once): the
        router's write at dispatch, which must not hold a pool's admission turn. Always taken
        (True): queued (buffered while Redis is out), or nothing to write (no hashes, closed)."""
        write = self._record_write(scope, replica, hashes)
        if write is not None:
            self._write_nowait(scope, write)
        return True

    def _record_write(self, scope: str, replica: str, hashes: Sequence[int]) -> Write | None:
        if not hashes or self._link.closed:
            return None
        if self._local is not None:
            self._local.record_now(scope, replica, hashes)
        keys = self._scope_keys(scope)
        now = self._now_ms()
        if replica in self._precise:  # a guess until the engine reports (set_precise)
            expiry = now + self._routed_ttl_ms
        else:
            expiry = now + self._ttl_ms if self._ttl_ms else 0
        capacity = self._capacity.get(replica, self._default_capacity)
        step = self._tuning.segment_blocks
        # Deepest segment first: each call's blocks are more recent than the deeper ones, so
        # the LRU order is the one a single call would give, and no call holds Redis long.
        commands: list[tuple[Any, ...]] = [
            ("EVALSHA", SHA["record"], 1, keys.seq, keys.prefix, now, self._ttl_ms, capacity,
             replica, pack_chain(hashes[start : start + step]), expiry)
            for start in reversed(range(0, len(hashes), step))
        ]  # fmt: skip
        scopes_of = replica_scopes_key(self.namespace, replica)
        replicas = replicas_key(self.namespace)
        commands.append(("SADD", scopes_of, keys.sid))
        commands.append(("SADD", replicas, replica))
        if self._ttl_ms:
            commands.append(("PEXPIRE", scopes_of, self._ttl_ms))
            commands.append(("PEXPIRE", replicas, self._ttl_ms))
        write = Write(commands, blocks=len(hashes))
        self._flusher.journal.add(scope, replica, hashes, write)
        self._link.last_write_at = time.monotonic()
        return write

    async def evict(self, scope: str, replica: str, hashes: Sequence[int]) -> None:
        if not hashes or self._link.closed:
            return
        if self._local is not None:
            self._local.evict_now(scope, replica, hashes)
        self._flusher.journal.drop_chain(scope, replica, hashes)
        keys = self._scope_keys(scope)
        command = ("EVALSHA", SHA["evict"], 1, keys.seq, keys.prefix, self._now_ms(),
                   self._ttl_ms, replica, pack_chain(hashes))  # fmt: skip
        await self._write(scope, Write([command], blocks=len(hashes)))

    async def forget(self, replica: str) -> None:
        if self._link.closed:
            return
        self._engine.forget_now(replica)  # the local view, engine entries and tiers
        self._flusher.journal.drop_replica(replica)
        await self._write(None, Write([], forget=replica))

    def set_capacity(self, replica: str, blocks: int) -> None:
        """Capacity of one replica in blocks (per scope), applied at its next record."""
        if blocks < 0:
            raise ValueError(f"capacity must be >= 0, got {blocks}")
        self._capacity[replica] = blocks
        if self._local is not None:
            self._local.set_capacity(replica, blocks)

    def set_max_blocks(self, blocks: int) -> None:
        """The namespace's bound from now on (trimmed to at this process's next upkeep), and
        the local index's."""
        self._engine.set_max_blocks(blocks)
        self._accounts.max_blocks = blocks

    async def stats(self) -> IndexStats:
        """Entries per replica across all gateways of the namespace (three round trips); the
        scope count and `bound_evicted` come from the namespace's scope accounts."""
        base = IndexStats(
            backend="redis",
            healthy=not self._link.down,
            pending_writes=len(self._flusher.queue),
            dropped_writes=self._flusher.queue.dropped,
        )
        if self._link.down or self._link.closed:
            return self._engine_stats(base)
        try:
            per_replica, scopes, evicted = await self._accounts.counts()
        except OUTAGE as exc:
            self._link.went_down(exc)
            return self._engine_stats(base)
        entries = sum(per_replica.values())
        return self._engine_stats(IndexStats(
            backend="redis",
            blocks_per_replica=per_replica,
            entries=entries,
            bytes_estimate=entries * REDIS_BYTES_PER_ENTRY,
            pending_writes=len(self._flusher.queue),
            dropped_writes=self._flusher.queue.dropped,
            scopes=scopes,
            bound_evicted=evicted,
        ))  # fmt: skip

    # -- writes: queued, batched, buffered through an outage ----------------------------------

    async def _write(self, scope: str | None, write: Write) -> None:
        """Queue a write; wait for its batch unless Redis is out (then it stays buffered)."""
        self._write_nowait(scope, write, wait=True)
        if write.done is not None:
            await asyncio.shield(write.done)

    def _write_nowait(self, scope: str | None, write: Write, wait: bool = False) -> None:
        if scope is None:
            self._generation = {s: g + 1 for s, g in self._generation.items()}
            self._cache.clear()
        else:
            if len(self._generation) >= _KEYS_MAX and scope not in self._generation:
                self._generation.clear()  # scopes are the client's choice: keep this bounded
                self._cache.clear()  # (a cached answer is valid only with its generation)
            self._generation[scope] = self._generation.get(scope, 0) + 1
        if wait and not self._link.down:
            write.done = asyncio.get_running_loop().create_future()
        flusher = self._flusher
        flusher.queue.push(write)
        flusher.kick()

    # -- what the link reports: Redis out, back, or without the index -------------------------

    def _on_down(self) -> None:
        self._cache.clear()
        self._flusher.queue.resolve_all()

    def _on_back(self, lost: bool, down_s: float) -> None:
        _log.info(
            "prefix index: %s is back after %.1f s; replaying %d buffered writes (%d dropped)",
            self._target.where, down_s, len(self._flusher.queue), self._flusher.queue.dropped,
        )  # fmt: skip
        if lost:
            self._rebuild()
        self._flusher.kick()

    def _on_lost(self) -> None:
        self._rebuild()
        self._flusher.kick()

    def _rebuild(self) -> None:
        """Queue this gateway's journal again: the scope accounts start over from its replies."""
        writes = self._flusher.replay()
        self.health.rebuilds += 1
        self.health.replayed_writes += len(writes)
        self._accounts.reset()
        self._cache.clear()
        self._generation = {s: g + 1 for s, g in self._generation.items()}
        _log.warning(
            "prefix index: %s lost the index of namespace %r (flushed, restarted or failed over "
            "to an empty node); re-writing this gateway's %d most recent records (%d blocks)",
            self._target.where, self.namespace, len(writes), sum(w.blocks for w in writes),
        )  # fmt: skip

    # -- helpers -------------------------------------------------------------------------------

    def _remember_depths(self, scope: str, depths: list[int]) -> None:
        """Keep depths several replicas stopped at (a shared system prompt's end, say) as
        hints for the scope's next match; a depth only one replica has is no use to a group."""
        seen: dict[int, int] = {}
        for depth in depths:
            if depth:
                seen[depth] = seen.get(depth, 0) + 1
        common = sorted((d for d, c in seen.items() if c > 1), key=seen.__getitem__, reverse=True)
        if not common:
            return  # nothing learnt: keep what the scope had
        if len(self._hints) >= _KEYS_MAX:
            self._hints.clear()
        self._hints[scope] = b",".join(b"%d" % d for d in common[:_HINTS_MAX])

    def _scope_keys(self, scope: str) -> ScopeKeys:
        keys = self._keys.get(scope)
        if keys is None:
            if len(self._keys) >= _KEYS_MAX:
                self._keys.clear()
            keys = self._keys[scope] = ScopeKeys.of(self.namespace, scope)
        return keys

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)


_redacted = redact_url  # the URL as logs may show it
