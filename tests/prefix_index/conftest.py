"""Fixtures for the prefix index tests: a real Redis, one unique key namespace per test."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from prefix_index import MemoryIndex, RedisIndex, RedisTuning

REDIS_URL = os.environ.get("PREFIX_INDEX_REDIS_URL", "redis://127.0.0.1:6379/0")
BACKENDS = ("memory", "redis")


class FakeClock:
    """Seconds that only move when a test says so (both backends read it)."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


async def delete_namespace(url: str, namespace: str) -> None:
    client = aioredis.Redis.from_url(url)
    try:
        batch: list[bytes] = []
        async for key in client.scan_iter(match=f"{namespace}:*", count=1000):
            batch.append(key)
            if len(batch) >= 500:
                await client.delete(*batch)
                batch.clear()
        if batch:
            await client.delete(*batch)
    finally:
        await client.aclose()


@pytest.fixture
def namespace() -> str:
    return f"kvgwtest-{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def make_index(namespace: str) -> AsyncIterator[Callable[..., Any]]:
    """make_index(kind, **kwargs) -> a MemoryIndex or a RedisIndex on the test's namespace."""
    made: list[Any] = []

    def make(kind: str, **kwargs: Any) -> Any:
        if kind == "memory":
            index: Any = MemoryIndex(**kwargs)
        else:
            kwargs.setdefault("local_cache_s", 0)
            kwargs.setdefault("tuning", RedisTuning(timeout_s=2.0))
            index = RedisIndex(REDIS_URL, namespace=namespace, **kwargs)
        made.append(index)
        return index

    yield make
    for index in made:
        await index.aclose()
    await delete_namespace(REDIS_URL, namespace)
