"""The rate limiter follows a graceful Sentinel switch (SENTINEL FAILOVER) as the index does: the
old master keeps accepting writes for ~10 s until the sentinels demote it (and the demotion
discards them), so the limiter asks the sentinels every `check_s` and moves its buckets' writes
to the new master within about a second of the switch, with no failed request and no bucket
reset (a tenant at its limit stays limited: the buckets replicated before the switch)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp

from gateway.limits.ratelimit import RedisRateLimiter
from tests.gateway.conftest import rig
from tests.gateway.fake_replica import Upstream
from tests.gateway.test_gw_redis_metrics import sample
from tests.redis_ha.servers import Node, SentinelSet, sentinel_set
from tests.redis_ha.traffic import TENANTS, TIGHT, Traffic, limited
from tests.support import poll_until


def newest_write(node: Node, tenant: str) -> float:
    """The Redis time of the newest bucket write for `tenant` on `node` (0: none)."""
    c = node.client()
    try:
        stamps = [c.hget(k, "t") for k in c.scan_iter(f"kvgw:rl:{{{tenant}}}:*")]
    finally:
        c.close()
    return max((float(s) for s in stamps if s is not None), default=0.0)


def redis_now(node: Node) -> float:
    c = node.client()
    try:
        seconds, micros = c.time()
    finally:
        c.close()
    return seconds + micros / 1e6


async def test_limiter_follows_a_graceful_switch(tmp_path: Path) -> None:
    found: SentinelSet = sentinel_set(tmp_path, replicas=1, down_after_ms=500)
    extra = {"ratelimit": {"backend": "redis", "redis_url": found.url()}, "tenants": TENANTS}
    old = found.master()
    replica = next(n for n in found.nodes if n is not old)
    try:
        async with rig([Upstream("u0")], extra=extra) as r, aiohttp.ClientSession() as h:
            limiter = r.gateway.limiter
            assert isinstance(limiter, RedisRateLimiter)
            traffic = Traffic(h, r.url, concurrency=2).start()
            try:
                await traffic.wait_for(40)
                assert await limited(h, r.url, TIGHT, 4) == [200, 200, 200, 429]
                await poll_until(lambda: newest_write(replica, "tight") > 0)  # replicated
                t0 = time.monotonic()
                await asyncio.to_thread(found.sentinels[0].client().sentinel_failover, found.name)
                port = await asyncio.to_thread(found.wait_failover, old.port)
                t_named = time.monotonic() - t0
                assert port == replica.port
                promoted = redis_now(replica)  # it replicates nothing from the old one since
                # the next look at the sentinels (check_s, 1 s) moves the limiter; on a master
                # still in place the writes would reach the old one until its demotion (~10 s)
                await poll_until(lambda: newest_write(replica, "t") > promoted, timeout_s=3)
                t_moved = time.monotonic() - t0
                await traffic.wait_for(len(traffic.statuses) + 40)
                on_old = newest_write(old, "t")
                await traffic.wait_for(len(traffic.statuses) + 40)
                assert newest_write(old, "t") == on_old  # nothing more to the doomed master
            finally:
                await traffic.stop()
            tight = await limited(h, r.url, TIGHT, 2)
            async with h.get(r.url + "/metrics") as res:
                metrics = await res.text()
    finally:
        found.stop()
    print(
        f"\nlimiter, graceful switch: sentinels name the new master {t_named:.1f} s after "
        f"SENTINEL FAILOVER, the limiter writes there {t_moved:.1f} s after it "
        f"({t_moved - t_named:.1f} s later); {len(traffic.statuses)} requests, "
        f"{len(traffic.errors)} failed; limiter {limiter.health.switches} switch(es), "
        f"{limiter.health.outages} outage(s); tight tenant after the switch {tight}"
    )
    assert traffic.errors == [], traffic.errors[:5]
    assert limiter.health.switches == 1 and limiter.health.outages == 0
    assert sample(metrics, "gateway_redis_master_switches_total", "ratelimit") == 1
    assert sample(metrics, "gateway_redis_outages_total", "ratelimit") == 0
    assert tight == [429, 429]  # its exhausted bucket came over with the replication
