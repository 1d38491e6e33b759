"""Precise mode: engine-reported blocks beside routed guesses, on both backends (the redis
one keeps engine entries in its own process: test_index_precise_redis.py has what differs)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from prefix_index import EngineEventSink, MemoryIndex, PrefixIndex, RedisIndex
from tests.prefix_index.conftest import BACKENDS, FakeClock

S = "m5:model"
A = [1_000_003 + i for i in range(10)]
B = A[:3] + [2_000_003 + i for i in range(5)]


@pytest.fixture(params=BACKENDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_both_backends_are_engine_event_sinks(make_index: Callable[..., Any]) -> None:
    for index in (make_index("memory"), make_index("redis")):
        assert isinstance(index, EngineEventSink) and isinstance(index, PrefixIndex)
    assert EngineEventSink in MemoryIndex.__mro__ and EngineEventSink in RedisIndex.__mro__


async def test_match_takes_the_longer_run_of_the_two_sources(
    kind: str, make_index: Callable[..., Any]
) -> None:
    index = make_index(kind)
    await index.record(S, "r1", A[:4])  # routed: 4
    await index.record_engine(S, "r1", A[:7])  # engine: 7
    await index.record(S, "r2", A)  # routed only: 10
    await index.record_engine(S, "r3", A[:2])
    await index.record_engine(S, "r3", A[2:5])  # a continuation, reported later
    assert await index.match(S, A, ["r1", "r2", "r3", "r4"]) == {
        "r1": 7,
        "r2": 10,
        "r3": 5,
        "r4": 0,
    }
    assert await index.match(S, B, ["r1", "r3"]) == {"r1": 3, "r3": 3}


async def test_engine_blocks_need_not_be_prefix_closed(
    kind: str, make_index: Callable[..., Any]
) -> None:
    index = make_index(kind)
    await index.record_engine(S, "r1", A)
    await index.evict_engine(S, "r1", [A[3]])  # the engine evicted a block in the middle
    assert await index.match(S, A, ["r1"]) == {"r1": 3}
    await index.evict_engine(S, "r1", [A[0]])
    assert await index.match(S, A, ["r1"]) == {"r1": 0}
    await index.record_engine(S, "r1", [A[0], A[3]])  # stored again: the tail is reachable
    assert await index.match(S, A, ["r1"]) == {"r1": 10}


async def test_routed_entries_are_short_lived_on_a_precise_replica(
    kind: str, make_index: Callable[..., Any]
) -> None:
    clock = FakeClock()
    index = make_index(kind, ttl_s=None, clock=clock, routed_ttl_s=10.0)
    index.set_precise("r1")
    await index.record(S, "r1", A)
    await index.record(S, "r2", A)  # not precise: no TTL, as before
    await index.record_engine(S, "r1", A[:2])
    clock.advance(9.9)
    assert await index.match(S, A, ["r1", "r2"]) == {"r1": 10, "r2": 10}
    clock.advance(0.2)
    assert await index.match(S, A, ["r1", "r2"]) == {"r1": 2, "r2": 10}
    clock.advance(3600)
    assert await index.match(S, A, ["r1", "r2"]) == {"r1": 2, "r2": 10}  # engine: no TTL


async def test_turning_precise_on_cuts_existing_routed_entries() -> None:
    """The memory index's own entries; Redis' keep their expiry (test_index_precise_redis)."""
    clock = FakeClock()
    index = MemoryIndex(ttl_s=600, clock=clock, routed_ttl_s=5.0)
    await index.record(S, "r1", A)
    clock.advance(100)
    index.set_precise("r1")
    clock.advance(5.1)
    assert await index.match(S, A, ["r1"]) == {"r1": 0}
    index.set_precise("r1", False)  # back to the index-wide TTL
    await index.record(S, "r1", A)
    clock.advance(599)
    assert await index.match(S, A, ["r1"]) == {"r1": 10}


async def test_an_engine_eviction_also_cuts_the_routed_guess() -> None:
    """In memory at once; in Redis the guess lasts its routed_ttl_s (test_index_precise_redis)."""
    index = MemoryIndex()
    index.set_precise("r1")
    await index.record(S, "r1", A)
    await index.record_engine(S, "r1", A)
    await index.evict_engine(S, "r1", [A[6]])
    assert await index.match(S, A, ["r1"]) == {"r1": 6}
    await index.evict(S, "r1", [A[2]])  # a routed evict leaves the engine's word alone
    assert await index.match(S, A, ["r1"]) == {"r1": 6}


async def test_forget_clears_both_and_keeps_the_precise_mark(
    kind: str, make_index: Callable[..., Any]
) -> None:
    clock = FakeClock()
    index = make_index(kind, clock=clock, routed_ttl_s=1.0)
    index.set_precise("r1")
    await index.record(S, "r1", A)
    await index.record_engine(S, "r1", A)
    await index.record_engine(S, "r2", A)
    await index.forget("r1")
    assert await index.match(S, A, ["r1", "r2"]) == {"r1": 0, "r2": 10}
    await index.record(S, "r1", A)
    clock.advance(1.5)
    assert await index.match(S, A, ["r1"]) == {"r1": 0}
    stats = await index.stats()
    assert stats.engine_blocks_per_replica == {"r2": 10} and stats.engine_entries == 10
    await index.forget("r2")
    assert (await index.stats()).engine_entries == 0


async def test_the_engine_safety_cap_drops_the_oldest_reports() -> None:
    index = MemoryIndex(engine_capacity_blocks=4)
    await index.record_engine(S, "r1", A[:3])
    await index.record_engine(S, "r1", A[3:6])
    assert await index.match(S, A, ["r1"]) == {"r1": 0}  # the root went first
    stats = index.stats_now()
    assert stats.engine_entries == 4 and stats.engine_trimmed == 2
    await index.record_engine(S, "r1", A[:2])  # re-reported: the newest again
    assert await index.match(S, A, ["r1"]) == {"r1": 2}


async def test_engine_entries_against_a_naive_model(
    kind: str, make_index: Callable[..., Any]
) -> None:
    """Random stores and evictions of pieces of a few chains; print the seed on failure."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    chains = [[c * 10_000 + i for i in range(12)] for c in range(3)]
    chains.append(chains[0][:5] + [99_000 + i for i in range(7)])
    replicas = ["r0", "r1", "r2"]
    index = make_index(kind)
    model: dict[str, set[int]] = {r: set() for r in replicas}
    for _ in range(400):
        r = rng.choice(replicas)
        chain = rng.choice(chains)
        lo = rng.randrange(len(chain))
        piece = chain[lo : lo + rng.randint(1, 4)]
        op = rng.random()
        if op < 0.55:
            await index.record_engine(S, r, piece)
            model[r].update(piece)
        elif op < 0.95:
            await index.evict_engine(S, r, piece)
            model[r].difference_update(piece)
        else:
            await index.forget(r)
            model[r].clear()
        probe = rng.choice(chains)
        want = {}
        for name in replicas:
            depth = 0
            while depth < len(probe) and probe[depth] in model[name]:
                depth += 1
            want[name] = depth
        assert await index.match(S, probe, replicas) == want, f"seed {seed}"
