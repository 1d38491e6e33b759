"""The PrefixIndex contract, one suite run against every backend (memory and redis)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from prefix_index import IndexStats, PrefixIndex
from tests.prefix_index.conftest import BACKENDS, FakeClock

S = "m5:model"
OTHER = "m5:other"


def chain(start: int, n: int) -> list[int]:
    return [start * 1_000_003 + i + 1 for i in range(n)]


A = chain(1, 12)
B = A[:5] + chain(2, 7)  # shares five blocks with A


@pytest.fixture(params=BACKENDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def settled(index: Any) -> None:
    """The redis backend settles its scope accounts (and the bound) after the writes."""
    flush = getattr(index, "flush", None)
    if flush is not None:
        await flush()


async def test_meets_the_protocol(kind: str, make_index: Callable[..., Any]) -> None:
    index = make_index(kind)
    assert isinstance(index, PrefixIndex)


async def test_empty_index_answers_zero_for_every_replica(
    kind: str, make_index: Callable[..., Any]
) -> None:
    index = make_index(kind, ttl_s=None)
    assert await index.match(S, A, ["r1", "r2"]) == {"r1": 0, "r2": 0}
    assert await index.match(S, [], ["r1"]) == {"r1": 0}
    assert await index.match(S, A, []) == {}


async def test_match_counts_leading_blocks_per_replica(
    kind: str, make_index: Callable[..., Any]
) -> None:
    index = make_index(kind, ttl_s=None)
    await index.record(S, "r1", A)
    await index.record(S, "r2", A[:4])
    await index.record(S, "r3", B)
    assert await index.match(S, A, ["r1", "r2", "r3", "r4"]) == {
        "r1": 12,
        "r2": 4,
        "r3": 5,
        "r4": 0,
    }
    assert await index.match(S, B, ["r1", "r3"]) == {"r1": 5, "r3": 12}
    assert await index.match(S, A[:3], ["r1"]) == {"r1": 3}
    assert await index.match(S, A + chain(9, 3), ["r1"]) == {"r1": 12}


async def test_scopes_never_share_blocks(kind: str, make_index: Callable[..., Any]) -> None:
    index = make_index(kind, ttl_s=None)
    await index.record(S, "r1", A)
    assert await index.match(OTHER, A, ["r1"]) == {"r1": 0}


async def test_lru_evicts_leaves_before_the_prefixes_they_hang_from(
    kind: str, make_index: Callable[..., Any]
) -> None:
    index = make_index(kind, capacity_blocks=10, ttl_s=None)
    await index.record(S, "r1", A[:6])
    await index.record(S, "r1", B[:8])  # blocks 0-4 shared, 3 new: 9 held
    await index.record(S, "r1", chain(3, 3))  # 12 > 10: the two oldest leaves go
    assert await index.match(S, A, ["r1"]) == {"r1": 5}  # A's leaf (block 5) went first
    assert await index.match(S, B, ["r1"]) == {"r1": 7}  # then B's deepest block
    assert await index.match(S, chain(3, 3), ["r1"]) == {"r1": 3}


async def test_recording_again_refreshes_recency(kind: str, make_index: Callable[..., Any]) -> None:
    index = make_index(kind, capacity_blocks=6, ttl_s=None)
    await index.record(S, "r1", chain(4, 3))
    await index.record(S, "r1", chain(5, 3))
    await index.record(S, "r1", chain(4, 3))  # chain 4 is now the most recent
    await index.record(S, "r1", chain(6, 3))  # chain 5 goes
    hits = [await index.match(S, chain(c, 3), ["r1"]) for c in (4, 5, 6)]
    assert hits == [{"r1": 3}, {"r1": 0}, {"r1": 3}]


async def test_capacity_is_per_replica(kind: str, make_index: Callable[..., Any]) -> None:
    index = make_index(kind, capacity_blocks=100, ttl_s=None)
    index.set_capacity("small", 4)
    await index.record(S, "small", A)
    await index.record(S, "big", A)
    assert await index.match(S, A, ["small", "big"]) == {"small": 4, "big": 12}


async def test_ttl_ages_out_blocks_not_recorded_again(
    kind: str, make_index: Callable[..., Any]
) -> None:
    clock = FakeClock()
    index = make_index(kind, ttl_s=10, clock=clock)
    await index.record(S, "r1", A)
    clock.advance(6)
    await index.record(S, "r1", A[:4])  # refreshes the first four blocks only
    clock.advance(5)
    assert await index.match(S, A, ["r1"]) == {"r1": 4}
    clock.advance(5)
    assert await index.match(S, A, ["r1"]) == {"r1": 0}


async def test_evict_cuts_the_chain_where_the_block_went(
    kind: str, make_index: Callable[..., Any]
) -> None:
    index = make_index(kind, ttl_s=None)
    await index.record(S, "r1", A)
    await index.record(S, "r2", A)
    await index.evict(S, "r1", [A[7]])
    assert await index.match(S, A, ["r1", "r2"]) == {"r1": 7, "r2": 12}
    await index.evict(S, "r1", [A[2], A[9]])
    assert await index.match(S, A, ["r1"]) == {"r1": 2}
    await index.record(S, "r1", A[:8])  # blocks 2 and 7 come back; 9 is still gone
    assert await index.match(S, A, ["r1"]) == {"r1": 9}
    await index.evict(S, "r1", [123456789])  # an unknown block is no error
    assert await index.match(S, B, ["r1"]) == {"r1": 5}


async def test_forget_drops_a_replica_in_every_scope(
    kind: str, make_index: Callable[..., Any]
) -> None:
    index = make_index(kind, ttl_s=None)
    await index.record(S, "r1", A)
    await index.record(OTHER, "r1", A)
    await index.record(S, "r2", A)
    await index.forget("r1")
    await index.forget("never-seen")
    assert await index.match(S, A, ["r1", "r2"]) == {"r1": 0, "r2": 12}
    assert await index.match(OTHER, A, ["r1"]) == {"r1": 0}
    await index.record(S, "r1", A[:3])  # a restarted replica learns again
    assert await index.match(S, A, ["r1"]) == {"r1": 3}


async def test_many_replicas(kind: str, make_index: Callable[..., Any]) -> None:
    index = make_index(kind, ttl_s=None)
    names = [f"replica-{i}" for i in range(130)]
    for i, name in enumerate(names):
        await index.record(S, name, A[: i % 13])
    hits = await index.match(S, A, names)
    assert hits == {name: i % 13 for i, name in enumerate(names)}


async def test_stats_count_blocks_per_replica(kind: str, make_index: Callable[..., Any]) -> None:
    index = make_index(kind, ttl_s=None)
    await index.record(S, "r1", A)
    await index.record(OTHER, "r1", A[:2])
    await index.record(S, "r2", B)
    stats = await index.stats()
    assert isinstance(stats, IndexStats)
    assert stats.backend == kind
    assert stats.blocks_per_replica == {"r1": 14, "r2": 12}
    assert stats.entries == 26
    assert stats.bytes_estimate > 0
    assert stats.healthy
    if stats.distinct_blocks is not None:
        assert stats.distinct_blocks == 12 + 2 + 7


async def test_a_global_bound_takes_the_least_recently_recorded_scope_first(
    kind: str, make_index: Callable[..., Any]
) -> None:
    clock = FakeClock()
    index = make_index(kind, ttl_s=None, clock=clock, max_blocks=50)  # a scope counts 8 more
    scopes = ["m5:s1", "m5:s2", "m5:s3", "m5:s4"]

    async def depths() -> list[int]:
        await settled(index)
        return [(await index.match(s, A, ["r1"]))["r1"] for s in scopes]

    for scope in scopes[:3]:
        clock.advance(1)
        await index.record(scope, "r1", A)
    assert await depths() == [2, 12, 12, 0]  # 60 > 50: the oldest scope lost its 10 leaves
    clock.advance(1)
    await index.record(scopes[1], "r1", A)  # s2 is now more recent than s3
    clock.advance(1)
    await index.record(scopes[3], "r1", A)  # 70: s1 goes whole, then s3 loses 10
    assert await depths() == [0, 12, 2, 12]
    stats = await index.stats()
    assert (stats.entries, stats.scopes, stats.bound_evicted) == (26, 3, 22)


async def test_bad_settings_are_refused(kind: str, make_index: Callable[..., Any]) -> None:
    with pytest.raises(ValueError, match="capacity_blocks"):
        make_index(kind, capacity_blocks=-1)
    with pytest.raises(ValueError, match="max_blocks"):
        make_index(kind, max_blocks=0)
    with pytest.raises(ValueError, match="ttl_s"):
        make_index(kind, ttl_s=0)
    index = make_index(kind)
    with pytest.raises(ValueError, match="capacity"):
        index.set_capacity("r1", -5)
