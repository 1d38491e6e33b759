"""The index is bounded as a whole, not only per scope (issue 22 #2).

A scope (model, cache_salt) is the client's choice: unique salts, or unique model names, must
not grow the index (or Redis) without bound, and a scope nobody uses again must go after the
TTL without being touched. Real chains (ByteChunker over chat-sized prompts), thousands of
scopes, both backends.
"""

from __future__ import annotations

import asyncio
import gc
import random
import time
import tracemalloc
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefix_index import ByteChunker, MemoryIndex, RedisIndex, RedisTuning, scope_key
from prefix_index.constants import SCOPE_COST_BLOCKS
from tests.prefix_index.conftest import REDIS_URL, FakeClock, delete_namespace
from tests.prefix_index.reference import ReferenceIndex

CHUNKER = ByteChunker()
SYSTEM = "You are a careful assistant. Answer in English, cite sources, be brief. " * 8
MEMORY_BYTES_PER_LOAD = 200  # measured ~160 B per entry, ~1.2 KB (8 x 160) per scope
REDIS_BYTES_PER_LOAD = 450  # measured ~300 B per entry (MEMORY USAGE), a scope well under 8x


def request(i: int, salt: str | None = None, model: str = "llama") -> tuple[str, list[int]]:
    """One chat-sized request: a shared system prompt, then a question of its own."""
    scope = scope_key(model, salt=f"user-{i}" if salt is None else salt)
    text = f"{SYSTEM}\nuser: question {i}: " + "explain the KV cache " * 40
    return scope, CHUNKER.hash_text(scope, text)


def load_of(stats: Any) -> int:
    return stats.entries + SCOPE_COST_BLOCKS * stats.scopes


# -- memory backend -----------------------------------------------------------------------------


def test_unique_salts_stay_under_the_bound_in_memory() -> None:
    bound = 20_000
    for i in range(3_000):
        request(i)  # warms the chunker's cache of scope seeds: its memory is not the index's
    gc.collect()
    tracemalloc.start()
    try:
        index = MemoryIndex(max_blocks=bound, ttl_s=None)
        start = tracemalloc.get_traced_memory()[0]
        for i in range(3_000):  # 22 blocks a request: 66,000 entries without the bound
            scope, chain = request(i)
            index.record_now(scope, f"r{i % 4}", chain)
            if i % 500 == 499:
                stats = index.stats_now()
                assert stats.entries <= bound and load_of(stats) <= bound, (i, stats)
        del scope, chain
        gc.collect()
        traced = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    stats = index.stats_now()
    assert stats.entries <= bound
    assert stats.bytes_estimate <= bound * MEMORY_BYTES_PER_LOAD, stats.bytes_estimate
    assert traced <= bound * MEMORY_BYTES_PER_LOAD, traced  # the real memory, not the estimate
    assert stats.bound_evicted > 0
    scope, chain = request(2_999)  # the newest scope keeps its whole chain
    assert index.match_now(scope, chain, ["r3"]) == {"r3": len(chain)}


def test_unique_model_names_stay_under_the_bound_in_memory() -> None:
    bound = 5_000
    index = MemoryIndex(max_blocks=bound, ttl_s=None)
    for i in range(1_000):
        scope, chain = request(i, salt="", model=f"no-such-model-{i}")
        index.record_now(scope, "r0", chain)
    stats = index.stats_now()
    assert stats.entries <= bound and load_of(stats) <= bound
    assert stats.scopes < 1_000


def test_idle_scopes_go_after_the_ttl_without_being_touched() -> None:
    clock = FakeClock()
    index = MemoryIndex(ttl_s=60, clock=clock)
    for i in range(2_000):
        scope, chain = request(i)
        index.record_now(scope, "r0", chain)
    assert index.stats_now().entries > 40_000
    clock.advance(61)
    hot, chain = request(0, salt="hot")
    for _ in range(300):  # traffic to one other scope only: the idle ones are never asked for
        index.record_now(hot, "r1", chain)
        clock.advance(0.01)
    stats = index.stats_now()
    assert stats.entries == len(chain)
    assert stats.scopes == 1
    assert stats.bytes_estimate < 100_000


