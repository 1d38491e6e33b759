"""Where each `/v1/responses` answer was made: response id -> (pool, replica), so that a request
naming `previous_response_id`, and a retrieve, cancel or delete by id, goes to the replica that
stores that response.

Two maps, both bounded (least recently used out past 100,000 ids) and forgotten after an hour:
this process's (`ResponseHomes`), and, with shared load on (`fleet:`), the fleet's in the Redis
its load ticks use (`SharedHomes`), so another gateway, or another `--workers` process, finds it:

    kvgw:fleet:{<fleet.name>}:responses     HASH  response id -> orjson [pool, replica URL, expiry ms]
    kvgw:fleet:{<fleet.name>}:responses:t   ZSET  response id -> expiry ms (the oldest trimmed)

Replicas are kept by URL, which names the engine whatever each gateway's config calls it. A
response is learned before its answer reaches the client (a stream's at its first event), so a
follow-up sent anywhere finds it. Redis down is not an error: one warning, this process's map
alone until it answers again (retried once a second), never a failed request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import orjson
from redis.exceptions import RedisError

from prefix_index.redis_client import OUTAGE

if TYPE_CHECKING:
    from gateway.fleet.pools import Pool
    from gateway.fleet.replicas import ReplicaState
    from gateway.fleet.shared_load import FleetLoad

log = logging.getLogger("gateway.fleet")

MAX_RESPONSES = 100_000  # ~200 B each: ~20 MB at most (in Redis about as much)
TTL_S = 3600.0
MAX_ID = 256  # longer ids are not remembered (no engine makes them; a client may send them)
KEY = "kvgw:fleet:{%s}:responses"  # the fleet's hash tag: one Cluster slot, like its load key
RETRY_S = 1.0  # after a failure, Redis is not asked again for this long
_ERRORS = (RedisError, *OUTAGE)
# one round trip: set the id's home, order it by expiry, drop the expired and the oldest past
# the bound (KEYS: hash, zset; ARGV: id, value, now ms, ttl ms, max entries)
LEARN = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], tonumber(ARGV[3]) + tonumber(ARGV[4]), ARGV[1])
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[3], 'LIMIT', 0, 64)
local over = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[5])
if over > 0 then
  for _, id in ipairs(redis.call('ZRANGE', KEYS[2], 0, over - 1)) do table.insert(gone, id) end
end
if #gone > 0 then
  redis.call('HDEL', KEYS[1], unpack(gone))
  redis.call('ZREM', KEYS[2], unpack(gone))
end
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
"""


