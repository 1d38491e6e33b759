"""The shared prefix index: the memory backend's semantics kept in Redis for many gateways.

One round trip per match (a binary search in Lua); writes batched; an outage degrades, logs once.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from prefix_index import _lua
from prefix_index.base import IndexStats
from prefix_index.constants import (
    DEFAULT_CAPACITY_BLOCKS,
    DEFAULT_LOCAL_CACHE_S,
    DEFAULT_NAMESPACE,
    DEFAULT_REDIS_TTL_S,
    ScopeKeys,
    replica_scopes_key,
    replicas_key,
)
from prefix_index.memory import MemoryIndex

# Redis memory per (replica, block) entry, measured by bench/index.py on Redis 7.0 (one
# replica per block; each further replica on a block adds about a third of it).
REDIS_BYTES_PER_ENTRY = 224

_OUTAGE = (RedisConnectionError, RedisTimeoutError, OSError, asyncio.TimeoutError)
_SCRIPTS = {"match": _lua.MATCH, "record": _lua.RECORD, "evict": _lua.EVICT, "forget": _lua.FORGET}
_SHA = {name: hashlib.sha1(src.encode()).hexdigest() for name, src in _SCRIPTS.items()}
_SHA_B = {name: sha.encode() for name, sha in _SHA.items()}
_CACHE_MAX = 8192
_KEYS_MAX = 4096
_HINTS_MAX = 4


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


@dataclass(slots=True)
class _Write:
    """One queued write: the commands of one record/evict, or a forget (replica set)."""

    commands: list[tuple[Any, ...]]
    forget: str | None = None
    blocks: int = 0
    done: asyncio.Future[None] | None = field(default=None)


class RedisIndex:
    """A PrefixIndex in Redis, shared by every gateway that uses the same url and namespace.

    `capacity_blocks` per replica and scope, `ttl_s` (None: entries never age out), `namespace`
    prefixes every key, `local_cache_s` (0: off) lets an identical lookup skip Redis for that
    long (this gateway's own writes to the scope invalidate it), `clock` gives wall-clock
    seconds shared by all gateways. Never raises on an outage: see docs/prefix_index.md.
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
    ) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive or None, got {ttl_s}")
        if not namespace or "{" in namespace or "}" in namespace:
            raise ValueError(f"namespace must be non-empty and without braces, got {namespace!r}")
        self.url = url
        self.namespace = namespace
        self._tuning = tuning or RedisTuning()
        self._default_capacity = capacity_blocks
        self._capacity: dict[str, int] = {}
        self._ttl_ms = 0 if ttl_s is None else max(1, round(ttl_s * 1000))
        self._cache_s = local_cache_s
        self._clock = clock
        self._log = logging.getLogger("prefix_index")
        self._local = (
            MemoryIndex(capacity_blocks, ttl_s, clock) if self._tuning.local_view else None
        )
        self._client: aioredis.Redis | None = None
        self._idle: list[AbstractConnection] = []  # the match fast lane
        self._keys: dict[str, ScopeKeys] = {}
        self._pending: deque[_Write] = deque()
        self._flusher: asyncio.Task[None] | None = None
        self._prober: asyncio.Task[None] | None = None
        self._down = False
        self._down_since = 0.0
        self._closed = False
        self._dropped = 0
        self._complaints: set[str] = set()
        self._cache: dict[tuple[Any, ...], tuple[float, dict[str, int]]] = {}
        self._generation: dict[str, int] = {}
        self._replica_resp: dict[tuple[str, ...], tuple[int, bytes]] = {}
        self._hints: dict[str, bytes] = {}  # scope -> depths recent matches stopped at

    # -- lifecycle ----------------------------------------------------------------------------

    async def connect(self) -> bool:
        """Check Redis and load the scripts; optional (the first call connects). Never raises:
        returns False and starts recovering in the background when Redis is out."""
        try:
            await self._ping()
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
                continue
            if self._pending and not self._down and not self._closed:
                self._kick()
                continue
            return not self._pending

    async def aclose(self) -> None:
        if self._closed:
            return
        if not self._down:
            try:
                await asyncio.wait_for(self.flush(), timeout=max(1.0, self._tuning.timeout_s * 4))
            except TimeoutError:
                pass
        self._closed = True
        for task in (self._flusher, self._prober):
            if task is not None and not task.done():
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        for conn in self._idle:
            await conn.disconnect()
        self._idle.clear()
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        self._resolve_all()

    # -- the contract -------------------------------------------------------------------------

    async def match(
        self, scope: str, hashes: Sequence[int], replicas: Sequence[str]
    ) -> dict[str, int]:
        if not hashes or not replicas:
            return dict.fromkeys(replicas, 0)
        if self._down or self._closed:
            return self._local_answer(scope, hashes, replicas)
        cache_key: tuple[Any, ...] | None = None
        generation = self._generation.get(scope, 0)
        if self._cache_s > 0:
            cache_key = (scope, len(hashes), hashes[-1], generation, *replicas)
            hit = self._cache.get(cache_key)
            if hit is not None and hit[0] > time.monotonic():
                return dict(hit[1])
        keys = self._scope_keys(scope)
        head = (b"EVALSHA", _SHA_B["match"], b"1", keys.seq, keys.prefix, b"%d" % self._now_ms())
        hints = self._hints.get(scope, b"")
        try:
            answer = await self._call(
                _resp(head, (_pack(hashes), hints), self._replica_args(replicas))
            )
        except _OUTAGE as exc:
            self._went_down(exc)
            return self._local_answer(scope, hashes, replicas)
        except RedisError as exc:
            self._complain("match", exc)
            return self._local_answer(scope, hashes, replicas)
        counts = [int(c) for c in answer.split(b",")] if answer else []
        result = dict(zip(replicas, counts, strict=True))
        self._remember_depths(scope, counts)
        if cache_key is not None and self._generation.get(scope, 0) == generation:
            if len(self._cache) >= _CACHE_MAX:
                self._cache.clear()
            self._cache[cache_key] = (time.monotonic() + self._cache_s, result)
            return dict(result)
        return result

    async def record(self, scope: str, replica: str, hashes: Sequence[int]) -> None:
        if not hashes or self._closed:
            return
        if self._local is not None:
            self._local.record_now(scope, replica, hashes)
        keys = self._scope_keys(scope)
        now = self._now_ms()
        expiry = now + self._ttl_ms if self._ttl_ms else 0
        capacity = self._capacity.get(replica, self._default_capacity)
        ns = self.namespace
        commands: list[tuple[Any, ...]] = []
        step = self._tuning.segment_blocks
        # Deepest segment first: each call's blocks are more recent than the deeper ones, so
        # the LRU order is the one a single call would give, and no call holds Redis long.
        for start in reversed(range(0, len(hashes), step)):
            commands.append(
                ("EVALSHA", _SHA["record"], 1, keys.seq, keys.prefix, now, self._ttl_ms,
                 capacity, replica, _pack(hashes[start : start + step]), expiry)
            )  # fmt: skip
        commands.append(("SADD", replica_scopes_key(ns, replica), keys.sid))
        commands.append(("SADD", replicas_key(ns), replica))
        await self._write(scope, _Write(commands, blocks=len(hashes)))

    async def evict(self, scope: str, replica: str, hashes: Sequence[int]) -> None:
        if not hashes or self._closed:
            return
        if self._local is not None:
            self._local.evict_now(scope, replica, hashes)
        keys = self._scope_keys(scope)
        command = (
            "EVALSHA", _SHA["evict"], 1, keys.seq, keys.prefix, self._now_ms(), self._ttl_ms,
            replica, _pack(hashes),
        )  # fmt: skip
        await self._write(scope, _Write([command], blocks=len(hashes)))

    async def forget(self, replica: str) -> None:
        if self._closed:
            return
        if self._local is not None:
            self._local.forget_now(replica)
        await self._write(None, _Write([], forget=replica))

    def set_capacity(self, replica: str, blocks: int) -> None:
        """Capacity of one replica in blocks (per scope), applied at its next record."""
        if blocks < 0:
            raise ValueError(f"capacity must be >= 0, got {blocks}")
        self._capacity[replica] = blocks
        if self._local is not None:
            self._local.set_capacity(replica, blocks)

    async def stats(self) -> IndexStats:
        """Entries per replica across all gateways of the namespace (a few round trips)."""
        base = IndexStats(
            backend="redis",
            healthy=not self._down,
            pending_writes=len(self._pending),
            dropped_writes=self._dropped,
        )
        if self._down or self._closed:
            return base
        ns = self.namespace
        try:
            client = self._redis()
            names = sorted(n.decode() for n in await client.smembers(replicas_key(ns)))
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
            healthy=True,
            pending_writes=len(self._pending),
            dropped_writes=self._dropped,
        )

    @property
    def healthy(self) -> bool:
        return not self._down

    # -- writes: queued, batched, buffered through an outage ----------------------------------

    async def _write(self, scope: str | None, op: _Write) -> None:
        if scope is None:
            self._generation = {s: g + 1 for s, g in self._generation.items()}
            self._cache.clear()
        else:
            self._generation[scope] = self._generation.get(scope, 0) + 1
        if len(self._pending) >= self._tuning.max_pending:
            self._resolve(self._pending.popleft())
            self._dropped += 1
        self._pending.append(op)
        if self._down:
            return  # buffered; replayed when Redis is back
        op.done = asyncio.get_running_loop().create_future()
        self._kick()
        await asyncio.shield(op.done)

    def _kick(self) -> None:
        if self._down or self._closed:
            return
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_loop())

    async def _flush_loop(self) -> None:
        while self._pending and not self._down and not self._closed:
            batch = self._take_batch()
            try:
                if batch[0].forget is not None:
                    await self._forget_remote(batch[0].forget)
                else:
                    await self._execute([c for op in batch for c in op.commands])
            except _OUTAGE as exc:
                self._pending.extendleft(reversed(batch))
                while len(self._pending) > self._tuning.max_pending:
                    self._resolve(self._pending.popleft())
                    self._dropped += 1
                self._went_down(exc)
            except RedisError as exc:  # e.g. OOM: these writes would fail again; drop them
                self._complain("write", exc)
            finally:  # a waiting record() returns whatever happened (also on cancellation)
                for op in batch:
                    self._resolve(op)

    def _take_batch(self) -> list[_Write]:
        first = self._pending.popleft()
        batch = [first]
        if first.forget is None:
            blocks = first.blocks
            while (
                self._pending
                and len(batch) < self._tuning.write_batch
                and self._pending[0].forget is None
                and blocks + self._pending[0].blocks <= self._tuning.write_batch_blocks
            ):
                blocks += self._pending[0].blocks
                batch.append(self._pending.popleft())
        return batch

    async def _execute(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        for attempt in (0, 1):
            pipe = self._redis().pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            try:
                return list(await pipe.execute())
            except NoScriptError:  # Redis restarted or flushed its scripts: nothing ran
                if attempt:
                    raise
                await self._load_scripts()
        raise AssertionError("unreachable")

    async def _forget_remote(self, replica: str) -> None:
        client = self._redis()
        ns = self.namespace
        scopes_key = replica_scopes_key(ns, replica)
        for sid in await client.smembers(scopes_key):
            keys = ScopeKeys.from_sid(ns, sid.decode())
            args = ("EVALSHA", _SHA["forget"], 1, keys.seq, keys.prefix, replica,
                    self._tuning.forget_batch)  # fmt: skip
            while int((await self._execute([args]))[0]):
                pass
        await self._execute([("DEL", scopes_key), ("SREM", replicas_key(ns), replica)])

    @staticmethod
    def _resolve(op: _Write) -> None:
        if op.done is not None and not op.done.done():
            op.done.set_result(None)

    def _resolve_all(self) -> None:
        for op in self._pending:
            self._resolve(op)

    # -- reads ---------------------------------------------------------------------------------

    async def _call(self, packed: bytes) -> Any:
        """One packed command on a fast-lane connection (no pool bookkeeping on the hot path)."""
        for attempt in (0, 1):
            conn = self._idle.pop() if self._idle else self._new_connection()
            try:
                async with asyncio.timeout(self._tuning.timeout_s):
                    await conn.send_packed_command(packed, check_health=False)
                    response = await conn.read_response()
            except NoScriptError:
                self._idle.append(conn)
                if attempt:
                    raise
                await self._load_scripts()
                continue
            except RedisConnectionError:
                await conn.disconnect()
                if attempt:  # the first failure may be a connection Redis closed long ago
                    raise
                continue
            except BaseException:
                await conn.disconnect()
                raise
            if len(self._idle) < self._tuning.idle_connections:
                self._idle.append(conn)
            else:
                await conn.disconnect()
            return response
        raise AssertionError("unreachable")

    def _remember_depths(self, scope: str, counts: list[int]) -> None:
        """Keep depths several replicas stopped at (a shared system prompt's end, say) as
        hints for the scope's next match; a depth only one replica has is no use to a group."""
        seen: dict[int, int] = {}
        for depth in counts:
            if depth:
                seen[depth] = seen.get(depth, 0) + 1
        common = sorted((d for d, c in seen.items() if c > 1), key=seen.__getitem__, reverse=True)
        if not common:
            return  # nothing learnt: keep what the scope had
        if len(self._hints) >= _KEYS_MAX:
            self._hints.clear()
        self._hints[scope] = b",".join(b"%d" % d for d in common[:_HINTS_MAX])

    def _replica_args(self, replicas: Sequence[str]) -> tuple[int, bytes]:
        """The replica names as RESP bulk strings, memoised: pools ask with the same lists."""
        key = tuple(replicas)
        packed = self._replica_resp.get(key)
        if packed is None:
            if len(self._replica_resp) >= _KEYS_MAX:
                self._replica_resp.clear()
            packed = (len(key), b"".join(_bulk(r.encode()) for r in key))
            self._replica_resp[key] = packed
        return packed

    def _new_connection(self) -> AbstractConnection:
        # No socket timeout on the connection itself (it costs a task per send); _call bounds
        # the whole round trip instead.
        pool = self._redis().connection_pool
        kwargs = {**pool.connection_kwargs, "socket_timeout": None}
        return pool.connection_class(**kwargs)

    def _local_answer(
        self, scope: str, hashes: Sequence[int], replicas: Sequence[str]
    ) -> dict[str, int]:
        if self._local is None:
            return dict.fromkeys(replicas, 0)
        return self._local.match_now(scope, hashes, replicas)

    # -- outage --------------------------------------------------------------------------------

    def _went_down(self, exc: BaseException) -> None:
        if self._down or self._closed:
            return
        self._down = True
        self._down_since = time.monotonic()
        self._cache.clear()
        view = "this gateway's own view" if self._local is not None else "zero hits"
        self._log.warning(
            "prefix index: Redis at %s unreachable (%s: %s); answering from %s and buffering "
            "writes until it is back",
            _redacted(self.url), type(exc).__name__, exc, view,
        )  # fmt: skip
        self._resolve_all()
        self._prober = asyncio.get_running_loop().create_task(self._recover())

    async def _recover(self) -> None:
        delay = self._tuning.retry_s
        while not self._closed:
            await asyncio.sleep(delay)
            try:
                await self._ping()
            except (TimeoutError, RedisError, OSError):
                delay = min(delay * 2, self._tuning.retry_s * 10)
                continue
            for conn in self._idle:
                await conn.disconnect()
            self._idle.clear()
            self._down = False
            self._log.info(
                "prefix index: Redis at %s is back after %.1f s; replaying %d buffered writes "
                "(%d dropped)",
                _redacted(self.url), time.monotonic() - self._down_since, len(self._pending),
                self._dropped,
            )  # fmt: skip
            self._kick()
            return

    def _complain(self, what: str, exc: Exception) -> None:
        kind = f"{what}:{type(exc).__name__}"
        if kind not in self._complaints and len(self._complaints) < 64:
            self._complaints.add(kind)
            self._log.warning("prefix index: Redis refused a %s (%s); carrying on", what, exc)

    # -- helpers -------------------------------------------------------------------------------

    def _redis(self) -> aioredis.Redis:
        if self._client is None:
            self._client = aioredis.Redis.from_url(
                self.url,
                socket_timeout=self._tuning.write_timeout_s,
                socket_connect_timeout=self._tuning.timeout_s,
                retry=Retry(NoBackoff(), 1),
                decode_responses=False,
            )
        return self._client

    async def _ping(self) -> None:
        async with asyncio.timeout(self._tuning.timeout_s * 4):
            await self._redis().ping()
            await self._load_scripts()

    async def _load_scripts(self) -> None:
        client = self._redis()
        for name, source in _SCRIPTS.items():
            sha = await client.script_load(source)
            if sha != _SHA[name]:  # pragma: no cover - would mean a different SHA1
                raise RuntimeError(f"script {name}: Redis returned sha {sha}")

    def _scope_keys(self, scope: str) -> ScopeKeys:
        keys = self._keys.get(scope)
        if keys is None:
            if len(self._keys) >= _KEYS_MAX:
                self._keys.clear()
            keys = self._keys[scope] = ScopeKeys.of(self.namespace, scope)
        return keys

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)


def _pack(hashes: Sequence[int]) -> bytes:
    """The chain as 8-byte big-endian values (the bytes in Redis key names)."""
    return struct.pack(f">{len(hashes)}Q", *hashes)


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


def _resp(head: tuple[bytes, ...], tail: tuple[bytes, ...], replicas: tuple[int, bytes]) -> bytes:
    """A match call in RESP: arguments, then the pre-packed replica names."""
    count = len(head) + len(tail) + replicas[0]
    parts = (*(_bulk(a) for a in head), *(_bulk(a) for a in tail))
    return b"".join((b"*%d\r\n" % count, *parts, replicas[1]))


def _redacted(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit((parts.scheme, user + host, parts.path, parts.query, parts.fragment))
