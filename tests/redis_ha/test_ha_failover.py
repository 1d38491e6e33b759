"""A gateway (real app, real socket, fake replicas) under traffic while its Redis master fails:
Sentinel (the master SIGKILLed, or demoted by SENTINEL FAILOVER) and Cluster (a master of three
SIGKILLed, its replica promoted). Every request succeeds; the index and the limits come back on the
new master, and the outage and recovery show in the index's and the limiter's `health`."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.gateway.conftest import rig
from tests.gateway.fake_replica import Upstream
from tests.redis_ha.servers import Cluster, SentinelSet, cluster, sentinel_set
from tests.redis_ha.traffic import TENANTS, TIGHT, Traffic, hit_totals, limited
from tests.support import poll_until


def gateway_extra(url: str) -> dict[str, Any]:
    return {
        "index": {"backend": "redis", "redis_url": url},
        "ratelimit": {"backend": "redis", "redis_url": url},
        "tenants": TENANTS,
    }


async def ride_through(url: str, fail: Any, what: str, graceful: bool = False) -> None:
    """Traffic through a gateway on `url`; `fail()` (in a thread) takes the master down and
    returns when the topology has a new one. Then: no failed request, recovery, hits, limits.
    `graceful`: the old master lives on (SENTINEL FAILOVER): the index follows the switch (an
    outage, or a switch it saw first), and so does the limiter (tests/redis_ha/
    test_ha_limiter_switch.py looks at where its writes go)."""
    ups = [Upstream(f"u{i}") for i in range(3)]
    async with (
        rig(ups, pool={"policy": "prefix_aware"}, extra=gateway_extra(url)) as r,
        aiohttp.ClientSession() as h,
    ):
        index, limiter = r.gateway.index, r.gateway.limiter
        assert index is not None and limiter is not None
        traffic = Traffic(h, r.url, groups=8, concurrency=2).start()
        try:
            await traffic.wait_for(40)
            t0 = time.monotonic()
            await asyncio.to_thread(fail)
            t_switched = time.monotonic() - t0
            await poll_until(
                lambda: index.healthy and limiter.health.up
                and index.health.recoveries + index.health.switches >= 1
                and limiter.health.recoveries + limiter.health.switches >= 1,
                timeout_s=20,
            )  # fmt: skip
            t_recovered = time.monotonic() - t0
            hits0, blocks0 = await hit_totals(h, r.url)
            entries0 = (await index.stats()).entries
            await traffic.wait_for(len(traffic.statuses) + 60)
        finally:
            await traffic.stop()
        hits1, blocks1 = await hit_totals(h, r.url)
        stats = await index.stats()
        tight = await limited(h, r.url, TIGHT, 5)
    ratio = (hits1 - hits0) / (blocks1 - blocks0)
    print(
        f"\n{what}: new master after {t_switched:.1f} s, index and limiter back after "
        f"{t_recovered:.1f} s; {len(traffic.statuses)} requests, none failed; index "
        f"{index.health.outages} outage(s), {index.health.down_s:.1f} s down, "
        f"{index.health.switches} switch(es) followed, {index.health.rebuilds} rebuild(s); "
        f"limiter {limiter.health.outages} outage(s), {limiter.health.switches} switch(es); "
        f"hit ratio after recovery {ratio:.2f}"
    )
    assert traffic.errors == [], traffic.errors[:5]
    assert set(traffic.statuses) == {200}
    if not graceful:
        assert index.health.outages >= 1 and index.health.down_s > 0
        assert limiter.health.outages >= 1
    assert stats.healthy and stats.entries > entries0  # new writes reach the new master
    assert ratio > 0.7  # the index answers from Redis again: later requests hit their prefixes
    assert tight == [200, 200, 200, 429, 429]  # and the limits apply again


@pytest.mark.parametrize("how", ["sigkill", "sentinel-failover"])
async def test_sentinel_failover_during_traffic(tmp_path: Path, how: str) -> None:
    found: SentinelSet = sentinel_set(tmp_path, replicas=1, down_after_ms=500)

    def fail() -> None:
        old = found.master()
        if how == "sigkill":
            old.kill()
        else:  # a graceful switch: the old master lives on as a replica (writes get READONLY)
            found.sentinels[0].client().sentinel_failover(found.name)
        found.wait_failover(old.port)

    try:
        await ride_through(found.url(), fail, f"Sentinel ({how})", graceful=how != "sigkill")
    finally:
        found.stop()


# redis-py's asyncio cluster client drops a node that left the topology with a command still
# on one of its connections, and that socket is closed only by the garbage collector (seen once
# in CI: "unclosed <socket ...>" from its hiredis parser; redis/redis-py#4053). The gateway's
# own sockets are held to account by tests/chaos/test_leaks_*.py.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_cluster_failover_during_traffic(tmp_path: Path) -> None:
    found: Cluster = cluster(tmp_path, masters=3, replicas=1, node_timeout_ms=1000)

    def fail() -> None:
        victim = found.master_of("{t}")  # the tenant's buckets live there, and some scopes
        victim.kill()
        found.wait_failover(victim)

    try:
        await ride_through(found.url(), fail, "Cluster (a master SIGKILLed)")
    finally:
        found.stop()