def test_engine_reported_blocks_outlive_the_sweep_of_routed_ones() -> None:
    clock = FakeClock()
    index = MemoryIndex(ttl_s=10, clock=clock)
    scope, chain = request(1)
    index.record_now(scope, "r0", chain)
    index.record_engine_now(scope, "r1", chain[:5])
    clock.advance(11)
    for i in range(20):
        other, hashes = request(100 + i)
        index.record_now(other, "r0", hashes)
    assert index.match_now(scope, chain, ["r0", "r1"]) == {"r0": 0, "r1": 5}
    assert index.stats_now().engine_entries == 5


def test_the_bound_counts_engine_reported_blocks_too() -> None:
    index = MemoryIndex(max_blocks=100)
    for i in range(20):
        scope, chain = request(i)
        index.record_engine_now(scope, "r0", chain[:10])
    stats = index.stats_now()
    assert stats.engine_entries + SCOPE_COST_BLOCKS * stats.scopes <= 100
    assert index.match_now(scope, chain, ["r0"]) == {"r0": 10}


def test_a_partial_trim_takes_each_replicas_oldest_in_proportion() -> None:
    index = MemoryIndex(max_blocks=2 * SCOPE_COST_BLOCKS + 30)
    old = [1_000 + i for i in range(30)]
    index.record_now("old", "a", old[:20])
    index.record_now("old", "b", old[:10])
    index.record_now("new", "a", [5_000 + i for i in range(20)])  # 20 over: a loses 14, b 6
    assert index.match_now("old", old, ["a", "b"]) == {"a": 6, "b": 4}
    assert index.stats_now().bound_evicted == 20


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 7), st.sampled_from("abc"), st.integers(0, 3), st.integers(0, 14)),
        min_size=1,
        max_size=60,
    ),
    bound=st.integers(SCOPE_COST_BLOCKS + 1, 80),
)
def test_bounded_memory_never_claims_more_than_the_unbounded_model(
    ops: list[tuple[int, str, int, int]], bound: int
) -> None:
    rng = random.Random(11)
    trunks = [[rng.getrandbits(64) for _ in range(14)] for _ in range(4)]
    index = MemoryIndex(max_blocks=bound, ttl_s=None)
    model = ReferenceIndex(capacity=10**9, ttl_s=None)
    for scope_no, replica, trunk, length in ops:
        scope, hashes = f"s{scope_no}", trunks[trunk][:length]
        index.record_now(scope, replica, hashes)
        model.record(0.0, scope, replica, hashes)
        assert load_of(index.stats_now()) <= bound
        unbounded = sum(len(held) for (s, _), held in model.entries.items() if s == scope)
        if unbounded + SCOPE_COST_BLOCKS <= bound:  # the scope fits alone: older ones paid
            assert index.match_now(scope, hashes, [replica]) == {replica: len(hashes)}
    for scope_no in range(8):
        for trunk in trunks:
            got = index.match_now(f"s{scope_no}", trunk, list("abc"))
            want = model.match(0.0, f"s{scope_no}", trunk, list("abc"))
            assert all(got[r] <= want[r] for r in "abc"), (got, want)


# -- redis backend ------------------------------------------------------------------------------


async def namespace_keys(namespace: str) -> list[bytes]:
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        return [k async for k in client.scan_iter(match=f"{namespace}:*", count=1000)]
    finally:
        await client.aclose()


async def redis_footprint(namespace: str) -> tuple[int, int, int]:
    """(keys, LRU entries, bytes by MEMORY USAGE) of one namespace."""
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        keys = [k async for k in client.scan_iter(match=f"{namespace}:*", count=1000)]
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.memory_usage(k, samples=0)
        used = sum(u or 0 for u in await pipe.execute())
        pipe = client.pipeline(transaction=False)
        lrus = [k for k in keys if b"}:l:" in k]
        for k in lrus:
            pipe.zcard(k)
        entries = sum(await pipe.execute())
        return len(keys), entries, used
    finally:
        await client.aclose()


