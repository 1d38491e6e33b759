"""Following a Sentinel master between requests, for every Redis user (the index's link, the rate
limiter): after a graceful switch (`SENTINEL FAILOVER`) the old master keeps accepting writes for
seconds until the sentinels demote it, and redis-py moves a connection only when it answers
READONLY. Writes made there meanwhile are lost with the demotion, so each user asks the sentinels
every `check_s` from a background task (no round trip per request) and, once the master moved,
opens a new client and retires the old one.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from prefix_index.redis_client import Client, RedisHealth, RedisTarget

Address = tuple[str, int]


@dataclass(eq=False, kw_only=True)
class MasterFollower:
    """Where `target`'s Sentinel master was at the last look; `health.switches` counts the moves.

    A retired client is closed `grace_s` after the move (the longest its calls in flight may
    still take), so no call breaks on it; `aclose()` closes the ones still waiting. `timeout_s`
    bounds one look; `who` starts the log line."""

    target: RedisTarget
    health: RedisHealth
    timeout_s: float
    grace_s: float
    log: logging.Logger
    who: str
    _master_at: Address | None = field(default=None, init=False)
    _retired: set[asyncio.Task[None]] = field(default_factory=set, init=False)

    @property
    def sentinel(self) -> bool:
        return self.target.kind == "sentinel"

    async def moved(self, client: Client | None, seen: set[Address] | None = None) -> bool:
        """Ask the sentinels where `client`'s master is now. True when it moved since the last
        look (at the first look: away from where the pool last connected, or from `seen`, the
        caller's own connections); then `client` is retired and the caller opens a new one. A
        connection in use now would go back to the pool still on the old master, hence a new
        client rather than the pool's own reconnect (which drops only the idle ones)."""
        if not self.sentinel or not isinstance(client, Redis):
            return False
        pool: Any = client.connection_pool
        before: Address | None = pool.master_address
        async with asyncio.timeout(self.timeout_s):
            address: Address = await pool.get_master_address()
        if self._master_at is not None:
            seen = {self._master_at}
        else:
            seen = (seen or set()) | ({before} if before else set())
        self._master_at = address
        if not seen - {address}:
            return False
        self.log.info("%s: %s moved to %s:%s; reconnecting", self.who, self.target.where, *address)
        self.health.switches += 1
        self._retire(client)
        return True

    def forget(self) -> None:
        """After an outage the client found the master by itself (every new connection asks the
        sentinels): the next look records where it is, a switch only if it moves after that."""
        self._master_at = None

    def _retire(self, client: Client) -> None:
        async def close() -> None:
            try:
                await asyncio.sleep(self.grace_s)
            finally:
                await client.aclose()

        task = asyncio.get_running_loop().create_task(close())
        self._retired.add(task)
        task.add_done_callback(self._retired.discard)

    async def aclose(self) -> None:
        """Close the retired clients now."""
        for task in list(self._retired):
            task.cancel()
        await asyncio.gather(*self._retired, return_exceptions=True)
