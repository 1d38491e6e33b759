"""Precise mode on the redis backend: engine entries per gateway process, routed records shared
in Redis with the short life of a precise replica, and what differs from the memory backend."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefix_index import RedisIndex, RedisTuning
from prefix_index.tiers import CPU, DISK, SHARED
from tests.prefix_index.conftest import FakeClock
from tests.support import free_port

S = "m5:model"
A = [3_000_017 + i for i in range(10)]
NO_VIEW = RedisTuning(timeout_s=2.0, local_view=False)  # answers from Redis alone


async def test_a_precise_replicas_records_expire_in_redis_after_routed_ttl(
    make_index: Callable[..., Any],
) -> None:
    clock = FakeClock()
    writer = make_index("redis", ttl_s=600, clock=clock, routed_ttl_s=5.0)
    reader = make_index("redis", ttl_s=600, clock=clock, tuning=NO_VIEW)  # another gateway
    writer.set_precise("r1")
    await writer.record(S, "r1", A)
    await writer.record(S, "r2", A)  # not precise: the index-wide TTL
    clock.advance(4.9)
    assert await reader.match(S, A, ["r1", "r2"]) == {"r1": 10, "r2": 10}
    clock.advance(0.2)
    assert await reader.match(S, A, ["r1", "r2"]) == {"r1": 0, "r2": 10}
    assert await writer.match(S, A, ["r1", "r2"]) == {"r1": 0, "r2": 10}  # its local view too


async def test_a_shorter_index_ttl_bounds_the_routed_ttl(make_index: Callable[..., Any]) -> None:
    clock = FakeClock()
    index = make_index("redis", ttl_s=2.0, clock=clock, routed_ttl_s=10.0, tuning=NO_VIEW)
    index.set_precise("r1")
    await index.record(S, "r1", A)
    clock.advance(2.1)
    assert await index.match(S, A, ["r1"]) == {"r1": 0}


async def test_records_already_in_redis_keep_their_expiry_until_rewritten(
    make_index: Callable[..., Any],
) -> None:
    clock = FakeClock()
    index = make_index("redis", ttl_s=600, clock=clock, routed_ttl_s=5.0, tuning=NO_VIEW)
    await index.record(S, "r1", A)
    index.set_precise("r1")
    clock.advance(5.1)
    assert await index.match(S, A, ["r1"]) == {"r1": 10}  # written before the mark
    await index.record(S, "r1", A)  # rewritten: a guess now
    clock.advance(5.1)
    assert await index.match(S, A, ["r1"]) == {"r1": 0}
    index.set_precise("r1", False)  # undone for the next writes
    await index.record(S, "r1", A)
    clock.advance(599)
    assert await index.match(S, A, ["r1"]) == {"r1": 10}


async def test_two_gateways_share_routed_records_and_keep_their_own_engine_entries(
    make_index: Callable[..., Any],
) -> None:
    one, two = make_index("redis"), make_index("redis")
    await one.record_engine(S, "r1", A[:6])
    await one.record(S, "r2", A[:4])
    assert await one.match(S, A, ["r1", "r2"]) == {"r1": 6, "r2": 4}
    assert await two.match(S, A, ["r1", "r2"]) == {"r1": 0, "r2": 4}  # routed: shared
    await two.record_engine(S, "r1", A[:3])  # its own subscriber's report
    assert await two.match(S, A, ["r1"]) == {"r1": 3}
    assert (await one.stats()).engine_blocks_per_replica == {"r1": 6}
    assert (await two.stats()).engine_blocks_per_replica == {"r1": 3}
    await one.forget("r1")  # forgets r1's records in Redis and one's engine entries
    assert await one.match(S, A, ["r1"]) == {"r1": 0}
    assert await two.match(S, A, ["r1"]) == {"r1": 3}


async def test_without_a_local_view_engine_entries_still_count(
    make_index: Callable[..., Any],
) -> None:
    index = make_index("redis", tuning=NO_VIEW)
    await index.record(S, "r2", A)
    await index.record_engine(S, "r1", A[:7])
    assert index.match_local(S, A, ["r1"]) is None  # no local view of routed writes
    assert await index.match(S, A, ["r1", "r2"]) == {"r1": 7, "r2": 10}
    await index.record_tier(S, "r1", CPU, A[7:9])
    assert index.match_tiers(S, A, {"r1": 7}) == {"r1": {CPU: 2, DISK: 0, SHARED: 0}}
    await index.forget("r1")
    assert await index.match(S, A, ["r1"]) == {"r1": 0}
    assert index.match_tiers(S, A, {"r1": 0}) == {}


async def test_an_engine_eviction_leaves_redis_guess_to_its_routed_ttl(
    make_index: Callable[..., Any],
) -> None:
    clock = FakeClock()
    index = make_index("redis", clock=clock, routed_ttl_s=5.0, tuning=NO_VIEW)
    index.set_precise("r1")
    await index.record(S, "r1", A)
    await index.record_engine(S, "r1", A)
    await index.evict_engine(S, "r1", [A[6]])
    assert await index.match(S, A, ["r1"]) == {"r1": 10}  # Redis' guess, written moments ago
    clock.advance(5.1)
    assert await index.match(S, A, ["r1"]) == {"r1": 6}  # the engine's word


async def test_an_outage_answers_from_the_engine_entries() -> None:
    closed = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    for tuning in (RedisTuning(timeout_s=0.5), RedisTuning(timeout_s=0.5, local_view=False)):
        index = RedisIndex(closed, namespace="kvgwtest-outage", local_cache_s=0, tuning=tuning)
        try:
            await index.record_engine(S, "r1", A[:5])
            assert await index.match(S, A, ["r1", "r2"]) == {"r1": 5, "r2": 0}
            assert not index.healthy
            assert (await index.stats()).engine_entries == 5
        finally:
            await index.aclose()