def tuned(**kwargs: Any) -> RedisTuning:
    return RedisTuning(timeout_s=2.0, **kwargs)


async def test_unique_salts_stay_under_the_bound_in_redis(
    make_index: Callable[..., Any], namespace: str
) -> None:
    bound = 5_000
    index = make_index("redis", max_blocks=bound, ttl_s=None)
    for i in range(1_500):  # 33,000 entries without the bound
        scope, chain = request(i)
        index.record_nowait(scope, f"r{i % 3}", chain)
        if i % 100 == 99:
            await index.flush()
    assert await index.flush()
    keys, entries, used = await redis_footprint(namespace)
    assert entries <= bound, entries
    assert keys <= bound, keys
    assert used <= bound * REDIS_BYTES_PER_LOAD, used
    stats = await index.stats()
    assert stats.entries == entries and load_of(stats) <= bound
    assert stats.bound_evicted > 0
    scope, chain = request(1_499)
    assert await index.match(scope, chain, ["r2"]) == {"r2": len(chain)}
    local = index._local.stats_now()  # the gateway's own view is bounded the same way
    assert load_of(local) <= bound


async def test_every_key_the_redis_backend_writes_expires(
    make_index: Callable[..., Any], namespace: str
) -> None:
    index = make_index("redis", ttl_s=1.0)
    for i in range(300):
        scope, chain = request(i)
        index.record_nowait(scope, f"r{i % 2}", chain)
    scope, chain = request(7)
    await index.evict(scope, "r1", chain[3:5])
    assert await index.flush()
    keys = await namespace_keys(namespace)
    assert len(keys) > 300
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.pttl(k)
        ttls = dict(zip(keys, await pipe.execute(), strict=True))
    finally:
        await client.aclose()
    assert all(0 < t <= 1_000 for t in ttls.values()), [k for k, t in ttls.items() if t <= 0]
    await asyncio.sleep(1.2)  # nobody uses these scopes again: they disappear by themselves
    assert await namespace_keys(namespace) == []


async def test_redis_sweeps_scopes_idle_past_the_ttl(
    make_index: Callable[..., Any], namespace: str
) -> None:
    clock = FakeClock(time.time())
    index = make_index("redis", ttl_s=60, clock=clock)
    for i in range(500):
        scope, chain = request(i)
        index.record_nowait(scope, "r0", chain)
    assert await index.flush()
    before, _, _ = await redis_footprint(namespace)
    assert before > 500 * 22
    clock.advance(61)  # the gateways' clock says every entry expired; Redis' own TTL has not
    hot, chain = request(0, salt="hot")
    await index.record(hot, "r1", chain)
    assert await index.flush()
    keys, entries, _ = await redis_footprint(namespace)
    assert entries == len(chain)
    assert keys <= len(chain) + 10, keys  # the hot scope's keys and the bookkeeping
    assert (await index.stats()).scopes == 1


async def test_two_gateways_share_one_bound(namespace: str) -> None:
    bound = 3_000
    gateways = [
        RedisIndex(REDIS_URL, namespace=namespace, local_cache_s=0, tuning=tuned(),
                   max_blocks=bound, ttl_s=None)
        for _ in range(2)
    ]  # fmt: skip
    try:
        for i in range(600):
            scope, chain = request(i)
            gateways[i % 2].record_nowait(scope, "r0", chain)
        for g in gateways:
            assert await g.flush()
        _, entries, _ = await redis_footprint(namespace)
        assert entries <= bound
        stats = await gateways[0].stats()
        assert load_of(stats) <= bound
    finally:
        for g in gateways:
            await g.aclose()
        await delete_namespace(REDIS_URL, namespace)


