"""The memory index's scopes under its bounds: replica slots, per-replica capacity, TTL, and
the one bound over all scopes (least recently recorded scope first). No I/O.

`BoundedScopes` is the storage `MemoryIndex` (prefix_index/memory.py) is built on: it keeps
the entry counts right and evicts; the index's contract methods read and write through it.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sized

from prefix_index._scope import NEVER, RoutedEntries, Scope, clear_bit, remaining_ms
from prefix_index.constants import SCOPE_COST_BLOCKS

_SWEEP_SCOPES = 8  # idle scopes a write may free: more than the one scope a write can add


def check_bounds(
    capacity_blocks: int, max_blocks: int, ttl_s: float | None, routed_ttl_s: float
) -> None:
    """The bounds both backends take, as they take them (a ValueError naming the bad one)."""
    if capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    if max_blocks <= SCOPE_COST_BLOCKS:
        raise ValueError(f"max_blocks must be > {SCOPE_COST_BLOCKS}, got {max_blocks}")
    if ttl_s is not None and ttl_s <= 0:
        raise ValueError(f"ttl_s must be positive or None, got {ttl_s}")
    if routed_ttl_s <= 0:
        raise ValueError(f"routed_ttl_s must be positive, got {routed_ttl_s}")


class BoundedScopes:
    """Scopes in the order they were last recorded, each replica with a bit slot, and the
    bounds: `capacity_blocks` per replica and scope, `ttl_ms` (None: none), `max_blocks`
    over the entries of all scopes plus SCOPE_COST_BLOCKS per scope."""

    def __init__(
        self,
        capacity_blocks: int,
        ttl_ms: int | None,
        clock: Callable[[], float],
        max_blocks: int,
    ) -> None:
        self._default_capacity = capacity_blocks
        self._capacity: dict[str, int] = {}
        self._ttl_ms = ttl_ms
        self._clock = clock
        self._max_blocks = max_blocks
        self._entries = 0  # the sum of every scope's size
        self.bound_evicted = 0
        self._scopes: OrderedDict[str, Scope] = OrderedDict()  # least recently recorded first
        self._slots: dict[str, int] = {}  # replica -> bit position
        self._names: list[str] = []  # bit position -> replica ("" while the slot is free)
        self._free: list[int] = []

    def routed_entries(self) -> Iterator[RoutedEntries]:
        """Every (scope, replica)'s routed blocks, least recent scope and block first, with the
        milliseconds each has left (-1: no TTL); its live holes the same way. Engine-reported
        blocks are left out: the engine's KV events replay them. For `prefix_index.persist`."""
        now = self._now_ms()
        for scope, st in self._scopes.items():
            for replica, lru in st.lru.items():
                holes = st.holes.get(replica, {})
                yield RoutedEntries(
                    scope, replica, list(lru), remaining_ms(lru.values(), now), list(holes),
                    remaining_ms(holes.values(), now),
                )  # fmt: skip

    def restore(self, entries: RoutedEntries) -> int:
        """Put back what `routed_entries` gave (expired ones dropped, TTLs clipped to this
        index's); returns the blocks restored. Call in the order they were given."""
        now = self._now_ms()
        ttl = self._ttl_ms

        def expiry(left: int) -> int | None:
            if left < 0:
                return NEVER if ttl is None else now + ttl
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
        first = next(iter(lru.values()), NEVER)
        if first != NEVER:
            st.next_expiry = min(st.next_expiry, first)
        self._settle(entries.scope, st)
        return len(kept)

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

    def _use(self, scope: str, now: int) -> Scope:
        """The scope a write goes to, now the most recently recorded (after freeing a few
        idle scopes, and the scope's own expired entries)."""
        self._sweep(now)
        scopes = self._scopes
        st = scopes.get(scope)
        if st is None:
            st = scopes[scope] = Scope()
        else:
            self._purge(st, now)
            scopes.move_to_end(scope)
        st.used = now
        return st

    def set_max_blocks(self, blocks: int) -> None:
        """The bound over all scopes from now on; an index over it sheds at once."""
        if blocks <= SCOPE_COST_BLOCKS:
            raise ValueError(f"max_blocks must be > {SCOPE_COST_BLOCKS}, got {blocks}")
        self._max_blocks = blocks
        if self._entries + SCOPE_COST_BLOCKS * len(self._scopes) > blocks:
            self._enforce_bound()

    def _settle(self, scope: str, st: Scope) -> None:
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

    def _shed(self, st: Scope, count: int) -> None:
        """Drop `count` (< size) of the scope's entries: routed ones first, each replica losing
        its oldest in proportion to what it holds (replicas in name order, as in Redis), then
        engine-reported ones the same way."""
        left = count
        for replica, take in _shares(st.lru, left):
            self._pop_oldest(st, replica, st.lru[replica], take)
            left -= take
        for replica, take in _shares(st.eheld, left):
            held = st.eheld[replica]
            bit = 1 << self._slots[replica]
            for _ in range(take):
                h, _none = held.popitem(last=False)
                clear_bit(st.etable, h, bit)
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

    def _grow(self, st: Scope, entries: int) -> None:
        st.size += entries
        self._entries += entries

    def _pop_oldest(self, st: Scope, replica: str, lru: OrderedDict[int, int], count: int) -> None:
        """Drop the replica's `count` least recent entries of the scope (leaves first)."""
        bit = 1 << self._slots[replica]
        for _ in range(count):
            h, _expiry = lru.popitem(last=False)
            clear_bit(st.table, h, bit)
        self._grow(st, -count)
        if not lru:
            st.drop_replica(replica)

    def _trim(self, st: Scope, replica: str, lru: OrderedDict[int, int], bit: int) -> None:
        over = len(lru) - self._capacity.get(replica, self._default_capacity)
        self._pop_oldest(st, replica, lru, max(over, 0))

    def _purge(self, st: Scope, now: int) -> None:
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
                if expiry == NEVER or expiry > now:
                    if expiry != NEVER:
                        next_expiry = min(next_expiry, expiry)
                    break
                del lru[h]
                clear_bit(table, h, bit)
            self._grow(st, len(lru) - before)
            if not lru:
                st.drop_replica(replica)
        st.next_expiry = next_expiry

    def _drop_if_empty(self, scope: str, st: Scope) -> None:
        if not st.size and self._scopes.get(scope) is st:
            del self._scopes[scope]

    def _drop_empty_scopes(self) -> None:
        for scope in [s for s, st in self._scopes.items() if not st.size]:
            del self._scopes[scope]


def _shares(held: Mapping[str, Sized], count: int) -> Iterator[tuple[str, int]]:
    """(replica, entries to take) for `count` of the entries in `held`, replicas in name order,
    each taking its share in proportion to what it holds (rounded up) until `count` is met."""
    total = sum(map(len, held.values()))
    want = min(count, total)
    for replica, entries in sorted(held.items()):
        if not count:
            return
        take = min(len(entries), -(-want * len(entries) // total), count)
        yield replica, take
        count -= take