class ResponseHomes:
    """This process's map: response id -> (pool, replica name), LRU-bounded, expiring."""

    def __init__(self, max_entries: int = MAX_RESPONSES, ttl_s: float = TTL_S) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._homes: OrderedDict[str, tuple[str, str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._homes)

    def learn(self, response_id: str, pool: str, replica: str, now: float | None = None) -> None:
        if not response_id or len(response_id) > MAX_ID:
            return
        now = time.monotonic() if now is None else now
        homes = self._homes
        homes[response_id] = (pool, replica, now + self.ttl_s)
        homes.move_to_end(response_id)
        while len(homes) > self.max_entries:
            homes.popitem(last=False)

    def where(self, response_id: str, now: float | None = None) -> tuple[str, str] | None:
        """(pool, replica) that made `response_id`, if known and not expired."""
        entry = self._homes.get(response_id)
        if entry is None:
            return None
        now = time.monotonic() if now is None else now
        if entry[2] < now:
            del self._homes[response_id]
            return None
        self._homes.move_to_end(response_id)
        return entry[0], entry[1]

    def home(self, response_id: object, pool: str, now: float | None = None) -> str | None:
        """The replica that made `response_id` in `pool`, if known and not expired."""
        if not isinstance(response_id, str):
            return None
        found = self.where(response_id, now)
        return found[1] if found is not None and found[0] == pool else None

    def forget(self, response_id: str) -> None:
        self._homes.pop(response_id, None)


class SharedHomes:
    """The fleet's map in Redis, on the client of its load ticks; every call fails open (None,
    or nothing done) and a failure keeps Redis out of the way for RETRY_S."""

    def __init__(
        self, fleet: FleetLoad, max_entries: int = MAX_RESPONSES, ttl_s: float = TTL_S
    ) -> None:
        self.fleet = fleet
        self.key = KEY % fleet.name
        self.max_entries = max_entries
        self.ttl_ms = int(ttl_s * 1000)
        self.timeout_s = fleet.timeout_s
        self.down_until = 0.0
        self.failures = 0
        self._script: Any = None

    async def put(self, response_id: str, pool: str, url: str) -> None:
        now_ms = int(time.time() * 1000)
        value = orjson.dumps([pool, url, now_ms + self.ttl_ms])

        async def learn() -> None:
            if self._script is None:
                self._script = self.fleet.redis().register_script(LEARN)
            await self._script(
                keys=[self.key, self.key + ":t"],
                args=[response_id, value, now_ms, self.ttl_ms, self.max_entries],
            )

        await self._try(learn)

    async def get(self, response_id: str) -> tuple[str, str] | None:
        """(pool, replica URL) that made `response_id`, as the fleet knows it."""
        got: list[Any] = []

        async def read() -> None:
            got.append(await self.fleet.redis().hget(self.key, response_id))

        if not await self._try(read) or not got or got[0] is None:
            return None
        try:
            pool, url, expires_ms = orjson.loads(got[0])
        except (orjson.JSONDecodeError, TypeError, ValueError):
            return None  # not a value this version writes
        if expires_ms < time.time() * 1000 or not isinstance(pool, str) or not isinstance(url, str):
            return None
        return pool, url

    async def drop(self, response_id: str) -> None:
        async def drop() -> None:
            await self.fleet.redis().hdel(self.key, response_id)

        await self._try(drop)

    async def _try(self, call: Callable[[], Awaitable[None]]) -> bool:
        """Run `call` under the timeout, unless Redis failed within RETRY_S; False when it did
        not run or failed (logged once per outage)."""
        if time.monotonic() < self.down_until:
            return False
        try:
            async with asyncio.timeout(self.timeout_s):
                await call()
        except _ERRORS as exc:
            self.failures += 1
            if not self.down_until:
                log.warning(
                    "fleet %s: the shared /v1/responses map is unavailable (%s: %s); each "
                    "gateway follows up the responses it made until Redis answers",
                    self.key, type(exc).__name__, exc,
                )  # fmt: skip
            self.down_until = time.monotonic() + RETRY_S
            return False
        if self.down_until:
            log.info("fleet %s: the shared /v1/responses map is back", self.key)
            self.down_until = 0.0
        return True


class Homes:
    """What the pipeline asks: this process's map first, then the fleet's (when load is shared:
    `fleet()` is the running `FleetLoad`, None without one)."""

    def __init__(self, fleet: Callable[[], FleetLoad | None]) -> None:
        self.local = ResponseHomes()
        self._fleet = fleet
        self._shared: SharedHomes | None = None

    def shared(self) -> SharedHomes | None:
        fleet = self._fleet()
        if fleet is None:
            return None
        if self._shared is None or self._shared.fleet is not fleet:
            self._shared = SharedHomes(fleet)
        return self._shared

    async def home(self, response_id: object, pool: Pool) -> str | None:
        """The replica of `pool` that made `response_id` (a follow-up's previous_response_id),
        if this gateway or the fleet knows it."""
        if not isinstance(response_id, str) or not response_id or len(response_id) > MAX_ID:
            return None
        found = await self.locate(response_id, {pool.name: pool})
        return found[1].name if found is not None else None

    async def locate(
        self, response_id: str, pools: Mapping[str, Pool]
    ) -> tuple[Pool, ReplicaState] | None:
        """The pool and replica (of `pools`) that made `response_id`; None when no gateway knows
        it, or its replica is in none of them any more."""
        if len(response_id) > MAX_ID:
            return None  # never learned
        local = self.local.where(response_id)
        if local is not None:
            pool = pools.get(local[0])
            replica = pool.by_name.get(local[1]) if pool is not None else None
            return (pool, replica) if pool is not None and replica is not None else None
        shared = self.shared()
        found = await shared.get(response_id) if shared is not None else None
        if found is None:
            return None
        pool = pools.get(found[0])
        replica = next((r for r in pool.replicas if r.url == found[1]), None) if pool else None
        if pool is None or replica is None:
            return None
        self.local.learn(response_id, pool.name, replica.name)
        return pool, replica

    async def learn(self, response_id: str, pool: Pool, replica: ReplicaState) -> None:
        if not response_id or len(response_id) > MAX_ID:
            return
        self.local.learn(response_id, pool.name, replica.name)
        shared = self.shared()
        if shared is not None:
            await shared.put(response_id, pool.name, replica.url)

    async def forget(self, response_id: str) -> None:
        self.local.forget(response_id)
        shared = self.shared()
        if shared is not None:
            await shared.drop(response_id)