async def test_evicting_a_whole_scope_removes_it_from_redis(
    make_index: Callable[..., Any], namespace: str
) -> None:
    index = make_index("redis", ttl_s=None)
    scope, chain = request(3)
    await index.record(scope, "r0", chain)
    await index.evict(scope, "r0", chain)  # a failed request takes back what it recorded
    assert await index.flush()
    keys = await namespace_keys(namespace)
    assert not [k for k in keys if b"}:h:" in k or b"}:seq" in k], keys
    assert (await index.stats()).scopes == 0


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
@given(seed=st.integers(0, 2**32 - 1))
def test_memory_and_redis_trim_alike(seed: int) -> None:
    """With writes settled one by one (and no TTL), both backends bound the same way."""
    asyncio.run(_trim_alike(seed))


async def _trim_alike(seed: int) -> None:
    rng = random.Random(seed)
    bound = rng.randint(30, 120)
    trunks = [[rng.getrandbits(64) for _ in range(rng.randint(1, 15))] for _ in range(5)]
    clock = FakeClock()
    namespace = f"kvgwbound-{uuid.uuid4().hex[:12]}"
    memory = MemoryIndex(max_blocks=bound, ttl_s=None, clock=clock)
    shared = RedisIndex(REDIS_URL, namespace=namespace, local_cache_s=0, clock=clock,
                        tuning=tuned(local_view=False), max_blocks=bound, ttl_s=None)  # fmt: skip
    try:
        for step in range(30):
            clock.advance(1)
            scope, replica = f"s{rng.randint(0, 5)}", rng.choice("abc")
            trunk = rng.choice(trunks)
            hashes = trunk[: rng.randint(0, len(trunk))]
            if rng.random() < 0.85:
                memory.record_now(scope, replica, hashes)
                await shared.record(scope, replica, hashes)
            else:
                memory.evict_now(scope, replica, hashes[-2:])
                await shared.evict(scope, replica, hashes[-2:])
            assert await shared.flush()
            for s in (f"s{k}" for k in range(6)):
                for t in trunks:
                    want = memory.match_now(s, t, list("abc"))
                    got = await shared.match(s, t, list("abc"))
                    assert got == want, f"seed={seed} step={step} {s}: {got} != {want}"
        mine, theirs = memory.stats_now(), await shared.stats()
        assert (mine.entries, mine.scopes, mine.bound_evicted) == (
            theirs.entries,
            theirs.scopes,
            theirs.bound_evicted,
        ), f"seed={seed}"
    finally:
        await shared.aclose()
        await delete_namespace(REDIS_URL, namespace)


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_a_bound_set_later_holds_like_one_opened_with(
    make_index: Callable[..., Any], namespace: str, backend: str
) -> None:
    """`set_max_blocks` (what the gateway gives: twice its replicas' KV together, issue 39): the
    index trims to it (the memory one at once, Redis at its next upkeep) and stays under it."""
    index = make_index(backend, ttl_s=None)
    for i in range(600):  # ~13,000 entries
        scope, chain = request(i)
        if not index.record_nowait(scope, f"r{i % 2}", chain):
            await index.record(scope, f"r{i % 2}", chain)
    if backend == "redis":
        await index.flush()
    index.set_max_blocks(3_000)
    if backend == "memory":
        assert load_of(index.stats_now()) <= 3_000
    for i in range(600, 1_200):
        scope, chain = request(i)
        index.record_nowait(scope, f"r{i % 2}", chain)
    if backend == "redis":
        assert await index.flush()
    stats = await index.stats()
    assert load_of(stats) <= 3_000 and stats.bound_evicted > 0
    scope, chain = request(1_199)  # the latest scope is whole
    assert await index.match(scope, chain, ["r1"]) == {"r1": len(chain)}
    with pytest.raises(ValueError, match="max_blocks"):
        index.set_max_blocks(SCOPE_COST_BLOCKS)


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="max_blocks"):
        MemoryIndex(max_blocks=SCOPE_COST_BLOCKS)
    with pytest.raises(ValueError, match="max_blocks"):
        RedisIndex(REDIS_URL, max_blocks=0)
