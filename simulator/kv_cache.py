"""A paged KV cache with prefix caching: fixed-size blocks, chained block hashes, LRU eviction.

Only unreferenced blocks sit in the free queue, so a block in use is never evicted.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from itertools import islice, takewhile
from typing import TYPE_CHECKING, Any

import xxhash

if TYPE_CHECKING:
    from simulator.tiers import Tiers

_xxh64 = xxhash.xxh3_64_intdigest


def salt_seed(cache_salt: str | None) -> int:
    """The parent hash of a chain's first block (0, or derived from a `cache_salt`)."""
    return 0 if not cache_salt else _xxh64(cache_salt.encode("utf-8"))


def block_hashes(tokens: Sequence[int], block_size: int, *, parent: int = 0,
                 start_block: int = 0, end_block: int | None = None) -> list[int]:
    """Chained hashes of the full blocks `start_block..end_block` of `tokens`.

    h_i = xxh3_64(tokens of block i as little-endian int64, seed=h_{i-1}); h_{-1} = `parent`
    (0 unless a cache salt is used). Equal hashes mean equal prefixes, as in vLLM.
    """
    n_full = len(tokens) // block_size
    end = n_full if end_block is None else min(end_block, n_full)
    if end <= start_block:
        return []
    raw = array("q", tokens[start_block * block_size:end * block_size]).tobytes()
    step = block_size * 8
    out: list[int] = []
    append, h = out.append, parent
    for off in range(0, len(raw), step):
        h = _xxh64(raw[off:off + step], h)  # the second argument is the seed
        append(h)
    return out


class PromptHasher:
    """Chained prompt hashes, memoized for the last prompts seen (by object identity).

    The discrete-event mode hashes a prompt once and shares the result between the router's
    peeks and the engine; prompts must not be mutated while in use.
    """

    def __init__(self, block_size: int, size: int = 256) -> None:
        self.block_size = block_size
        self.size = size
        self._memo: OrderedDict[tuple[int, int], tuple[Sequence[int], int, list[int]]] = \
            OrderedDict()

    def __call__(self, tokens: Sequence[int], parent: int = 0) -> list[int]:
        key = (id(tokens), parent)
        hit = self._memo.get(key)
        if hit is not None and hit[0] is tokens and hit[1] == len(tokens):
            return hit[2]
        hashes = block_hashes(tokens, self.block_size, parent=parent)
        self._memo[key] = (tokens, len(tokens), hashes)  # holding `tokens` pins its id
        if len(self._memo) > self.size:
            self._memo.popitem(last=False)
        return hashes


class PrefixCache:
    """`num_blocks` physical blocks; a hash table of full, computed blocks; an LRU free queue.

    A block's reference count is the number of running sequences holding it. Blocks with no
    reference wait in `free` (oldest first); the ones that carry a hash are still cached and
    can be reused by a later request until allocation takes them (eviction).
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enabled = enable_prefix_caching
        self.ref = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.table: dict[int, int] = {}  # block hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.evictions = 0
        # KV events, when a publisher listens: ("stored", hashes, parent | None, token ids),
        # ("removed", hash), ("cleared",), in the order they happen; the publisher drains it.
        self.events: list[tuple[Any, ...]] | None = None
        # lower tiers (simulator/tiers.py): evictions spill there, prefixes found there load
        self.tiers: Tiers | None = None

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running sequences (vLLM's kv_cache_usage_perc)."""
        return 1.0 - len(self.free) / self.num_blocks

    @property
    def num_cached(self) -> int:
        return len(self.table)

    def longest_prefix(self, hashes: Sequence[int], limit: int | None = None) -> int:
        """How many leading blocks of the chain `hashes` are cached (at most `limit`)."""
        if not self.enabled:
            return 0
        table = self.table
        n = len(hashes) if limit is None else min(limit, len(hashes))
        # the leading run of cached blocks, counted by loops in C (the DES asks on every step)
        i = len(list(takewhile(table.__contains__, islice(hashes, n))))
        if self.tiers is not None:  # the run goes on through blocks a lower tier can load
            where = self.tiers.where
            while i < n and (hashes[i] in table or where(hashes[i]) is not None):
                i += 1
        return i

    def cached_blocks(self, hashes: Sequence[int]) -> list[int]:
        """The GPU blocks of a prefix `longest_prefix` found; blocks on a lower tier are loaded
        into fresh GPU blocks first (fewer returned when the GPU has no free block for them)."""
        if self.tiers is None:
            return [self.table[h] for h in hashes]
        table, out, loaded = self.table, [], []
        for h in hashes:
            b = table.get(h)
            if b is None:
                got = self.allocate(1)
                if got is None:
                    break
                b = got[0]
                self.register(b, h)
                loaded.append(h)
                if self.events is not None:
                    self.events.append(("promoted", h))
            else:
                self.acquire([b])  # pinned: loading the rest must not evict it
            out.append(b)
        self.release(out)
        self.tiers.load(loaded)
        return out

    def count_free_among(self, blocks: Iterable[int]) -> int:
        return list(map(self.ref.__getitem__, blocks)).count(0)

    def acquire(self, blocks: Iterable[int]) -> None:
        """Take a reference on cached blocks (a prefix hit); they leave the free queue."""
        ref, free = self.ref, self.free
        for b in blocks:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        """`n` fresh blocks from the head of the free queue (evicting their hashes), or None."""
        if n > len(self.free):
            return None
        out: list[int] = []
        free, ref, hash_of, table = self.free, self.ref, self.hash_of, self.table
        for _ in range(n):
            b, _ = free.popitem(last=False)
            h = hash_of[b]
            if h is not None:
                if table.get(h) == b:
                    del table[h]
                    if self.tiers is not None:  # stored below before it leaves the GPU
                        self.tiers.spill(h, self.events)
                    if self.events is not None:
                        self.events.append(("removed", h))
                hash_of[b] = None
                self.evictions += 1
            ref[b] = 1
            out.append(b)
        return out

    def register(self, block: int, h: int) -> bool:
        """Mark a full, computed block as holding the prefix whose chain ends in `h`; False
        when another block already holds it (this one then caches nothing)."""
        if self.enabled and h not in self.table:
            self.table[h] = block
            self.hash_of[block] = h
            if self.tiers is not None:
                self.tiers.computed(h)
            return True
        return False

    def reset(self) -> int:
        """Forget every cached prefix (vLLM's reset_prefix_cache); returns how many. Blocks in
        use stay with their sequences, and free ones move to the front of the free queue."""
        n = len(self.table)
        free, hash_of = self.free, self.hash_of
        for b in self.table.values():
            hash_of[b] = None
            if b in free:
                free.move_to_end(b, last=False)
        self.table.clear()
        if self.events is not None:
            self.events.append(("cleared",))
        return n

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference per block; freed blocks join the LRU queue.

        Tail blocks are queued first so that a sequence's prefix outlives its suffix, and
        blocks that hold no cached prefix go to the front: they are worth nothing.
        """
        ref, free, hash_of = self.ref, self.free, self.hash_of
        for b in reversed(blocks):
            ref[b] -= 1
            if ref[b] == 0:
                free[b] = None
                if hash_of[b] is None:
                    free.move_to_end(b, last=False)

    def dump(self) -> list[dict[str, int | bool]]:
        """Every cached block: its hash, its id, whether a running sequence holds it."""
        return [{"hash": h, "block": b, "in_use": self.ref[b] > 0} for h, b in self.table.items()]
