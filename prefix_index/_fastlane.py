"""The match path to Redis: one hand-packed command on a dedicated connection, one timeout.

redis-py's command machinery costs more than the round trip; this keeps only its connections.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from redis.asyncio.connection import AbstractConnection, ConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError

_ARGS_MAX = 4096  # memoised replica lists


def pack_chain(hashes: Sequence[int]) -> bytes:
    """The chain as 8-byte big-endian values (the bytes in Redis key names)."""
    return struct.pack(f">{len(hashes)}Q", *hashes)


def bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


class FastLane:
    """Sends packed commands on connections made like the pool's, minus the socket timeout
    (redis-py spends a task per send on it): `call` bounds the whole round trip instead."""

    def __init__(self, pool: Callable[[], ConnectionPool], timeout_s: float, idle: int) -> None:
        self._pool = pool
        self._timeout_s = timeout_s
        self._idle_max = idle
        self._idle: list[AbstractConnection] = []
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
                    await conn.send_packed_command(packed, check_health=False)
                    response = await conn.read_response()
            except NoScriptError:
                self._idle.append(conn)
                if attempt:
                    raise
                await load_scripts()
                continue
            except RedisConnectionError:
                await conn.disconnect()
                if attempt:
                    raise
                continue
            except BaseException:  # timeouts, cancellation: the reply may still be on its way
                await conn.disconnect()
                raise
            if len(self._idle) < self._idle_max:
                self._idle.append(conn)
            else:
                await conn.disconnect()
            return response
        raise AssertionError("unreachable")

    async def reset(self) -> None:
        """Close the idle connections (after an outage, or at shutdown)."""
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.disconnect()

    def _connection(self) -> AbstractConnection:
        pool = self._pool()
        kwargs = {**pool.connection_kwargs, "socket_timeout": None}
        return pool.connection_class(**kwargs)
