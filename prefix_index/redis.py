"""The shared prefix index: the memory backend's semantics kept in Redis for many gateways.

One round trip per match (a binary search in Lua); writes batched; an outage degrades, logs once.
One node, Sentinel or Cluster (prefix_index/redis_client.py opens the URL). A lost index (flush,
restart or failover to an empty node) is noticed by a marker key and refilled from this
gateway's journal of recent records (prefix_index/_rebuild.py).
Bounded like the memory backend: every key expires with the TTL, and a namespace-wide scope
LRU (kept by the flusher after the writes, off the request path) trims the least recently
recorded scopes when the entries of all scopes exceed `max_blocks`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import (
    ClusterDownError,
    NoPermissionError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from prefix_index import _lua
from prefix_index._fastlane import ClusterLane, FastLane, Lane, pack_chain
from prefix_index._rebuild import EpochMarker, Journal
from prefix_index._writes import Write, WriteQueue
from prefix_index.base import IndexStats, PrefixIndex
from prefix_index.constants import (
    DEFAULT_CAPACITY_BLOCKS,
    DEFAULT_LOCAL_CACHE_S,
    DEFAULT_MAX_BLOCKS,
    DEFAULT_NAMESPACE,
    DEFAULT_REDIS_TTL_S,
    SCOPE_COST_BLOCKS,
    SIZES_EVICTED,
    ScopeKeys,
    replica_scopes_key,
    replicas_key,
    scopes_key,
    sid_of_prefix,
    sizes_key,
)
from prefix_index.memory import MemoryIndex
from prefix_index.redis_client import Client, RedisHealth, open_redis, parse_redis_url, redact_url

# Redis memory per (replica, block) entry for `stats()`, measured by bench/index.py on Redis
# 7.0: about 330-420 B for a block one replica holds, about 100-120 B per further replica.
REDIS_BYTES_PER_ENTRY = 300

# A Cluster mid-failover answers CLUSTERDOWN / TRYAGAIN or has slots no node serves: an outage
# too (buffer, answer locally, probe), not a refusal to drop writes over.
_OUTAGE = (RedisConnectionError, RedisTimeoutError, OSError, TimeoutError, ClusterDownError,
           TryAgainError, RedisClusterException)  # fmt: skip
_SCRIPTS = {
    "match": _lua.MATCH,
    "record": _lua.RECORD,
    "evict": _lua.EVICT,
    "forget": _lua.FORGET,
    "drop": _lua.DROP,
    "account": _lua.ACCOUNT,
    "oldest": _lua.OLDEST,
}
_SHA = {name: hashlib.sha1(src.encode()).hexdigest() for name, src in _SCRIPTS.items()}
_MATCH_SHA = _SHA["match"].encode()
_SIZED = {_SHA["record"], _SHA["evict"]}  # writes whose reply is the change in entries
_CACHE_MAX = 8192
_KEYS_MAX = 4096
_HINTS_MAX = 4
_UPKEEP_MS = 1000  # under a steady stream of writes, settle the scope accounts this often...
_UPKEEP_SCOPES = 1024  # ...or once this many scopes have changed
_SWEEP_MS = 1000  # look for scopes idle past the TTL this often (client clock)
_TRIM_SCOPES = 256  # scopes one trim or sweep round handles
_TRIM_ROUNDS = 64  # rounds one upkeep may spend trimming (the next one goes on)


@dataclass(frozen=True, slots=True)
class RedisTuning:
    """Knobs an operator rarely turns (defaults suit a Redis on the same network)."""

    timeout_s: float = 0.25  # a match (or probe) slower than this counts as an outage
    write_timeout_s: float = 5.0  # a batch of writes slower than this counts as an outage
    retry_s: float = 1.0  # first probe interval while Redis is out (doubles up to 10x)
    max_pending: int = 10_000  # writes buffered while Redis is out; the oldest go first
    local_view: bool = True  # keep this gateway's own writes in memory, answer from it when out
    write_batch: int = 256  # writes per pipeline
    write_batch_blocks: int = 32_768  # ...and blocks per pipeline
    segment_blocks: int = 512  # blocks per record call: bounds how long one call holds Redis
    forget_batch: int = 2_000  # entries one forget call removes (keeps Redis responsive)
    idle_connections: int = 32  # match connections kept open between calls
    check_s: float = 1.0  # look for the namespace's marker this often (0: never; lost data)
    journal_writes: int = 4096  # recent records kept to refill a Redis that lost the index...
    journal_blocks: int = 262_144  # ...and their blocks (8 B each); 0 writes: no journal


class RedisIndex(PrefixIndex):
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
    ) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        if max_blocks <= SCOPE_COST_BLOCKS:
            raise ValueError(f"max_blocks must be > {SCOPE_COST_BLOCKS}, got {max_blocks}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive or None, got {ttl_s}")
        if not namespace or "{" in namespace or "}" in namespace:
            raise ValueError(f"namespace must be non-empty and without braces, got {namespace!r}")
        self.url = url
        self.namespace = namespace
        self._target = parse_redis_url(url)  # RedisUrlError (a ValueError) for a bad one
        self._tuning = t = tuning or RedisTuning()
        self._default_capacity = capacity_blocks
        self._capacity: dict[str, int] = {}
        self._ttl_ms = 0 if ttl_s is None else max(1, round(ttl_s * 1000))
        self._max_blocks = max_blocks
        self._cache_s = local_cache_s
        self._clock = clock
        self._log = logging.getLogger("prefix_index")
        self._local = (
            MemoryIndex(capacity_blocks, ttl_s, clock, max_blocks=max_blocks)
            if t.local_view
            else None
        )
        # Entries this gateway's writes added per scope (sid -> [delta, last record ms or 0]),
        # not yet sent to the namespace's scope accounts.
        self._carry: dict[str, list[int]] = {}
        self._carry_entries = 0
        self._next_upkeep = 0
        self._next_sweep = 0
        self._client: Client | None = None
        self._lane: Lane = (
            ClusterLane(self._redis, t.timeout_s)
            if self._target.kind == "cluster"
            else FastLane(lambda: self._node().connection_pool, t.timeout_s, t.idle_connections)
        )
        self.health = RedisHealth()
        self._journal = Journal(t.journal_writes, t.journal_blocks)
        self._marker = EpochMarker(namespace, cluster=self._target.kind == "cluster")
        self._watcher: asyncio.Task[None] | None = None
        # this gateway's newest record, in real seconds (the marker's life is Redis time, not the
        # injected clock's)
        self._last_write_at: float | None = None
        self._master_at: tuple[str, int] | None = None  # Sentinel: where the master was
        self._retired: set[asyncio.Task[None]] = set()  # clients of a former master, closing
        self._queue = WriteQueue(t.max_pending, t.write_batch, t.write_batch_blocks)
        self._flusher: asyncio.Task[None] | None = None
        self._prober: asyncio.Task[None] | None = None
        self._down = False
        self._down_since = 0.0
        self._closed = False
        self._complaints: set[str] = set()
        self._keys: dict[str, ScopeKeys] = {}
        self._cache: dict[tuple[Any, ...], tuple[float, dict[str, int]]] = {}
        self._generation: dict[str, int] = {}  # scope -> count of this gateway's writes
        self._hints: dict[str, bytes] = {}  # scope -> depths recent matches stopped at

    @property
    def healthy(self) -> bool:
        return not self._down

    # -- lifecycle ----------------------------------------------------------------------------

    async def connect(self) -> bool:
        """Check Redis and load the scripts; optional (the first call connects). Never raises:
        returns False and starts recovering in the background when Redis is out."""
        try:
            await self._ping()
            await self._check_marker()
        except _OUTAGE as exc:
            self._went_down(exc)
            return False
        return True

    async def flush(self) -> bool:
        """Wait until queued writes reached Redis; False if some stay buffered (Redis out)."""
        while True:
            task = self._flusher
            if task is not None and not task.done():
                await asyncio.shield(task)
            elif self._queue and not self._down and not self._closed:
                self._kick()
            else:
                return not self._queue

    async def aclose(self) -> None:
        if self._closed:
            return
        if not self._down:
            try:
                async with asyncio.timeout(self._tuning.write_timeout_s):
                    await self.flush()
            except TimeoutError:
                pass
        self._closed = True
        for task in (self._flusher, self._prober, self._watcher):
            if task is not None and not task.done():
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        await self._lane.reset()
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        for task in list(self._retired):
            task.cancel()
        await asyncio.gather(*self._retired, return_exceptions=True)
        self._queue.resolve_all()

    # -- the contract -------------------------------------------------------------------------

    async def match(
        self, scope: str, hashes: Sequence[int], replicas: Sequence[str]
    ) -> dict[str, int]:
        if not hashes or not replicas:
            return dict.fromkeys(replicas, 0)
        if self._down or self._closed:
            return self._local_answer(scope, hashes, replicas)
        generation = self._generation.get(scope, 0)
        cache_key: tuple[Any, ...] | None = None
        if self._cache_s > 0:
            cache_key = (scope, len(hashes), hashes[-1], generation, *replicas)
            hit = self._cache.get(cache_key)
            if hit is not None and hit[0] > time.monotonic():
                return dict(hit[1])
        keys = self._scope_keys(scope)
        command = self._lane.command(
            (b"EVALSHA", _MATCH_SHA, b"1", keys.seq, keys.prefix, b"%d" % self._now_ms(),
             pack_chain(hashes), self._hints.get(scope, b"")),
            replicas,
        )  # fmt: skip
        try:
            answer = await self._lane.call(command, self._load_scripts)
        except _OUTAGE as exc:
            self._went_down(exc)
            return self._local_answer(scope, hashes, replicas)
        except RedisError as exc:
            self._complain("match", exc)
            return self._local_answer(scope, hashes, replicas)
        depths = [int(d) for d in answer.split(b",")]
        result = dict(zip(replicas, depths, strict=True))
        self._remember_depths(scope, depths)
        if cache_key is not None and self._generation.get(scope, 0) == generation:
            if len(self._cache) >= _CACHE_MAX:
                self._cache.clear()
            self._cache[cache_key] = (time.monotonic() + self._cache_s, result)
            return dict(result)
        return result

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
        if not hashes or self._closed:
            return None
        if self._local is not None:
            self._local.record_now(scope, replica, hashes)
        keys = self._scope_keys(scope)
        now = self._now_ms()
        expiry = now + self._ttl_ms if self._ttl_ms else 0
        capacity = self._capacity.get(replica, self._default_capacity)
        step = self._tuning.segment_blocks
        # Deepest segment first: each call's blocks are more recent than the deeper ones, so
        # the LRU order is the one a single call would give, and no call holds Redis long.
        commands: list[tuple[Any, ...]] = [
            ("EVALSHA", _SHA["record"], 1, keys.seq, keys.prefix, now, self._ttl_ms, capacity,
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
        self._journal.add(scope, replica, hashes, write)
        self._last_write_at = time.monotonic()
        return write

    async def evict(self, scope: str, replica: str, hashes: Sequence[int]) -> None:
        if not hashes or self._closed:
            return
        if self._local is not None:
            self._local.evict_now(scope, replica, hashes)
        self._journal.drop_chain(scope, replica, hashes)
        keys = self._scope_keys(scope)
        command = ("EVALSHA", _SHA["evict"], 1, keys.seq, keys.prefix, self._now_ms(),
                   self._ttl_ms, replica, pack_chain(hashes))  # fmt: skip
        await self._write(scope, Write([command], blocks=len(hashes)))

    async def forget(self, replica: str) -> None:
        if self._closed:
            return
        if self._local is not None:
            self._local.forget_now(replica)
        self._journal.drop_replica(replica)
        await self._write(None, Write([], forget=replica))

    def set_capacity(self, replica: str, blocks: int) -> None:
        """Capacity of one replica in blocks (per scope), applied at its next record."""
        if blocks < 0:
            raise ValueError(f"capacity must be >= 0, got {blocks}")
        self._capacity[replica] = blocks
        if self._local is not None:
            self._local.set_capacity(replica, blocks)

    async def stats(self) -> IndexStats:
        """Entries per replica across all gateways of the namespace (three round trips); the
        scope count and `bound_evicted` come from the namespace's scope accounts."""
        base = IndexStats(
            backend="redis",
            healthy=not self._down,
            pending_writes=len(self._queue),
            dropped_writes=self._queue.dropped,
        )
        if self._down or self._closed:
            return base
        ns = self.namespace
        try:
            client = self._redis()
            pipe = client.pipeline(transaction=False)
            pipe.smembers(replicas_key(ns))
            pipe.zcard(scopes_key(ns))
            pipe.hget(sizes_key(ns), SIZES_EVICTED)
            members, scope_count, evicted = await pipe.execute()
            names = sorted(n.decode() for n in members)
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.smembers(replica_scopes_key(ns, name))
            sid_sets = await pipe.execute()
            pipe = client.pipeline(transaction=False)
            for name, sids in zip(names, sid_sets, strict=True):
                for sid in sids:
                    pipe.zcard(ScopeKeys.from_sid(ns, sid.decode()).lru(name))
            cards = iter(await pipe.execute())
        except _OUTAGE as exc:
            self._went_down(exc)
            return base
        per_replica = {
            name: sum(int(next(cards)) for _ in sids)
            for name, sids in zip(names, sid_sets, strict=True)
        }
        entries = sum(per_replica.values())
        return IndexStats(
            backend="redis",
            blocks_per_replica=per_replica,
            entries=entries,
            bytes_estimate=entries * REDIS_BYTES_PER_ENTRY,
            pending_writes=len(self._queue),
            dropped_writes=self._queue.dropped,
            scopes=int(scope_count),
            bound_evicted=int(evicted or 0),
        )

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
        if wait and not self._down:
            write.done = asyncio.get_running_loop().create_future()
        self._queue.push(write)
        self._kick()

    def _kick(self) -> None:
        if self._down or self._closed:
            return
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_loop())

    async def _flush_loop(self) -> None:
        while not self._down and not self._closed:
            if not self._queue:
                if self._upkeep_due(idle=True):
                    await self._upkeep()
                if not self._queue:
                    return
                continue
            batch = self._queue.take()
            try:
                if batch[0].forget is not None:
                    await self._forget_remote(batch[0].forget)
                else:
                    commands = [c for w in batch for c in w.commands]
                    self._carry_sizes(commands, await self._execute(commands, checked=False))
            except _OUTAGE as exc:
                self._queue.put_back(batch)
                self._went_down(exc)
            except RedisError as exc:  # e.g. OOM: these writes would fail again; drop them
                self._complain("write", exc)
            finally:  # a waiting record() returns whatever happened (also on cancellation)
                for write in batch:
                    write.resolve()
            if self._upkeep_due(idle=False):
                await self._upkeep()

    async def _execute(self, commands: list[tuple[Any, ...]], checked: bool = True) -> list[Any]:
        """One pipeline. `checked=False` returns a refused command's error in its place (the
        caller raises it after using the other replies)."""
        for attempt in (0, 1):
            pipe = self._redis().pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            replies = list(await pipe.execute(raise_on_error=False))
            if not attempt and any(isinstance(r, NoScriptError) for r in replies):
                await self._load_scripts()  # Redis restarted or flushed its scripts
                continue  # what did run is idempotent or replayed the same way
            if checked:
                _raise_first(replies)
            return replies
        raise AssertionError("unreachable")

    async def _forget_remote(self, replica: str) -> None:
        """Per scope the replica holds blocks in, pop its entries in bounded calls."""
        ns = self.namespace
        scopes_of = replica_scopes_key(ns, replica)
        for sid in await self._redis().smembers(scopes_of):
            keys = ScopeKeys.from_sid(ns, _text(sid))
            command = ("EVALSHA", _SHA["forget"], 1, keys.seq, keys.prefix, replica,
                       self._tuning.forget_batch)  # fmt: skip
            more = 1
            while more:
                more, popped = (await self._execute([command]))[0]
                self._carry_add(keys.sid, -int(popped), 0)
        await self._execute([("DEL", scopes_of), ("SREM", replicas_key(ns), replica)])

    # -- the bound: scope accounts, trimming, sweeping (in the flusher, after the writes) -----

    def _carry_sizes(self, commands: list[tuple[Any, ...]], replies: list[Any]) -> None:
        """Note what each record and evict changed, then raise the first refusal, if any."""
        for command, reply in zip(commands, replies, strict=True):
            if command[0] == "EVALSHA" and command[1] in _SIZED and isinstance(reply, int):
                sid = sid_of_prefix(command[4])
                if command[1] == _SHA["record"]:
                    self._carry_add(sid, reply, command[5])  # entries gained, at its time
                else:
                    self._carry_add(sid, -reply, 0)  # entries an evict took
        _raise_first(replies)

    def _carry_add(self, sid: str, delta: int, at: int) -> None:
        entry = self._carry.get(sid)
        if entry is None:
            self._carry[sid] = [delta, at]
        else:
            entry[0] += delta
            entry[1] = max(entry[1], at)
        self._carry_entries += abs(delta)

    def _upkeep_due(self, idle: bool) -> bool:
        now = self._now_ms()
        if self._ttl_ms and now >= self._next_sweep:
            return True
        if not self._carry:
            return False
        return (
            idle
            or now >= self._next_upkeep
            or len(self._carry) >= _UPKEEP_SCOPES
            or self._carry_entries * 16 >= self._max_blocks
        )

    async def _upkeep(self) -> None:
        """Send the carried sizes; trim past the bound; now and then sweep idle scopes."""
        try:
            now = self._now_ms()
            self._next_upkeep = now + _UPKEEP_MS
            if self._carry:
                carry, self._carry, entries = self._carry, {}, self._carry_entries
                self._carry_entries = 0
                triples = [(sid, d, at) for sid, (d, at) in carry.items()]
                try:
                    load, emptied = await self._account(triples)
                except BaseException:
                    for sid, (d, at) in carry.items():
                        self._carry_add(sid, d, at)
                    self._carry_entries = max(self._carry_entries, entries)
                    raise
                if emptied:  # evictions or a forget emptied them: their keys go too
                    load = await self._drop_scopes([(sid, 0) for sid in emptied], evicted=False)
                if load > self._max_blocks:
                    await self._trim(load)
            if self._ttl_ms and now >= self._next_sweep:
                self._next_sweep = now + _SWEEP_MS
                await self._sweep(now - self._ttl_ms)
        except _OUTAGE as exc:
            self._went_down(exc)
        except RedisError as exc:
            self._complain("write", exc)

    async def _account(
        self,
        triples: list[tuple[str, int, int]],
        evicted: int = 0,
        extra: tuple[tuple[Any, ...], ...] = (),
    ) -> tuple[int, list[str]]:
        """Apply (sid, delta, at) changes to the scope accounts (see ACCOUNT): the new load, and
        the scopes left empty."""
        ns = self.namespace
        args = [a for triple in triples for a in triple]
        command = ("EVALSHA", _SHA["account"], 2, scopes_key(ns), sizes_key(ns), self._ttl_ms,
                   SCOPE_COST_BLOCKS, evicted, *args)  # fmt: skip
        load, *emptied = (await self._execute([command, *extra]))[0]
        return int(load), [sid.decode() for sid in emptied]

    async def _trim(self, load: int) -> None:
        """Take entries from the least recently recorded scopes of the namespace until its
        load fits: whole scopes while one's weight fits in the excess, then part of one."""
        ns = self.namespace
        oldest = ("EVALSHA", _SHA["oldest"], 2, scopes_key(ns), sizes_key(ns), _TRIM_SCOPES)
        for _ in range(_TRIM_ROUNDS):
            over = load - self._max_blocks
            if over <= 0 or self._closed:
                return
            flat = (await self._execute([oldest]))[0]
            victims: list[tuple[str, int | None]] = []  # sid, entries to take (None: all)
            for sid, size in zip(flat[::2], flat[1::2], strict=True):
                if over <= 0:
                    break
                whole = int(size) + SCOPE_COST_BLOCKS <= over or int(size) <= over
                victims.append((sid.decode(), None if whole else over))
                over -= int(size) + SCOPE_COST_BLOCKS if whole else over
            if not victims:
                return
            load = await self._drop_scopes(victims, evicted=True)

    async def _sweep(self, cutoff_ms: int) -> None:
        """Drop scopes last recorded at or before `cutoff_ms`: every entry of theirs expired
        (their keys too, if Redis' clock agrees; what is left is deleted)."""
        for _ in range(_TRIM_ROUNDS):
            # the stub's answer includes (member, score) pairs, which only withscores=True gives
            sids: list[bytes | str] = await self._redis().zrangebyscore(  # type: ignore[assignment]
                scopes_key(self.namespace), "-inf", cutoff_ms, start=0, num=_TRIM_SCOPES
            )
            if sids:
                await self._drop_scopes([(_text(sid), None) for sid in sids], evicted=False)
            if len(sids) < _TRIM_SCOPES:
                return

    async def _drop_scopes(self, victims: list[tuple[str, int | None]], evicted: bool) -> int:
        """Pop the victims' entries (all of them, or as many as given) in bounded calls, then
        settle their accounts and their replicas' scope sets; the new load. A scope that ends
        empty loses its remaining keys and its account."""
        ns = self.namespace
        client = self._redis()
        replicas = sorted(_text(n) for n in await client.smembers(replicas_key(ns)))
        step = self._tuning.forget_batch
        todo = {sid: limit for sid, limit in victims}
        popped = dict.fromkeys(todo, 0)
        gone: list[str] = []
        while todo:
            rounds = list(todo.items())
            commands = []
            for sid, limit in rounds:
                keys = ScopeKeys.from_sid(ns, sid)
                take = step if limit is None else min(step, limit - popped[sid])
                commands.append(("EVALSHA", _SHA["drop"], 1, keys.seq, keys.prefix, take,
                                 *replicas))  # fmt: skip
            replies = await self._execute(commands)
            for (sid, limit), (got, left) in zip(rounds, replies, strict=True):
                popped[sid] += int(got)
                if not int(left):
                    gone.append(sid)
                    del todo[sid]
                elif limit is not None and popped[sid] >= limit:
                    del todo[sid]
        triples = [(sid, 0, -1) if sid in gone else (sid, -popped[sid], 0) for sid in popped]
        unlisted = tuple(("SREM", replica_scopes_key(ns, r), *gone) for r in replicas if gone)
        load, _ = await self._account(
            triples, evicted=sum(popped.values()) if evicted else 0, extra=unlisted
        )
        return load

    def match_local(
        self, scope: str, hashes: Sequence[int], replicas: Sequence[str]
    ) -> dict[str, int] | None:
        """This gateway's own writes, matched without a round trip (None: no local view)."""
        return None if self._local is None else self._local.match_now(scope, hashes, replicas)

    # -- outage ---------------------------------------------------------------------------------

    def _local_answer(
        self, scope: str, hashes: Sequence[int], replicas: Sequence[str]
    ) -> dict[str, int]:
        if self._local is None:
            return dict.fromkeys(replicas, 0)
        return self._local.match_now(scope, hashes, replicas)

    def _went_down(self, exc: BaseException) -> None:
        if self._down or self._closed:
            return
        self._down = True
        self._down_since = time.monotonic()
        self.health.up = False
        self.health.outages += 1
        self.health.last_error = f"{type(exc).__name__}: {exc}"
        self._cache.clear()
        view = "this gateway's own view" if self._local is not None else "zero hits"
        self._log.warning(
            "prefix index: Redis at %s unreachable (%s: %s); answering from %s and buffering "
            "writes until it is back",
            self._target.where, type(exc).__name__, exc, view,
        )  # fmt: skip
        self._queue.resolve_all()
        self._prober = asyncio.get_running_loop().create_task(self._recover())

    async def _recover(self) -> None:
        delay = self._tuning.retry_s
        while not self._closed:
            await asyncio.sleep(delay)
            try:
                await self._ping()
                lost = await self._check_marker(rebuild=False)
            except (TimeoutError, RedisError, OSError, RedisClusterException):
                delay = min(delay * 2, self._tuning.retry_s * 10)
                continue
            await self._lane.reset()
            self._down = False
            down_s = time.monotonic() - self._down_since
            self.health.up = True
            self.health.recoveries += 1
            self.health.down_s += down_s
            self._log.info(
                "prefix index: %s is back after %.1f s; replaying %d buffered writes "
                "(%d dropped)",
                self._target.where, down_s, len(self._queue), self._queue.dropped,
            )  # fmt: skip
            if lost:
                self._rebuild()
            self._kick()
            return

    # -- lost data: the marker, and the refill from the journal ---------------------------------

    async def _check_marker(self, rebuild: bool = True) -> bool:
        """Look at the namespace's marker; True when Redis lost the index since the last look
        (then, with `rebuild`, refill it)."""
        last = self._last_write_at
        age = int((time.monotonic() - last) * 1000) if last is not None else 0
        live = last is not None and (not self._ttl_ms or age < self._ttl_ms)
        remaining = self._ttl_ms - age if self._ttl_ms else None
        async with asyncio.timeout(self._tuning.timeout_s * 4):
            lost = await self._marker.check(self._redis(), live, remaining)
        if lost and rebuild:
            self._rebuild()
            self._kick()
        return lost

    def _rebuild(self) -> None:
        """Queue this gateway's journal again: the scope accounts start over from its replies."""
        writes = self._journal.replay(self._now_ms())
        self.health.rebuilds += 1
        self.health.replayed_writes += len(writes)
        self._carry.clear()
        self._carry_entries = 0
        self._cache.clear()
        self._generation = {s: g + 1 for s, g in self._generation.items()}
        self._log.warning(
            "prefix index: %s lost the index of namespace %r (flushed, restarted or failed over "
            "to an empty node); re-writing this gateway's %d most recent records (%d blocks)",
            self._target.where, self.namespace, len(writes), sum(w.blocks for w in writes),
        )  # fmt: skip
        for write in writes:
            self._queue.push(write)

    async def _follow_master(self) -> None:
        """Sentinel: ask where the master is now. After a switch the old master may accept
        writes for seconds until the sentinels demote it; this gateway's connections to it are
        closed here (the pool closes its own idle ones when the address changes)."""
        client = self._client
        if self._target.kind != "sentinel" or not isinstance(client, Redis):
            return
        pool: Any = client.connection_pool
        async with asyncio.timeout(self._tuning.timeout_s * 4):
            address = await pool.get_master_address()
        seen = {self._master_at} if self._master_at else self._lane_addresses()
        if seen - {address}:
            # A connection in use now would go back to the pool still on the old master: a
            # new client instead; the old one closes once its calls are done.
            self._log.info(
                "prefix index: %s moved to %s:%s; reconnecting", self._target.where, *address
            )
            self.health.switches += 1
            self._client = None
            await self._lane.reset()
            self._retire(client)
        self._master_at = address

    def _lane_addresses(self) -> set[tuple[str, int]]:
        return self._lane.addresses() if isinstance(self._lane, FastLane) else set()

    def _retire(self, client: Client) -> None:
        async def close() -> None:
            try:
                await asyncio.sleep(self._tuning.write_timeout_s)
            finally:
                await client.aclose()

        task = asyncio.get_running_loop().create_task(close())
        self._retired.add(task)
        task.add_done_callback(self._retired.discard)

    async def _watch(self) -> None:
        """Every `check_s`: where a Sentinel master is, and the marker (Redis may have lost the
        index); either also notices an outage when no traffic does."""
        while not self._closed:
            await asyncio.sleep(self._tuning.check_s)
            if self._down or self._closed:
                continue
            try:
                await self._follow_master()
                await self._check_marker()
            except _OUTAGE as exc:
                self._went_down(exc)
            except RedisError as exc:
                self._complain("check", exc)

    def _complain(self, what: str, exc: Exception) -> None:
        """One line per kind of refusal (OOM, READONLY...): Redis answers, so no outage."""
        kind = f"{what}:{type(exc).__name__}"
        if kind not in self._complaints and len(self._complaints) < 64:
            self._complaints.add(kind)
            self._log.warning("prefix index: Redis refused a %s (%s); carrying on", what, exc)

    # -- helpers -------------------------------------------------------------------------------

    def _redis(self) -> Client:
        if self._client is None:
            self._client = open_redis(
                self._target,
                socket_timeout=self._tuning.write_timeout_s,
                connect_timeout=self._tuning.timeout_s,
            )
            if self._tuning.check_s > 0 and self._watcher is None:
                self._watcher = asyncio.get_running_loop().create_task(self._watch())
        return self._client

    def _node(self) -> Redis:
        client = self._redis()
        assert isinstance(client, Redis)  # a Cluster takes the ClusterLane
        return client

    async def _ping(self) -> None:
        """Every master answers (one, or each of a Cluster's) and has the scripts. A replica
        that answers (a demoted master a lagging sentinel still names) is no recovery."""
        async with asyncio.timeout(self._tuning.timeout_s * 4):
            client = self._redis()
            if isinstance(client, Redis):
                await client.ping()
                try:
                    role = await client.execute_command("ROLE")  # type: ignore[no-untyped-call]
                except NoPermissionError:  # an ACL user without ROLE: writes will tell
                    role = [b"master"]
                if role[0] != b"master":
                    await client.connection_pool.disconnect()  # Sentinel: ask again next time
                    raise RedisConnectionError("a replica answers where the master should")
            else:
                await client.execute_command("PING", target_nodes=client.PRIMARIES)
            await self._load_scripts()

    async def _load_scripts(self) -> None:
        client = self._redis()
        for name, source in _SCRIPTS.items():
            sha = await client.script_load(source)
            if sha != _SHA[name]:  # pragma: no cover - would mean a different SHA1
                raise RuntimeError(f"script {name}: Redis returned sha {sha}")

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


def _text(member: bytes | str) -> str:
    """A set member as text (the client does not decode responses: members come as bytes)."""
    return member if isinstance(member, str) else member.decode()


def _raise_first(replies: list[Any]) -> None:
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply


_redacted = redact_url  # the URL as logs may show it
