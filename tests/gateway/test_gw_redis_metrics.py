"""Redis health on /metrics (gateway_redis_*, gateway_index_rebuilds_*): a real gateway whose index
and rate limiter use a real redis-server the test kills and starts again (it comes back empty, so
the index is rebuilt), and one pointed at a port where nothing listens."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from prefix_index.constants import DEFAULT_NAMESPACE, epoch_key
from tests.gateway.conftest import rig
from tests.gateway.fake_replica import Upstream
from tests.redis_ha.servers import MISSING, REDIS_SERVER, data_node
from tests.support import free_port

KEY = "sk-tenant-redis-metrics-01"
BODY = {"model": "test-model", "messages": [{"role": "user", "content": "shared prefix " * 40}]}


def gateway_on(url: str) -> Any:
    """A gateway (prefix-aware, so every request matches and records) on the Redis at `url`."""
    return rig([Upstream("u"), Upstream("v")], pool={"policy": "prefix_aware"}, extra=on_redis(url))


def on_redis(url: str) -> dict[str, Any]:
    return {
        "index": {"backend": "redis", "redis_url": url},
        "ratelimit": {"backend": "redis", "redis_url": url},
        "fleet": {"shared_load": False},
        "tenants": [{"name": "t", "api_keys": [KEY], "limits": {"requests_per_minute": 100_000}}],
    }


def sample(text: str, name: str, component: str | None = None) -> float | None:
    """The value of one series of a /metrics page (None: no such series)."""
    labels = "" if component is None else f'{{component="{component}"}}'
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return None if m is None else float(m.group(1))


async def request(h: aiohttp.ClientSession, url: str) -> None:
    headers = {"authorization": f"Bearer {KEY}"}
    async with h.post(url + "/v1/chat/completions", json=BODY, headers=headers) as res:
        assert res.status == 200, await res.text()  # Redis out or not: fail-open


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"not within {timeout_s} s"
        await asyncio.sleep(0.05)


async def scrape(h: aiohttp.ClientSession, url: str) -> str:
    async with h.get(url + "/metrics") as res:
        assert res.status == 200
        return await res.text()


async def test_nothing_listening_reads_down_with_the_outage_counted() -> None:
    closed = f"redis://127.0.0.1:{free_port()}/0"
    async with gateway_on(closed) as r, aiohttp.ClientSession() as h:
        await request(h, r.url)
        text = ""

        async def both_down() -> bool:
            nonlocal text
            text = await scrape(h, r.url)
            return all(sample(text, "gateway_redis_up", c) == 0 for c in ("index", "ratelimit"))

        await until(both_down, timeout_s=5)
        for component in ("index", "ratelimit"):
            assert sample(text, "gateway_redis_outages_total", component) == 1
            assert sample(text, "gateway_redis_recoveries_total", component) == 0
            assert sample(text, "gateway_redis_down_seconds_total", component) == 0
            assert sample(text, "gateway_redis_master_switches_total", component) == 0
        assert sample(text, "gateway_index_rebuilds_total") == 0


async def test_memory_stores_have_the_families_without_samples() -> None:
    async with rig([Upstream("u")]) as r, aiohttp.ClientSession() as h:
        text = await scrape(h, r.url)
    for family in (
        "gateway_redis_up",
        "gateway_redis_outages_total",
        "gateway_index_rebuilds_total",
    ):
        assert f"# TYPE {family} " in text
    assert sample(text, "gateway_redis_up", "index") is None
    assert sample(text, "gateway_index_rebuilds_total") is None


@pytest.mark.skipif(REDIS_SERVER is None, reason=MISSING)
async def test_a_killed_redis_reads_down_then_up_with_a_recovery_and_a_rebuild(
    tmp_path: Path,
) -> None:
    node = await asyncio.to_thread(data_node, tmp_path)
    url = f"redis://127.0.0.1:{node.port}/0"
    try:
        async with gateway_on(url) as r, aiohttp.ClientSession() as h:
            for _ in range(3):
                await request(h, r.url)
            text = await scrape(h, r.url)
            for component in ("index", "ratelimit"):
                assert sample(text, "gateway_redis_up", component) == 1
                assert sample(text, "gateway_redis_outages_total", component) == 0

            # the index marks the namespace once it holds entries (within index check_s = 1 s):
            # a Redis that comes back without the mark lost the index, and it is rebuilt
            marker = epoch_key(DEFAULT_NAMESPACE, DEFAULT_NAMESPACE)
            with node.client() as probe:
                await until(lambda: asyncio.to_thread(probe.exists, marker), timeout_s=5)
            await asyncio.to_thread(node.kill)

            async def reads(up: float) -> bool:
                nonlocal text
                await request(h, r.url)  # traffic is what notices (and, for the limiter, probes)
                text = await scrape(h, r.url)
                return all(
                    sample(text, "gateway_redis_up", c) == up for c in ("index", "ratelimit")
                )

            await until(lambda: reads(0), timeout_s=10)
            for component in ("index", "ratelimit"):
                assert sample(text, "gateway_redis_outages_total", component) == 1
                assert sample(text, "gateway_redis_recoveries_total", component) == 0

            await asyncio.to_thread(node.start)  # the same port, empty: the index was lost
            await until(lambda: reads(1), timeout_s=20)
            for component in ("index", "ratelimit"):
                assert sample(text, "gateway_redis_outages_total", component) == 1
                assert sample(text, "gateway_redis_recoveries_total", component) == 1
                assert (sample(text, "gateway_redis_down_seconds_total", component) or 0) > 0
            assert sample(text, "gateway_index_rebuilds_total") == 1
            assert (sample(text, "gateway_index_rebuilt_records_total") or 0) >= 1
    finally:
        await asyncio.to_thread(node.kill)
