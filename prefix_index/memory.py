"""The embedded prefix index: block hash -> bit set of replicas, with per-replica LRU and TTL.

Also the engine-reported blocks of precise mode, kept apart, and one bound over all scopes (a
scope is chosen by the client: a salt never used again must not stay forever). No I/O; the
async methods never await, they only meet the PrefixIndex and EngineEventSink contracts.
"""

from __future__ import annotations

import sys
import time
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import accumulate, repeat, takewhile
from operator import and_
from typing import NamedTuple

from prefix_index.base import EngineEventSink, IndexStats, PrefixIndex
from prefix_index.constants import (
    DEFAULT_CAPACITY_BLOCKS,
    DEFAULT_ENGINE_CAPACITY_BLOCKS,
    DEFAULT_MAX_BLOCKS,
    DEFAULT_ROUTED_TTL_S,
    SCOPE_COST_BLOCKS,
)

_NEVER = 0  # expiry value of an entry without TTL
_INT_BYTES = 36  # a 64-bit hash as a Python int
_SWEEP_SCOPES = 8  # idle scopes a write may free: more than the one scope a write can add


def _left(expiries: Iterable[int], now: int) -> list[int]:
    """Milliseconds left of each expiry: -1 for none, 0 once expired."""
    return [-1 if e == _NEVER else max(0, e - now) for e in expiries]


class RoutedEntries(NamedTuple):
    """One replica's routed blocks in one scope, as a snapshot keeps them (see persist.py)."""

    scope: str
    replica: str
    hashes: list[int]  # oldest first
    left_ms: list[int]  # ms each has left; -1: no TTL
    holes: list[int]
    holes_left_ms: list[int]


class _Scope:
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


