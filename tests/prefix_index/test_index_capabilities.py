"""The optional capabilities of PrefixIndex (record_nowait, match_local, set_capacity,
set_precise, match_tiers, stats_now): the Protocol's defaults, and what each backend does
instead."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from prefix_index import (
    EngineEventSink,
    IndexStats,
    MemoryIndex,
    PrefixIndex,
    RedisIndex,
    RedisTuning,
)
from prefix_index.constants import DEFAULT_ROUTED_TTL_S
from tests.prefix_index.conftest import BACKENDS, FakeClock

S = "m5:model"
CHAIN = [11, 12, 13, 14]


class Exact(PrefixIndex):
    """The contract's five coroutines and nothing more: exact chains only, no LRU, no TTL."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, str], list[int]] = {}

    async def match(
        self, scope: str, hashes: Sequence[int], replicas: Sequence[str]
    ) -> dict[str, int]:
        out = {}
        for r in replicas:
            held = self.held.get((scope, r), [])
            n = 0
            while n < min(len(held), len(hashes)) and held[n] == hashes[n]:
                n += 1
            out[r] = n
        return out

    async def record(self, scope: str, replica: str, hashes: Sequence[int]) -> None:
        self.held[(scope, replica)] = list(hashes)

    async def evict(self, scope: str, replica: str, hashes: Sequence[int]) -> None:
        self.held.pop((scope, replica), None)

    async def forget(self, replica: str) -> None:
        self.held = {k: v for k, v in self.held.items() if k[1] != replica}

    async def aclose(self) -> None:
        return None


@pytest.fixture(params=BACKENDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_a_backend_with_only_the_contract_gets_the_do_nothing_defaults() -> None:
    index = Exact()
    assert isinstance(index, PrefixIndex)
    assert index.record_nowait(S, "r1", CHAIN) is False  # nothing taken: the caller awaits
    assert await index.match(S, CHAIN, ["r1"]) == {"r1": 0}
    await index.record(S, "r1", CHAIN)
    assert index.match_local(S, CHAIN, ["r1"]) is None  # knows nothing without the coroutine
    index.set_capacity("r1", 1)
    index.set_precise("r1")
    assert await index.match(S, CHAIN, ["r1"]) == {"r1": 4}  # both were ignored
    assert index.match_tiers(S, CHAIN, {"r1": 4}) == {}  # keeps no tiers
    assert index.stats_now() is None


def test_both_backends_subclass_the_protocol() -> None:
    for backend in (MemoryIndex, RedisIndex):
        assert PrefixIndex in backend.__mro__
    assert EngineEventSink in MemoryIndex.__mro__ and EngineEventSink in RedisIndex.__mro__


async def test_record_nowait_is_taken_and_seen_locally_at_once(
    kind: str, make_index: Callable[..., Any]
) -> None:
    index = make_index(kind, ttl_s=None)
    assert index.record_nowait(S, "r1", CHAIN) is True
    assert index.match_local(S, CHAIN, ["r1", "r2"]) == {"r1": 4, "r2": 0}
    if kind == "redis":
        await index.flush()  # queued: Redis has it once the flusher ran
    assert await index.match(S, CHAIN, ["r1", "r2"]) == {"r1": 4, "r2": 0}
    assert index.record_nowait(S, "r1", []) is True  # nothing to write is no reason to await


async def test_a_match_finds_the_gateways_own_records_still_on_their_way(
    kind: str, make_index: Callable[..., Any]
) -> None:
    """The next request of a burst on a new prefix is matched before the first one's record
    reached Redis: the gateway's own queued write counts (the local view), as in memory."""
    index = make_index(kind, ttl_s=None)
    assert index.record_nowait(S, "r1", CHAIN) is True
    assert await index.match(S, CHAIN, ["r1", "r2"]) == {"r1": 4, "r2": 0}


async def test_redis_without_a_local_view_queues_and_matches_remotely(
    make_index: Callable[..., Any],
) -> None:
    index = make_index("redis", ttl_s=None, tuning=RedisTuning(timeout_s=2.0, local_view=False))
    assert index.record_nowait(S, "r1", CHAIN) is True
    assert index.match_local(S, CHAIN, ["r1"]) is None
    await index.flush()
    assert await index.match(S, CHAIN, ["r1"]) == {"r1": 4}


async def test_stats_now_is_the_memory_backends_alone(
    kind: str, make_index: Callable[..., Any]
) -> None:
    index = make_index(kind, ttl_s=None)
    await index.record(S, "r1", CHAIN)
    st = index.stats_now()
    if kind == "memory":
        assert isinstance(st, IndexStats) and st.blocks_per_replica == {"r1": 4}
    else:
        assert st is None  # its stats need round trips: `await stats()`
        assert (await index.stats()).blocks_per_replica == {"r1": 4}


async def test_set_capacity_applies_on_both(kind: str, make_index: Callable[..., Any]) -> None:
    index = make_index(kind, ttl_s=None)
    index.set_capacity("r1", 2)
    await index.record(S, "r1", CHAIN)
    assert await index.match(S, CHAIN, ["r1"]) == {"r1": 2}


async def test_set_precise_shortens_routed_entries_on_both(
    kind: str, make_index: Callable[..., Any]
) -> None:
    clock = FakeClock()
    index = make_index(kind, ttl_s=None, clock=clock)
    index.set_precise("r1")
    await index.record(S, "r1", CHAIN)
    await index.record(S, "r2", CHAIN)
    clock.advance(DEFAULT_ROUTED_TTL_S + 1)
    # r1: a guess until the engine reports; r2 is not precise (no TTL)
    assert await index.match(S, CHAIN, ["r1", "r2"]) == {"r1": 0, "r2": 4}
