"""The Redis index's link to Redis, through outages: the client, the scripts, the fast lane,
noticing an outage and probing until Redis is back, following a Sentinel master, and the
namespace's marker (Redis lost the index). What the index does then is its own: the link
calls `on_down()`, `on_back(lost, down_s)` and `on_lost()` (prefix_index/redis.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError, NoScriptError, RedisClusterException, RedisError

from prefix_index import _lua
from prefix_index._fastlane import ClusterLane, FastLane, Lane
from prefix_index._rebuild import EpochMarker
from prefix_index.redis_client import OUTAGE, Client, RedisHealth, RedisTarget, cancel, open_redis
from prefix_index.redis_follow import MasterFollower

SCRIPTS = {
    "match": _lua.MATCH,
    "record": _lua.RECORD,
    "evict": _lua.EVICT,
    "forget": _lua.FORGET,
    "drop": _lua.DROP,
    "account": _lua.ACCOUNT,
    "oldest": _lua.OLDEST,
}
SHA = {name: hashlib.sha1(src.encode()).hexdigest() for name, src in SCRIPTS.items()}


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


def raise_first(replies: list[Any]) -> None:
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply


class RedisLink:
    """One index's connection to `target`: `down` while Redis is out (a prober runs), `closed`
    once the index closed; `health` counts outages, recoveries, switches and rebuilds."""

    def __init__(
        self,
        target: RedisTarget,
        namespace: str,
        tuning: RedisTuning,
        ttl_ms: int,
        view: str,
        on_down: Callable[[], None],
        on_back: Callable[[bool, float], None],
        on_lost: Callable[[], None],
    ) -> None:
        self.target = target
        self.tuning = t = tuning
        self.health = RedisHealth()
        self.closed = False
        # this gateway's newest record, in real seconds (the marker's life is Redis time, not
        # the injected clock's)
        self.last_write_at: float | None = None
        self._ttl_ms = ttl_ms
        self._view = view  # what the index answers from while Redis is out
        self._on_down = on_down
        self._on_back = on_back
        self._on_lost = on_lost
        self._log = logging.getLogger("prefix_index")
        self._client: Client | None = None
        self.lane: Lane = (
            ClusterLane(self.redis, t.timeout_s)
            if target.kind == "cluster"
            else FastLane(lambda: self._node().connection_pool, t.timeout_s, t.idle_connections)
        )
        self._marker = EpochMarker(namespace, cluster=target.kind == "cluster")
        self._watcher: asyncio.Task[None] | None = None
        self._prober: asyncio.Task[None] | None = None
        self._follower = MasterFollower(
            target=target, health=self.health, timeout_s=t.timeout_s * 4,
            grace_s=t.write_timeout_s, log=self._log, who="prefix index",
        )  # fmt: skip
        self._complaints: set[str] = set()

    def redis(self) -> Client:
        if self._client is None:
            self._client = open_redis(
                self.target,
                socket_timeout=self.tuning.write_timeout_s,
                connect_timeout=self.tuning.timeout_s,
            )
            if self.tuning.check_s > 0 and self._watcher is None:
                self._watcher = asyncio.get_running_loop().create_task(self._watch())
        return self._client

    def _node(self) -> Redis:
        client = self.redis()
        assert isinstance(client, Redis)  # a Cluster takes the ClusterLane
        return client

    async def aclose(self) -> None:
        """After `closed` is set: stop the prober and the watcher, close every connection."""
        await cancel(self._prober, self._watcher)
        await self.lane.reset()
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        await self._follower.aclose()

    async def ping(self) -> None:
        """Every master answers (one, or each of a Cluster's) and has the scripts. A replica
        that answers (a demoted master a lagging sentinel still names) is no recovery."""
        async with asyncio.timeout(self.tuning.timeout_s * 4):
            client = self.redis()
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
            await self.load_scripts()

    async def load_scripts(self) -> None:
        client = self.redis()
        for name, source in SCRIPTS.items():
            sha = await client.script_load(source)
            if sha != SHA[name]:  # pragma: no cover - would mean a different SHA1
                raise RuntimeError(f"script {name}: Redis returned sha {sha}")

    async def execute(self, commands: list[tuple[Any, ...]], checked: bool = True) -> list[Any]:
        """One pipeline. `checked=False` returns a refused command's error in its place (the
        caller raises it after using the other replies)."""
        for attempt in (0, 1):
            pipe = self.redis().pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            replies = list(await pipe.execute(raise_on_error=False))
            if not attempt and any(isinstance(r, NoScriptError) for r in replies):
                await self.load_scripts()  # Redis restarted or flushed its scripts
                continue  # what did run is idempotent or replayed the same way
            if checked:
                raise_first(replies)
            return replies
        raise AssertionError("unreachable")

    # -- outage ---------------------------------------------------------------------------------

    @property
    def down(self) -> bool:
        """Redis is out (an outage began and the probe has not seen it back)."""
        return not self.health.up

    def went_down(self, exc: BaseException) -> None:
        """Redis is out: tell the index, probe until it is back."""
        if self.down or self.closed:
            return
        self.health.went_down(exc)
        self._log.warning(
            "prefix index: Redis at %s unreachable (%s: %s); answering from %s and buffering "
            "writes until it is back",
            self.target.where, type(exc).__name__, exc, self._view,
        )  # fmt: skip
        self._on_down()
        self._prober = asyncio.get_running_loop().create_task(self._recover())

    async def _recover(self) -> None:
        delay = self.tuning.retry_s
        while not self.closed:
            await asyncio.sleep(delay)
            try:
                await self.ping()
                lost = await self.check_marker(rebuild=False)
            except (TimeoutError, RedisError, OSError, RedisClusterException):
                delay = min(delay * 2, self.tuning.retry_s * 10)
                continue
            await self.lane.reset()
            self._follower.forget()
            self._on_back(lost, self.health.came_back())
            return

    async def check_marker(self, rebuild: bool = True) -> bool:
        """Look at the namespace's marker; True when Redis lost the index since the last look
        (then, with `rebuild`, `on_lost()` refills it)."""
        last = self.last_write_at
        age = int((time.monotonic() - last) * 1000) if last is not None else 0
        live = last is not None and (not self._ttl_ms or age < self._ttl_ms)
        remaining = self._ttl_ms - age if self._ttl_ms else None
        async with asyncio.timeout(self.tuning.timeout_s * 4):
            lost = await self._marker.check(self.redis(), live, remaining)
        if lost and rebuild:
            self._on_lost()
        return lost

    async def _follow_master(self) -> None:
        """Sentinel: after a switch, a new client and an empty fast lane (prefix_index/
        redis_follow.py retires the old client once its calls are done)."""
        if await self._follower.moved(self._client, self._lane_addresses()):
            self._client = None
            await self.lane.reset()

    def _lane_addresses(self) -> set[tuple[str, int]]:
        return self.lane.addresses() if isinstance(self.lane, FastLane) else set()

    async def _watch(self) -> None:
        """Every `check_s`: where a Sentinel master is, and the marker (Redis may have lost the
        index); either also notices an outage when no traffic does."""
        while not self.closed:
            await asyncio.sleep(self.tuning.check_s)
            if self.down or self.closed:
                continue
            try:
                await self._follow_master()
                await self.check_marker()
            except OUTAGE as exc:
                self.went_down(exc)
            except RedisError as exc:
                self.complain("check", exc)

    def complain(self, what: str, exc: Exception) -> None:
        """One line per kind of refusal (OOM, READONLY...): Redis answers, so no outage."""
        kind = f"{what}:{type(exc).__name__}"
        if kind not in self._complaints and len(self._complaints) < 64:
            self._complaints.add(kind)
            self._log.warning("prefix index: Redis refused a %s (%s); carrying on", what, exc)
