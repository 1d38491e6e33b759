"""What only the Redis backend has: a key layout for one slot per scope, sharing between
gateways, the local cache, long chains, and the factory."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot

from prefix_index import MemoryIndex, RedisIndex, open_index
from prefix_index.constants import scope_id
from prefix_index.redis import _redacted
from tests.prefix_index.conftest import REDIS_URL

S = "m5:model"


def chain(start: int, n: int) -> list[int]:
    return [start * 1_000_003 + i + 1 for i in range(n)]


A = chain(1, 12)


async def keys_of(namespace: str) -> list[bytes]:
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        return [k async for k in client.scan_iter(match=f"{namespace}:*", count=1000)]
    finally:
        await client.aclose()


async def test_every_key_of_a_scope_lives_in_one_cluster_slot(
    make_index: Callable[..., Any], namespace: str
) -> None:
    index = make_index("redis", ttl_s=60)
    await index.record(S, "r1", A)
    await index.evict(S, "r1", [A[5]])  # creates the hole keys too
    await index.record("m5:other", "r2", A[:3])
    keys = await keys_of(namespace)
    tag = f"{namespace}:{{{scope_id(S)}}}:".encode()
    scoped = [k for k in keys if k.startswith(tag)]
    assert len(scoped) == 11 + 1 + 1 + 1 + 1  # 11 blocks left, LRU, holes, holey, seq
    assert len({key_slot(k) for k in scoped}) == 1
    assert all(k.startswith(f"{namespace}:".encode()) for k in keys)
    assert {f"{namespace}:rs:r1".encode(), f"{namespace}:replicas".encode()} <= set(keys)
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        ttls = [await client.pttl(k) for k in scoped]
    finally:
        await client.aclose()
    assert all(0 < t <= 60_000 for t in ttls)  # everything of a scope ages out


async def test_gateways_sharing_a_namespace_see_one_picture(
    make_index: Callable[..., Any],
) -> None:
    one, two = make_index("redis"), make_index("redis")
    await one.record(S, "r1", A)
    assert await two.match(S, A, ["r1"]) == {"r1": 12}
    await two.evict(S, "r1", [A[4]])
    assert await one.match(S, A, ["r1"]) == {"r1": 4}
    await two.forget("r1")
    assert await one.match(S, A, ["r1"]) == {"r1": 0}


async def test_the_local_cache_skips_redis_for_a_short_while(
    make_index: Callable[..., Any],
) -> None:
    cached = make_index("redis", local_cache_s=60)
    other = make_index("redis")
    await cached.record(S, "r1", A[:3])
    assert await cached.match(S, A, ["r1", "r2"]) == {"r1": 3, "r2": 0}
    await other.record(S, "r2", A)  # another gateway's write is not seen until expiry...
    assert await cached.match(S, A, ["r1", "r2"]) == {"r1": 3, "r2": 0}
    await cached.record(S, "r1", A[:5])  # ...but this gateway's own write invalidates
    assert await cached.match(S, A, ["r1", "r2"]) == {"r1": 5, "r2": 12}


async def test_long_chains_and_many_holes(make_index: Callable[..., Any]) -> None:
    index = make_index("redis", ttl_s=None)
    mirror = MemoryIndex(ttl_s=None)
    long = chain(7, 2500)  # longer than every batch inside the scripts
    names = [f"r{i}" for i in range(12)]
    for i, name in enumerate(names):
        depth = 2500 - 150 * i
        await index.record(S, name, long[:depth])
        await mirror.record(S, name, long[:depth])
    evicted = long[1300:1302] + long[2100::3]  # over 1,000 evictions in one call
    for index_ in (index, mirror):
        await index_.evict(S, "r0", evicted)
        await index_.evict(S, "r3", long[1700:1701])
    want = await mirror.match(S, long, names)
    assert want["r0"] == 1300 and want["r3"] == 1700 and want["r11"] == 850
    assert await index.match(S, long, names) == want


async def test_concurrent_records_all_land(make_index: Callable[..., Any]) -> None:
    import asyncio

    index = make_index("redis", ttl_s=None)
    chains = [chain(100 + i, 5) for i in range(60)]
    await asyncio.gather(*(index.record(S, f"r{i % 6}", c) for i, c in enumerate(chains)))
    reader = make_index("redis")
    for i, c in enumerate(chains):
        assert await reader.match(S, c, [f"r{i % 6}"]) == {f"r{i % 6}": 5}
    assert (await index.stats()).entries == 300


def test_open_index_builds_each_backend_by_name() -> None:
    assert isinstance(open_index("memory"), MemoryIndex)
    index = open_index("redis", redis_url=REDIS_URL, capacity_blocks=10, ttl_s=None)
    assert isinstance(index, RedisIndex)
    assert index._ttl_ms == 600_000  # shared entries always age out
    with pytest.raises(ValueError, match="index.redis_url is required"):
        open_index("redis")
    with pytest.raises(ValueError, match="index.backend must be one of memory, redis"):
        open_index("etcd")
    with pytest.raises(ValueError, match="namespace"):
        RedisIndex(REDIS_URL, namespace="a{b}")


def test_urls_in_logs_hide_passwords() -> None:
    assert _redacted("redis://:secret@host:6379/0") == "redis://:***@host:6379/0"
    assert _redacted("redis://user:secret@host/1") == "redis://user:***@host/1"
    assert _redacted("redis://host:6379/0") == "redis://host:6379/0"


async def test_no_warning_in_normal_operation(
    make_index: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="prefix_index")
    index = make_index("redis")
    assert await index.connect()
    await index.record(S, "r1", A)
    await index.match(S, A, ["r1"])
    assert await index.flush()
    assert caplog.records == []
