"""One scope of the memory index: who holds each block, each replica's LRU, and the matches.

Pure data and the per-scope searches; which replica owns which bit, the bounds and the clock
belong to `prefix_index/_scopes.py` and `prefix_index/memory.py`.
"""

from __future__ import annotations

import sys
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate, repeat, takewhile
from operator import and_
from typing import NamedTuple

NEVER = 0  # expiry value of an entry without TTL


def remaining_ms(expiries: Iterable[int], now: int) -> list[int]:
    """Milliseconds left of each expiry: -1 for none, 0 once expired."""
    return [-1 if e == NEVER else max(0, e - now) for e in expiries]


def clear_bit(table: dict[int, int], h: int, bit: int) -> None:
    """The replica of `bit` no longer holds block `h` in `table`."""
    held = table.get(h, 0) & ~bit
    if held:
        table[h] = held
    else:
        table.pop(h, None)


class RoutedEntries(NamedTuple):
    """One replica's routed blocks in one scope, as a snapshot keeps them (see persist.py)."""

    scope: str
    replica: str
    hashes: list[int]  # oldest first
    left_ms: list[int]  # ms each has left; -1: no TTL
    holes: list[int]
    holes_left_ms: list[int]


class Scope:
    """One scope's blocks: who holds each block, and each replica's blocks in LRU order."""

    __slots__ = ("table", "lru", "holes", "next_expiry", "etable", "eheld", "size", "used")

    def __init__(self) -> None:
        self.table: dict[int, int] = {}  # block hash -> bit set of replica slots
        # replica -> block hash -> expiry ms; oldest first. A record touches a chain leaf
        # first and root last, so a block is always more recent than the blocks below it and
        # LRU eviction (and TTL expiry) takes leaves before the prefixes they hang from.
        self.lru: dict[str, OrderedDict[int, int]] = {}
        # replica -> evicted block -> expiry it had. `evict` may cut a chain above blocks the
        # replica still holds; match stops at such a hole while it could matter (see match).
        self.holes: dict[str, dict[int, int]] = {}
        self.next_expiry = sys.maxsize  # earliest expiry at the head of any LRU (a hint)
        # What the engines reported (precise mode), apart from the routed guesses above: block
        # hash -> bit set, and each replica's blocks in arrival order (for forget and the cap).
        # Not prefix-closed (an engine may evict a block below ones it keeps), so match scans.
        self.etable: dict[int, int] = {}
        self.eheld: dict[str, OrderedDict[int, None]] = {}
        self.size = 0  # entries, routed and engine-reported (the sum of the lengths above)
        self.used = 0  # ms of the last record into the scope (its place in the scope LRU)

    def drop_replica(self, replica: str) -> None:
        """The replica holds nothing in this scope any more (holes included)."""
        self.lru.pop(replica, None)
        self.holes.pop(replica, None)

    def match_routed(
        self,
        hashes: Sequence[int],
        alive: int,
        result: dict[str, int],
        names: list[str],
        now_ms: Callable[[], int],
    ) -> None:
        """Each `alive` replica's depth in the routed blocks: a binary search per group of
        replicas that share a depth (`names`: bit position -> replica)."""
        n = len(hashes)
        get = self.table.get
        held = get(hashes[0], 0) & alive
        if not held:
            return
        found: list[tuple[int, int]] = []  # (replica bits, depth)
        full = get(hashes[n - 1], 0) & held
        if full:
            found.append((full, n))
        # Each entry: these replicas hold block lo-1 and lack block hi; depth is in [lo, hi].
        stack = [(1, n - 1, held & ~full)] if held & ~full else []
        while stack:
            lo, hi, group = stack.pop()
            if lo >= hi:
                found.append((group, lo))
                continue
            mid = (lo + hi) >> 1
            yes = get(hashes[mid], 0) & group
            if yes:
                stack.append((mid + 1, hi, yes))
            if group != yes:
                stack.append((lo, mid, group & ~yes))
        for group, depth in found:
            while group:
                low = group & -group
                result[names[low.bit_length() - 1]] = depth
                group ^= low
        if self.holes:
            self.clip_at_holes(hashes, result, now_ms())

    def match_engine(
        self, hashes: Sequence[int], alive: int, result: dict[str, int], names: list[str]
    ) -> None:
        """Raise each replica's depth to its engine-reported run.

        `runs[k]` is the set of replicas holding blocks 0..k-1 (an AND over the chain that
        stops at the first empty set, all in C); sets only shrink along it, so the integers
        never grow, and a bisection per replica finds where its bit drops out.
        """
        runs = list(takewhile(bool, accumulate(map(self.etable.get, hashes, repeat(0)), and_,
                                               initial=alive)))  # fmt: skip
        if len(runs) < 2:
            return
        end = len(runs)
        group = runs[1]
        while group:
            low = group & -group
            group ^= low

            def lacks(m: int, b: int = low) -> bool:
                return not m & b

            depth = bisect_left(runs, True, 2, end, key=lacks) - 1
            name = names[low.bit_length() - 1]
            if result[name] < depth:
                result[name] = depth

    def clip_at_holes(self, hashes: Sequence[int], result: dict[str, int], now: int) -> None:
        """Clip each holey replica's depth at the first live hole of the chain.

        A live hole is the only way a block below can be held while this one is not: the
        blocks under an evicted block were touched no later than it, so they expire no later
        than the hole does (and recording them again records the hole's block too).
        """
        for replica, depth in result.items():
            holes = self.holes.get(replica) if depth else None
            if not holes:
                continue
            for i in range(depth):
                expiry = holes.get(hashes[i])
                if expiry is not None and (expiry == NEVER or expiry > now):
                    result[replica] = i
                    break
