"""Rebuild, do not forget: when Redis loses the index (FLUSHALL, a restart without persistence),
the gateway notices by its marker and re-writes its journal of recent records, so prefix hits come
back before traffic re-teaches every prefix."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp

from prefix_index import RedisIndex, RedisTuning
from tests.gateway.conftest import rig
from tests.gateway.fake_replica import Upstream
from tests.redis_ha.servers import data_node
from tests.redis_ha.traffic import TENANTS, Traffic, hit_totals

GROUPS = 48  # prefixes; at ~25 requests/s each comes back every ~2 s


async def window_ratio(h: aiohttp.ClientSession, url: str, seconds: float) -> float:
    hits0, blocks0 = await hit_totals(h, url)
    await asyncio.sleep(seconds)
    hits1, blocks1 = await hit_totals(h, url)
    return (hits1 - hits0) / max(1.0, blocks1 - blocks0)


async def test_a_flushall_during_traffic_is_refilled_from_the_journal(tmp_path: Path) -> None:
    node = data_node(tmp_path)
    url = f"redis://127.0.0.1:{node.port}/0"
    extra = {"index": {"backend": "redis", "redis_url": url}, "tenants": TENANTS}
    ups = [Upstream(f"u{i}") for i in range(3)]
    try:
        async with (
            rig(ups, pool={"policy": "prefix_aware"}, extra=extra) as r,
            aiohttp.ClientSession() as h,
        ):
            index = r.gateway.index
            assert isinstance(index, RedisIndex)
            # one client, paced: each request's match comes from Redis (no burst for the local
            # view to bridge), and every prefix is seen again only every couple of seconds
            traffic = Traffic(h, r.url, groups=GROUPS, concurrency=1, pace_s=0.04).start()
            try:
                await traffic.wait_for(2 * GROUPS, timeout_s=30)
                before = await window_ratio(h, r.url, 1.5)
                node.client().flushall()
                at_flush = len(traffic.statuses)  # (the next one may be on its way)
                flushed = await window_ratio(h, r.url, 0.3)  # until the marker is checked
                back = None  # requests answered since the flush when hits were back
                for _ in range(60):  # up to 15 s
                    ratio = await window_ratio(h, r.url, 0.25)
                    if ratio >= 0.9 * before:
                        back = len(traffic.statuses) - at_flush
                        break
                after = await window_ratio(h, r.url, 1.0)
            finally:
                await traffic.stop()
        health = index.health
        print(
            f"\nFLUSHALL under {len(traffic.statuses)} requests: hit ratio {before:.2f} before, "
            f"{flushed:.2f} just after, back within 10 % {back} requests after it ({after:.2f}); "
            f"{health.rebuilds} rebuild(s) replayed {health.replayed_writes} records"
        )
        assert traffic.errors == [] and set(traffic.statuses) == {200}  # 0 failed requests
        assert before > 0.8
        assert health.rebuilds == 1 and health.replayed_writes >= GROUPS
        # back before traffic re-taught a single prefix: one client cycles through the groups,
        # so no group was asked for twice since the flush; the hits came from the journal
        assert back is not None and back < GROUPS, back
        assert after >= 0.9 * before
    finally:
        node.kill()


async def test_a_restart_without_persistence_is_refilled_when_redis_is_back(
    tmp_path: Path,
) -> None:
    node = data_node(tmp_path)
    url = f"redis://127.0.0.1:{node.port}/0"
    tuning = RedisTuning(timeout_s=0.5, retry_s=0.1, check_s=0.2)
    index = RedisIndex(url, namespace="rb", local_cache_s=0, tuning=tuning)
    reader = RedisIndex(
        url, namespace="rb", local_cache_s=0,
        tuning=RedisTuning(timeout_s=0.5, local_view=False),  # answers from Redis alone
    )  # fmt: skip
    chains = {s: [s * 1_000 + i + 1 for i in range(30)] for s in range(20)}
    try:
        assert await index.connect()
        for s, chain in chains.items():
            await index.record(f"m:{s}", "r1", chain)
        await asyncio.sleep(0.3)  # the marker is written at the first check
        node.kill()
        node.start()  # same port, empty: the index finds its marker gone (no read of the
        # reader's here: the index can refill the node before that read, one flake in ~10 runs)
        deadline = time.monotonic() + 10
        while index.health.rebuilds == 0:
            assert time.monotonic() < deadline, index.health
            await asyncio.sleep(0.05)
        assert await index.flush()
        for s, chain in chains.items():  # another gateway sees every record again
            assert await reader.match(f"m:{s}", chain, ["r1"]) == {"r1": 30}
        assert index.health.replayed_writes == len(chains)
        assert index.health.rebuilds == 1  # (seen as an outage first, or only by the marker)
    finally:
        await index.aclose()
        await reader.aclose()
        node.kill()


def test_the_journal_is_bounded_and_forgets_what_the_index_forgot() -> None:
    from prefix_index._fastlane import pack_chain
    from prefix_index._rebuild import Journal
    from prefix_index._writes import Write

    def write(hashes: list[int], expiry: int = 0) -> Write:
        command = ("EVALSHA", "sha", 1, b"seq", b"pre", 0, 0, 9, "r", pack_chain(hashes), expiry)
        return Write([command], blocks=len(hashes))

    j = Journal(max_writes=3, max_blocks=10)
    j.add("s", "r1", [1, 2, 3], write([1, 2, 3]))
    j.add("s", "r1", [1, 2, 3], write([1, 2, 3]))  # the same chain again: one record
    j.add("s", "r2", [1, 2, 3], write([1, 2, 3], expiry=500))
    assert (len(j), j.blocks) == (2, 6)
    j.add("s", "r1", [7, 8, 9, 10, 11], write([7, 8, 9, 10, 11]))  # 11 blocks > 10: oldest goes
    assert (len(j), j.blocks) == (2, 8)
    assert [w.blocks for w in j.replay(now_ms=100)] == [3, 5]
    assert [w.blocks for w in j.replay(now_ms=600)] == [5]  # r2's record expired, and left
    j.add("s", "r1", [1, 2], write([1, 2]))
    j.drop_chain("s", "r1", [9, 10, 11])  # evicted blocks 9..: the record holding them goes
    assert [w.blocks for w in j.replay(now_ms=0)] == [2]
    j.drop_replica("r1")
    assert (len(j), j.blocks) == (0, 0)
    assert len(Journal(max_writes=0, max_blocks=10)) == 0
