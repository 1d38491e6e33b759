"""The match path to Redis: one hand-packed command on a dedicated connection, one timeout.

redis-py's command machinery costs more than the round trip; this keeps only its connections.
"""

from __future__ import annotations

import asyncio
import struct
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from redis.asyncio.connection import AbstractConnection, ConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError

_ARGS_MAX = 4096  # memoised replica lists


def pack_chain(hashes: Sequence[int]) -> bytes:
    """The chain as 8-byte big-endian values (the bytes in Redis key names)."""
    return struct.pack(f">{len(hashes)}Q", *hashes)


def bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


async def _bounded(load_scripts: Callable[[], Awaitable[None]], timeout_s: float) -> None:
    """Load the scripts within the match's budget: a master found without them (promoted after
    a failover) must not hold a request for redis-py's retries and backoff."""
    async with asyncio.timeout(timeout_s):
        await load_scripts()


class Lane(Protocol):
    """How a match reaches Redis: `command` packs it once, `call` makes the round trip."""

    def command(self, head: Sequence[bytes], replicas: Sequence[str]) -> Any: ...

    async def call(self, command: Any, load_scripts: Callable[[], Awaitable[None]]) -> Any: ...

    async def reset(self) -> None: ...


class FastLane:
    """Sends packed commands on connections made like the pool's, minus the socket timeout
    (redis-py spends a task per send on it): `call` bounds the whole round trip instead."""

    def __init__(self, pool: Callable[[], ConnectionPool], timeout_s: float, idle: int) -> None:
        self._pool = pool
        self._timeout_s = timeout_s
        self._idle_max = idle
        self._idle: list[AbstractConnection] = []
        self._current: weakref.WeakSet[AbstractConnection] = weakref.WeakSet()  # since reset
        self._args: dict[tuple[str, ...], tuple[int, bytes]] = {}

    def command(self, head: Sequence[bytes], replicas: Sequence[str]) -> bytes:
        """RESP for `head` arguments followed by the replica names (memoised: pools ask with
        the same lists again and again)."""
        key = tuple(replicas)
        names = self._args.get(key)
        if names is None:
            if len(self._args) >= _ARGS_MAX:
                self._args.clear()
            names = self._args[key] = (len(key), b"".join(bulk(r.encode()) for r in key))
        count = len(head) + names[0]
        return b"".join((b"*%d\r\n" % count, *(bulk(a) for a in head), names[1]))

    async def call(self, packed: bytes, load_scripts: Callable[[], Awaitable[None]]) -> Any:
        """One round trip. NOSCRIPT loads the scripts and retries once; a connection Redis
        closed since its last use is retried once on a new one; anything else raises."""
        for attempt in (0, 1):
            conn = self._idle.pop() if self._idle else self._connection()
            try:
                async with asyncio.timeout(self._timeout_s):
                    # connect() first: a Sentinel-managed connection asks where the master is
                    # there, not in send_packed_command
                    if not conn.is_connected:
                        await conn.connect()  # type: ignore[no-untyped-call]
                    await conn.send_packed_command(packed, check_health=False)
                    response = await conn.read_response()
            except NoScriptError:
                self._idle.append(conn)
                if attempt:
                    raise
                await _bounded(load_scripts, self._timeout_s * 4)
                continue
            except RedisConnectionError:
                await conn.disconnect()
                if attempt:
                    raise
                continue
            except BaseException:  # timeouts, cancellation: the reply may still be on its way
                await conn.disconnect()
                raise
            if len(self._idle) < self._idle_max and conn in self._current:
                self._idle.append(conn)
            else:
                await conn.disconnect()
            return response
        raise AssertionError("unreachable")

    async def reset(self) -> None:
        """Close the idle connections (after an outage, a master switch, or at shutdown); those in
        use close when their call is done."""
        self._current = weakref.WeakSet()
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.disconnect()

    def addresses(self) -> set[tuple[str, int]]:
        """Where the idle connections are connected."""
        found = ((getattr(c, "host", None), getattr(c, "port", None)) for c in self._idle)
        return {(h, p) for h, p in found if isinstance(h, str) and isinstance(p, int)}

    def _connection(self) -> AbstractConnection:
        pool = self._pool()
        kwargs = {**pool.connection_kwargs, "socket_timeout": None}
        conn: AbstractConnection = pool.connection_class(**kwargs)
        self._current.add(conn)
        return conn


class ClusterLane:
    """The same calls through a RedisCluster's own machinery, which routes each command to the
    node of its key's slot, follows MOVED/ASK and maps the slots again after a failover."""

    def __init__(self, client: Callable[[], Any], timeout_s: float) -> None:
        self._client = client
        self._timeout_s = timeout_s

    def command(self, head: Sequence[bytes], replicas: Sequence[str]) -> tuple[Any, ...]:
        return (head[0].decode(), *head[1:], *replicas)  # the cluster client wants a str name

    async def call(
        self, command: tuple[Any, ...], load_scripts: Callable[[], Awaitable[None]]
    ) -> Any:
        for attempt in (0, 1):
            try:
                async with asyncio.timeout(self._timeout_s):
                    return await self._client().execute_command(*command)
            except NoScriptError:  # a replica promoted since the scripts were loaded
                if attempt:
                    raise
                await _bounded(load_scripts, self._timeout_s * 4)
        raise AssertionError("unreachable")

    async def reset(self) -> None:
        return None