class MemoryIndex(PrefixIndex, EngineEventSink):
    """An in-process PrefixIndex.

    `capacity_blocks` bounds what one replica holds in one scope; `ttl_s` (None: no TTL) ages
    out blocks not recorded again; `clock` returns seconds (tests pass a fake one). Expiry is
    kept in whole milliseconds, like the Redis backend, so both answer alike.

    `max_blocks` bounds the whole index: entries over all scopes and replicas, plus
    SCOPE_COST_BLOCKS per scope. Scopes are kept in the order they were last recorded; past
    the bound the least recent scope loses its entries first (each replica its oldest, in
    proportion to what it holds), so the scope just recorded keeps its chain unless it alone
    exceeds the bound. With a TTL, each write also frees a few scopes idle for longer than it:
    a scope nobody asks for again goes without being touched.

    Precise mode (EngineEventSink): for a replica marked with `set_precise`, routed entries
    live `routed_ttl_s` (or `ttl_s` if shorter); engine-reported entries have no TTL and are
    capped at `engine_capacity_blocks` per replica and scope, oldest first.
    """

    def __init__(
        self,
        capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
        ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        routed_ttl_s: float = DEFAULT_ROUTED_TTL_S,
        engine_capacity_blocks: int = DEFAULT_ENGINE_CAPACITY_BLOCKS,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
    ) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        if max_blocks <= SCOPE_COST_BLOCKS:
            raise ValueError(f"max_blocks must be > {SCOPE_COST_BLOCKS}, got {max_blocks}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive or None, got {ttl_s}")
        if routed_ttl_s <= 0:
            raise ValueError(f"routed_ttl_s must be positive, got {routed_ttl_s}")
        if engine_capacity_blocks < 1:
            raise ValueError(f"engine_capacity_blocks must be >= 1, got {engine_capacity_blocks}")
        routed_ms = max(1, round(routed_ttl_s * 1000))
        ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self._routed_ttl_ms = routed_ms if ttl_ms is None else min(routed_ms, ttl_ms)
        self._engine_capacity = engine_capacity_blocks
        self._precise: set[str] = set()
        self.engine_trimmed = 0
        self._default_capacity = capacity_blocks
        self._capacity: dict[str, int] = {}
        self._ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self._clock = clock
        self._max_blocks = max_blocks
        self._entries = 0  # the sum of every scope's size
        self.bound_evicted = 0
        self._scopes: OrderedDict[str, _Scope] = OrderedDict()  # least recently recorded first
        self._slots: dict[str, int] = {}  # replica -> bit position
        self._names: list[str] = []  # bit position -> replica ("" while the slot is free)
        self._free: list[int] = []

    # -- the contract -------------------------------------------------------------------------

    async def match(
        self, scope: str, hashes: Sequence[int], replicas: Sequence[str]
    ) -> dict[str, int]:
        return self.match_now(scope, hashes, replicas)

    async def record(self, scope: str, replica: str, hashes: Sequence[int]) -> None:
        self.record_now(scope, replica, hashes)

    async def evict(self, scope: str, replica: str, hashes: Sequence[int]) -> None:
        self.evict_now(scope, replica, hashes)

    async def forget(self, replica: str) -> None:
        self.forget_now(replica)

    async def record_engine(self, scope: str, replica: str, hashes: Sequence[int]) -> None:
        self.record_engine_now(scope, replica, hashes)

    async def evict_engine(self, scope: str, replica: str, hashes: Sequence[int]) -> None:
        self.evict_engine_now(scope, replica, hashes)

    async def aclose(self) -> None:
        return None

    async def stats(self) -> IndexStats:
        return self.stats_now()

    # -- the same, synchronous (for callers that are not coroutines) --------------------------

    def record_nowait(self, scope: str, replica: str, hashes: Sequence[int]) -> bool:
        """`record` without awaiting (the router's write at dispatch): done, so True."""
        self.record_now(scope, replica, hashes)
        return True

    def match_local(
        self, scope: str, hashes: Sequence[int], replicas: Sequence[str]
    ) -> dict[str, int]:
        """`match` without awaiting (the router re-checks a match that dispatches overtook)."""
        return self.match_now(scope, hashes, replicas)

    def match_now(
        self, scope: str, hashes: Sequence[int], replicas: Sequence[str]
    ) -> dict[str, int]:
        """For each replica, how many leading blocks of the chain it holds.

        What a replica holds is prefix-closed: a record writes a whole chain from block 0, and
        LRU and TTL take leaves before the prefixes they hang from. So a binary search finds
        each replica's depth; replicas that share a depth share the probes (one dict lookup
        and a bit mask per probe). Blocks cut by `evict` are the one exception: a replica with
        such holes gets its depth clipped at the first live hole of the chain.
        """
        result = dict.fromkeys(replicas, 0)
        st = self._scopes.get(scope)
        n = len(hashes)
        if st is None or not n or not replicas:
            return result
        self._purge(st, self._now_ms())
        if not st.size:
            del self._scopes[scope]
            return result
        slots = self._slots
        alive = 0
        for name in replicas:
            slot = slots.get(name)
            if slot is not None:
                alive |= 1 << slot
        if st.table:
            self._match_routed(st, hashes, alive, result)
        if st.etable:
            self._match_engine(st, hashes, alive, result)
        return result

    def _match_routed(
        self, st: _Scope, hashes: Sequence[int], alive: int, result: dict[str, int]
    ) -> None:
        n = len(hashes)
        get = st.table.get
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
        names = self._names
        for group, depth in found:
            while group:
                low = group & -group
                result[names[low.bit_length() - 1]] = depth
                group ^= low
        if st.holes:
            self._clip_at_holes(st, hashes, result)

    def _match_engine(
        self, st: _Scope, hashes: Sequence[int], alive: int, result: dict[str, int]
    ) -> None:
        """Raise each replica's depth to its engine-reported run.

        `runs[k]` is the set of replicas holding blocks 0..k-1 (an AND over the chain that
        stops at the first empty set, all in C); sets only shrink along it, so the integers
        never grow, and a bisection per replica finds where its bit drops out.
        """
        runs = list(takewhile(bool, accumulate(map(st.etable.get, hashes, repeat(0)), and_,
                                               initial=alive)))  # fmt: skip
        if len(runs) < 2:
            return
        names = self._names
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

    def record_now(self, scope: str, replica: str, hashes: Sequence[int]) -> None:
        """The replica now holds this chain; its blocks become its most recently used."""
        if not hashes:
            return
        now = self._now_ms()
        if replica in self._precise:
            expiry = now + self._routed_ttl_ms
        else:
            expiry = _NEVER if self._ttl_ms is None else now + self._ttl_ms
        st = self._use(scope, now)
        bit = 1 << self._slot(replica)
        lru = st.lru.get(replica)
        if lru is None:
            lru = st.lru[replica] = OrderedDict()
        before = len(lru)
        table = st.table
        move = lru.move_to_end
        for h in reversed(hashes):  # leaf first, root last: the root is the most recent
            held = table.get(h, 0)
            if held & bit:
                move(h)
            else:
                table[h] = held | bit
            lru[h] = expiry
        holes = st.holes.get(replica)
        if holes:
            for h in hashes:
                holes.pop(h, None)
            if not holes:
                del st.holes[replica]
        self._grow(st, len(lru) - before)
        self._trim(st, replica, lru, bit)
        if lru and expiry != _NEVER:
            st.next_expiry = min(st.next_expiry, next(iter(lru.values())))
        self._settle(scope, st)

    def routed_entries(self) -> Iterator[RoutedEntries]:
        """Every (scope, replica)'s routed blocks, least recent scope and block first, with the
        milliseconds each has left (-1: no TTL); its live holes the same way. Engine-reported
        blocks are left out: the engine's KV events replay them. For `prefix_index.persist`."""
        now = self._now_ms()
        for scope, st in self._scopes.items():
            for replica, lru in st.lru.items():
                holes = st.holes.get(replica, {})
                yield RoutedEntries(
                    scope, replica, list(lru), _left(lru.values(), now), list(holes),
                    _left(holes.values(), now),
                )  # fmt: skip

    def restore(self, entries: RoutedEntries) -> int:
        """Put back what `routed_entries` gave (expired ones dropped, TTLs clipped to this
        index's); returns the blocks restored. Call in the order they were given."""
        now = self._now_ms()
        ttl = self._ttl_ms

        def expiry(left: int) -> int | None:
            if left < 0:
                return _NEVER if ttl is None else now + ttl
            if left == 0:
                return None
            return now + left if ttl is None else now + min(left, ttl)

        kept = [(h, e) for h, left in zip(entries.hashes, entries.left_ms, strict=True)
                if (e := expiry(left)) is not None]  # fmt: skip
        if not kept:
            return 0
        st = self._use(entries.scope, now)
        bit = 1 << self._slot(entries.replica)
        lru = st.lru.setdefault(entries.replica, OrderedDict())
        before = len(lru)
        table = st.table
        for h, e in kept:
            table[h] = table.get(h, 0) | bit
            lru[h] = e
            lru.move_to_end(h)
        holes = {h: e for h, left in zip(entries.holes, entries.holes_left_ms, strict=True)
                 if (e := expiry(left)) is not None and h not in lru}  # fmt: skip
        if holes:
            st.holes.setdefault(entries.replica, {}).update(holes)
        self._grow(st, len(lru) - before)
        self._trim(st, entries.replica, lru, bit)
        first = next(iter(lru.values()), _NEVER)
        if first != _NEVER:
            st.next_expiry = min(st.next_expiry, first)
        self._settle(entries.scope, st)
        return len(kept)

    def evict_now(self, scope: str, replica: str, hashes: Sequence[int]) -> None:
        """The replica no longer holds these blocks (a match stops at the first one)."""
        st = self._scopes.get(scope)
        slot = self._slots.get(replica)
        if st is None or slot is None:
            return
        lru = st.lru.get(replica)
        if lru is None:
            return
        now = self._now_ms()
        bit = 1 << slot
        holes = st.holes.setdefault(replica, {})
        before = len(lru)
        for h in hashes:
            expiry = lru.pop(h, None)
            if expiry is not None:
                self._clear(st.table, h, bit)
                if expiry == _NEVER or expiry > now:
                    holes[h] = expiry
        self._grow(st, len(lru) - before)
        for h in [h for h, e in holes.items() if e != _NEVER and e <= now]:
            del holes[h]
        if not holes:
            del st.holes[replica]
        if not lru:
            self._drop_replica(st, replica)
        self._drop_if_empty(scope, st)

    def forget_now(self, replica: str) -> None:
        """Drop everything the replica holds, in every scope (it restarted or left)."""
        slot = self._slots.pop(replica, None)
        if slot is None:
            return
        bit = 1 << slot
        for st in self._scopes.values():
            lru = st.lru.get(replica)
            if lru:
                self._grow(st, -len(lru))
                for h in lru:
                    self._clear(st.table, h, bit)
            self._drop_replica(st, replica)
            held = st.eheld.pop(replica, None)
            if held:
                self._grow(st, -len(held))
                for h in held:
                    self._clear(st.etable, h, bit)
        self._names[slot] = ""
        self._free.append(slot)
        self._drop_empty_scopes()

    def record_engine_now(self, scope: str, replica: str, hashes: Sequence[int]) -> None:
        """The engine reported these blocks stored (any part of a chain, in any order)."""
        if not hashes:
            return
        st = self._use(scope, self._now_ms())
        bit = 1 << self._slot(replica)
        held = st.eheld.get(replica)
        if held is None:
            held = st.eheld[replica] = OrderedDict()
        before = len(held)
        table = st.etable
        for h in hashes:
            if h in held:
                held.move_to_end(h)
            else:
                held[h] = None
                table[h] = table.get(h, 0) | bit
        over = len(held) - self._engine_capacity
        if over > 0:
            self.engine_trimmed += over
            for _ in range(over):
                h, _none = held.popitem(last=False)
                self._clear(table, h, bit)
        self._grow(st, len(held) - before)
        self._settle(scope, st)

    def evict_engine_now(self, scope: str, replica: str, hashes: Sequence[int]) -> None:
        """The engine reported these blocks evicted. A routed guess for them goes too: the
        engine's word is newer than the routing decision it was recorded for."""
        st = self._scopes.get(scope)
        slot = self._slots.get(replica)
        if st is None or slot is None:
            return
        held = st.eheld.get(replica)
        if held:
            bit = 1 << slot
            before = len(held)
            for h in hashes:
                if h in held:
                    del held[h]
                    self._clear(st.etable, h, bit)
            self._grow(st, len(held) - before)
            if not held:
                del st.eheld[replica]
        if replica in st.lru:
            self.evict_now(scope, replica, hashes)
        self._drop_if_empty(scope, st)

    def set_precise(self, replica: str, precise: bool = True) -> None:
        """Mark a replica whose engine reports its blocks: from now on its routed entries live
        `routed_ttl_s`, and the ones it has are cut to that. Kept across `forget`."""
        if not precise:
            self._precise.discard(replica)
            return
        if replica in self._precise:
            return
        self._precise.add(replica)
        cap = self._now_ms() + self._routed_ttl_ms
        for st in self._scopes.values():
            lru = st.lru.get(replica)
            if lru:
                for h, expiry in lru.items():  # expiries stay in LRU order: min with a constant
                    if expiry == _NEVER or expiry > cap:
                        lru[h] = cap
                st.next_expiry = min(st.next_expiry, next(iter(lru.values())))
            holes = st.holes.get(replica)
            if holes:
                for h, expiry in holes.items():
                    if expiry == _NEVER or expiry > cap:
                        holes[h] = cap

    def set_capacity(self, replica: str, blocks: int) -> None:
        """Capacity of one replica in blocks (per scope); trims it at once if it shrank."""
        if blocks < 0:
            raise ValueError(f"capacity must be >= 0, got {blocks}")
        self._capacity[replica] = blocks
        slot = self._slots.get(replica)
        if slot is None:
            return
        for st in self._scopes.values():
            lru = st.lru.get(replica)
            if lru is not None:
                self._trim(st, replica, lru, 1 << slot)
        self._drop_empty_scopes()

    def stats_now(self) -> IndexStats:
        per_replica: dict[str, int] = {}
        per_replica_engine: dict[str, int] = {}
        distinct = 0
        size = sys.getsizeof(self._scopes)
        for scope, st in self._scopes.items():
            distinct += len(st.table)
            size += sys.getsizeof(scope) + sys.getsizeof(st) + sys.getsizeof(st.table)
            size += sys.getsizeof(st.lru) + sys.getsizeof(st.holes) + sys.getsizeof(st.etable)
            size += sys.getsizeof(st.eheld) + len(st.etable) * _INT_BYTES
            for holes in st.holes.values():
                size += sys.getsizeof(holes)
            for replica, lru in st.lru.items():
                per_replica[replica] = per_replica.get(replica, 0) + len(lru)
                size += sys.getsizeof(lru)
            for replica, held in st.eheld.items():
                per_replica_engine[replica] = per_replica_engine.get(replica, 0) + len(held)
                size += sys.getsizeof(held)
        size += distinct * _INT_BYTES
        return IndexStats(
            backend="memory",
            blocks_per_replica=per_replica,
            entries=sum(per_replica.values()),
            distinct_blocks=distinct,
            bytes_estimate=size,
            engine_blocks_per_replica=per_replica_engine,
            engine_entries=sum(per_replica_engine.values()),
            engine_trimmed=self.engine_trimmed,
            scopes=len(self._scopes),
            bound_evicted=self.bound_evicted,
        )

    # -- internals ----------------------------------------------------------------------------

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def _slot(self, replica: str) -> int:
        slot = self._slots.get(replica)
        if slot is None:
            if self._free:
                slot = self._free.pop()
                self._names[slot] = replica
            else:
                slot = len(self._names)
                self._names.append(replica)
            self._slots[replica] = slot
        return slot

    def _use(self, scope: str, now: int) -> _Scope:
        """The scope a write goes to, now the most recently recorded (after freeing a few
        idle scopes, and the scope's own expired entries)."""
        self._sweep(now)
        scopes = self._scopes
        st = scopes.get(scope)
        if st is None:
            st = scopes[scope] = _Scope()
        else:
            self._purge(st, now)
            scopes.move_to_end(scope)
        st.used = now
        return st

    def _settle(self, scope: str, st: _Scope) -> None:
        """After a write: drop the scope if it ended empty, then enforce the global bound."""
        self._drop_if_empty(scope, st)
        if self._entries + SCOPE_COST_BLOCKS * len(self._scopes) > self._max_blocks:
            self._enforce_bound()

    def _enforce_bound(self) -> None:
        """Take entries from the least recently recorded scopes until the index fits: whole
        scopes while one's weight (entries + its cost) fits in the excess, then part of one."""
        scopes = self._scopes
        over = self._entries + SCOPE_COST_BLOCKS * len(scopes) - self._max_blocks
        while over > 0 and scopes:
            scope, st = next(iter(scopes.items()))
            taken = st.size if st.size + SCOPE_COST_BLOCKS <= over else min(over, st.size)
            if taken == st.size:
                del scopes[scope]
                self._entries -= taken
                over -= taken + SCOPE_COST_BLOCKS
            else:
                self._shed(st, taken)
                over -= taken
            self.bound_evicted += taken

    def _shed(self, st: _Scope, count: int) -> None:
        """Drop `count` (< size) of the scope's entries: routed ones first, each replica losing
        its oldest in proportion to what it holds (replicas in name order, as in Redis), then
        engine-reported ones the same way."""
        left = count
        routed = sum(map(len, st.lru.values()))
        want = min(left, routed)
        for replica, lru in sorted(st.lru.items()):
            if not left:
                return
            take = min(len(lru), -(-want * len(lru) // routed), left)
            self._pop_oldest(st, replica, lru, take)
            left -= take
        engine = sum(map(len, st.eheld.values()))
        want = min(left, engine)
        for replica, held in sorted(st.eheld.items()):
            if not left:
                return
            take = min(len(held), -(-want * len(held) // engine), left)
            bit = 1 << self._slots[replica]
            for _ in range(take):
                h, _none = held.popitem(last=False)
                self._clear(st.etable, h, bit)
            if not held:
                del st.eheld[replica]
            self._grow(st, -take)
            left -= take

    def _sweep(self, now: int) -> None:
        """Free scopes not recorded for longer than the TTL, a few per call, oldest first.

        Every routed entry (and hole) of such a scope has expired: an entry expires at most
        `ttl` after its record, and the scope's last record is older than that. Engine-reported
        entries have no TTL; a scope that still holds some goes to the back of the line.
        """
        ttl = self._ttl_ms
        scopes = self._scopes
        if ttl is None:
            return
        for _ in range(_SWEEP_SCOPES):
            if not scopes:
                return
            scope, st = next(iter(scopes.items()))
            if st.used + ttl > now:
                return
            self._grow(st, -sum(map(len, st.lru.values())))
            st.table.clear()
            st.lru.clear()
            st.holes.clear()
            st.next_expiry = sys.maxsize
            if st.size:
                st.used = now
                scopes.move_to_end(scope)
            else:
                del scopes[scope]

    def _grow(self, st: _Scope, entries: int) -> None:
        st.size += entries
        self._entries += entries

    def _pop_oldest(self, st: _Scope, replica: str, lru: OrderedDict[int, int], count: int) -> None:
        """Drop the replica's `count` least recent entries of the scope (leaves first)."""
        bit = 1 << self._slots[replica]
        for _ in range(count):
            h, _expiry = lru.popitem(last=False)
            self._clear(st.table, h, bit)
        self._grow(st, -count)
        if not lru:
            self._drop_replica(st, replica)

    def _trim(self, st: _Scope, replica: str, lru: OrderedDict[int, int], bit: int) -> None:
        over = len(lru) - self._capacity.get(replica, self._default_capacity)
        self._pop_oldest(st, replica, lru, max(over, 0))

    def _purge(self, st: _Scope, now: int) -> None:
        """Drop expired entries. Each LRU is in expiry order, so they sit at its head."""
        if now < st.next_expiry:
            return
        table = st.table
        next_expiry = sys.maxsize
        for replica in list(st.lru):
            lru = st.lru[replica]
            bit = 1 << self._slots[replica]
            before = len(lru)
            while lru:
                h, expiry = next(iter(lru.items()))
                if expiry == _NEVER or expiry > now:
                    if expiry != _NEVER:
                        next_expiry = min(next_expiry, expiry)
                    break
                del lru[h]
                self._clear(table, h, bit)
            self._grow(st, len(lru) - before)
            if not lru:
                self._drop_replica(st, replica)
        st.next_expiry = next_expiry

    def _clip_at_holes(self, st: _Scope, hashes: Sequence[int], result: dict[str, int]) -> None:
        """Clip each holey replica's depth at the first live hole of the chain.

        A live hole is the only way a block below can be held while this one is not: the
        blocks under an evicted block were touched no later than it, so they expire no later
        than the hole does (and recording them again records the hole's block too).
        """
        now = self._now_ms()
        for replica, depth in result.items():
            holes = st.holes.get(replica) if depth else None
            if not holes:
                continue
            for i in range(depth):
                expiry = holes.get(hashes[i])
                if expiry is not None and (expiry == _NEVER or expiry > now):
                    result[replica] = i
                    break

    @staticmethod
    def _drop_replica(st: _Scope, replica: str) -> None:
        """The replica holds nothing in this scope any more (holes included)."""
        st.lru.pop(replica, None)
        st.holes.pop(replica, None)

    @staticmethod
    def _clear(table: dict[int, int], h: int, bit: int) -> None:
        held = table.get(h, 0) & ~bit
        if held:
            table[h] = held
        else:
            table.pop(h, None)

    def _drop_if_empty(self, scope: str, st: _Scope) -> None:
        if not st.size and self._scopes.get(scope) is st:
            del self._scopes[scope]

    def _drop_empty_scopes(self) -> None:
        for scope in [s for s, st in self._scopes.items() if not st.size]:
            del self._scopes[scope]
