"""The paged prefix cache: chained hashes, hits, LRU eviction, blocks in use never evicted."""

from __future__ import annotations

from simulator.kv_cache import PrefixCache, PromptHasher, block_hashes, salt_seed

BS = 4


def fill(cache: PrefixCache, tokens: list[int]) -> list[int]:
    """Allocate and register the full blocks of `tokens` like a finished prefill would."""
    hashes = block_hashes(tokens, BS)
    blocks = cache.allocate(len(hashes))
    assert blocks is not None
    for b, h in zip(blocks, hashes, strict=True):
        cache.register(b, h)
    return blocks


def test_hashes_chain_over_the_prefix() -> None:
    a = block_hashes(list(range(12)), BS)
    b = block_hashes(list(range(8)) + [99, 99, 99, 99], BS)
    c = block_hashes([7] + list(range(1, 12)), BS)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert all(x != y for x, y in zip(a, c, strict=True))  # a change poisons every later block
    assert block_hashes(list(range(11)), BS) == a[:2]  # only full blocks
    assert block_hashes(list(range(12)), BS, parent=salt_seed("tenant-a")) != a
    assert block_hashes(list(range(12)), BS) == a  # deterministic


def test_longest_prefix_hit_and_release_keeps_blocks_cached() -> None:
    cache = PrefixCache(8, BS)
    tokens = list(range(16))
    blocks = fill(cache, tokens)
    assert cache.usage == 0.5
    cache.release(blocks)
    assert cache.usage == 0.0 and cache.num_cached == 4
    other = list(range(8)) + [50, 51, 52, 53, 54]
    assert cache.longest_prefix(block_hashes(other, BS)) == 2
    assert cache.longest_prefix(block_hashes(tokens, BS), limit=3) == 3
    hit = cache.cached_blocks(block_hashes(other, BS)[:2])
    cache.acquire(hit)
    assert hit == blocks[:2] and cache.usage == 2 / 8


def test_lru_eviction_takes_the_least_recently_freed_blocks_first() -> None:
    cache = PrefixCache(6, BS)
    old = fill(cache, list(range(100, 108)))  # 2 blocks
    new = fill(cache, list(range(200, 208)))  # 2 blocks
    cache.release(old)
    cache.release(new)
    got = cache.allocate(4)  # 2 never-used blocks first, then the oldest cached ones
    assert got is not None
    assert cache.evictions == 2
    assert cache.longest_prefix(block_hashes(list(range(100, 108)), BS)) == 0
    assert cache.longest_prefix(block_hashes(list(range(200, 208)), BS)) == 2


def test_a_freed_sequence_loses_its_tail_before_its_head() -> None:
    cache = PrefixCache(3, BS)
    blocks = fill(cache, list(range(12)))
    cache.release(blocks)
    assert cache.allocate(1) is not None
    assert cache.longest_prefix(block_hashes(list(range(12)), BS)) == 2


def test_blocks_in_use_are_never_evicted() -> None:
    cache = PrefixCache(4, BS)
    held = fill(cache, list(range(8)))  # held by a running sequence
    freed = fill(cache, list(range(50, 58)))
    cache.release(freed)
    assert cache.allocate(3) is None  # only 2 free blocks: refuse rather than evict `held`
    assert cache.allocate(2) is not None
    assert cache.longest_prefix(block_hashes(list(range(8)), BS)) == 2
    assert cache.num_free == 0 and cache.allocate(1) is None
    assert [cache.ref[b] for b in held] == [1, 1]


def test_shared_blocks_count_references() -> None:
    cache = PrefixCache(4, BS)
    blocks = fill(cache, list(range(8)))
    cache.acquire(blocks)  # a second sequence shares the prefix
    cache.release(blocks)
    assert cache.num_free == 2  # still held once
    cache.release(blocks)
    assert cache.num_free == 4 and cache.num_cached == 2


def test_disabled_prefix_caching_never_hits() -> None:
    cache = PrefixCache(4, BS, enable_prefix_caching=False)
    blocks = fill(cache, list(range(8)))
    cache.release(blocks)
    assert cache.num_cached == 0
    assert cache.longest_prefix(block_hashes(list(range(8)), BS)) == 0


def test_prompt_hasher_memoizes_by_identity() -> None:
    hasher = PromptHasher(BS)
    tokens = list(range(40))
    first = hasher(tokens)
    assert hasher(tokens) is first
    assert hasher(list(range(40))) == first
    assert hasher(tokens, salt_seed("x")) != first
