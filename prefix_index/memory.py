"""The embedded prefix index: block hash -> bit set of replicas, with per-replica LRU and TTL.

Also the engine-reported blocks of precise mode, kept apart, and one bound over all scopes (a
scope is chosen by the client: a salt never used again must not stay forever). No I/O; the
async methods never await, they only meet the PrefixIndex and EngineEventSink contracts.
One scope's storage and searches are in prefix_index/_scope.py, the bounds and eviction in
prefix_index/_bound.py (with the snapshot's `routed_entries` and `restore`); this module is
the contract on top.
"""

from __future__ import annotations

import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

from prefix_index._bound import BoundedScopes, check_bounds
from prefix_index._scope import NEVER, RoutedEntries, clear_bit
from prefix_index.base import EngineEventSink, IndexStats, PrefixIndex
from prefix_index.constants import (
    DEFAULT_CAPACITY_BLOCKS,
    DEFAULT_ENGINE_CAPACITY_BLOCKS,
    DEFAULT_MAX_BLOCKS,
    DEFAULT_ROUTED_TTL_S,
)
from prefix_index.tiers import TierStore

_INT_BYTES = 36  # a 64-bit hash as a Python int

__all__ = ["MemoryIndex", "RoutedEntries"]


def _record_blocks(
    table: dict[int, int], lru: OrderedDict[int, int], bit: int, hashes: Sequence[int], expiry: int
) -> None:
    """Each block of the chain becomes the replica's most recent, leaf first and root last
    (so the root is the most recent of all, and LRU takes leaves before their prefixes)."""
    move = lru.move_to_end
    for h in reversed(hashes):
        held = table.get(h, 0)
        if held & bit:
            move(h)
        else:
            table[h] = held | bit
        lru[h] = expiry


def _record_chain(
    table: dict[int, int], lru: OrderedDict[int, int], bit: int, hashes: Sequence[int], expiry: int
) -> None:
    """`_record_blocks` for a replica without holes, whose blocks are prefix-closed: past the
    last block it holds, every earlier one is held too, so only the new tail is looked at one by
    one and the held prefix is only moved to the end and given the new expiry (most records
    repeat a prefix: a shared system prompt, a conversation's history). A missing block (the
    invariant broken) falls back to the general loop, which leaves the same order."""
    get = table.get
    i = len(hashes)
    while i and not get(hashes[i - 1], 0) & bit:
        i -= 1
    for h in reversed(hashes[i:]):
        table[h] = get(h, 0) | bit
        lru[h] = expiry
    if not i:
        return
    move = lru.move_to_end
    try:
        if expiry == NEVER:  # no TTL: only the order changes, in a loop that runs in C
            deque(map(move, reversed(hashes[:i])), maxlen=0)
        else:
            # one loop: 125-180 ns a block, where a map of move_to_end and then
            # lru.update(zip(held, repeat(expiry))) took 240-330 (OrderedDict's update pays
            # a slot call and a tuple per item)
            for h in reversed(hashes[:i]):
                move(h)
                lru[h] = expiry
    except KeyError:
        _record_blocks(table, lru, bit, hashes, expiry)


class MemoryIndex(BoundedScopes, PrefixIndex, EngineEventSink):
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
        check_bounds(capacity_blocks, max_blocks, ttl_s, routed_ttl_s)
        if engine_capacity_blocks < 1:
            raise ValueError(f"engine_capacity_blocks must be >= 1, got {engine_capacity_blocks}")
        routed_ms = max(1, round(routed_ttl_s * 1000))
        ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self._routed_ttl_ms = routed_ms if ttl_ms is None else min(routed_ms, ttl_ms)
        self._engine_capacity = engine_capacity_blocks
        self._precise: set[str] = set()
        self.engine_trimmed = 0
        self.tiers = TierStore(engine_capacity_blocks)  # cpu, disk, shared: prefix_index/tiers.py
        super().__init__(capacity_blocks, ttl_ms, clock, max_blocks)

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

    async def forget_engine(self, replica: str) -> None:
        self.forget_engine_now(replica)

    async def evict_engine(self, scope: str, replica: str, hashes: Sequence[int]) -> None:
        self.evict_engine_now(scope, replica, hashes)

    async def record_tier(
        self, scope: str, replica: str, tier: str, hashes: Sequence[int]
    ) -> None:
        """The engine reported blocks stored on a lower tier (cpu, disk, shared)."""
        self.tiers.record(scope, replica, tier, hashes)

    async def evict_tier(self, scope: str, replica: str, tier: str, hashes: Sequence[int]) -> None:
        self.tiers.evict(scope, replica, tier, hashes)

    def match_tiers(
        self, scope: str, hashes: Sequence[int], gpu: dict[str, int]
    ) -> dict[str, dict[str, int]]:
        """Per replica, the blocks after its GPU depth (`gpu`, what `match` said) that its
        lower tiers or the shared store hold, by tier; replicas with none are left out."""
        return self.tiers.match(scope, hashes, gpu)

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
            st.match_routed(hashes, alive, result, self._names, self._now_ms)
        if st.etable:
            st.match_engine(hashes, alive, result, self._names)
        return result

    def record_now(self, scope: str, replica: str, hashes: Sequence[int]) -> None:
        """The replica now holds this chain; its blocks become its most recently used."""
        if not hashes:
            return
        now = self._now_ms()
        if replica in self._precise:
            expiry = now + self._routed_ttl_ms
        else:
            expiry = NEVER if self._ttl_ms is None else now + self._ttl_ms
        st = self._use(scope, now)
        bit = 1 << self._slot(replica)
        lru = st.lru.get(replica)
        if lru is None:
            lru = st.lru[replica] = OrderedDict()
        before = len(lru)
        holes = st.holes.get(replica)
        if holes:
            _record_blocks(st.table, lru, bit, hashes, expiry)
            for h in hashes:
                holes.pop(h, None)
            if not holes:
                del st.holes[replica]
        else:
            _record_chain(st.table, lru, bit, hashes, expiry)
        self._grow(st, len(lru) - before)
        self._trim(st, replica, lru, bit)
        if lru and expiry != NEVER:
            st.next_expiry = min(st.next_expiry, next(iter(lru.values())))
        self._settle(scope, st)

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
                clear_bit(st.table, h, bit)
                if expiry == NEVER or expiry > now:
                    holes[h] = expiry
        self._grow(st, len(lru) - before)
        for h in [h for h, e in holes.items() if e != NEVER and e <= now]:
            del holes[h]
        if not holes:
            del st.holes[replica]
        if not lru:
            st.drop_replica(replica)
        self._drop_if_empty(scope, st)

    def forget_now(self, replica: str) -> None:
        """Drop everything the replica holds, in every scope (it restarted or left)."""
        self.tiers.forget(replica)
        slot = self._slots.pop(replica, None)
        if slot is None:
            return
        bit = 1 << slot
        for st in self._scopes.values():
            lru = st.lru.get(replica)
            if lru:
                self._grow(st, -len(lru))
                for h in lru:
                    clear_bit(st.table, h, bit)
            st.drop_replica(replica)
            held = st.eheld.pop(replica, None)
            if held:
                self._grow(st, -len(held))
                for h in held:
                    clear_bit(st.etable, h, bit)
        self._names[slot] = ""
        self._free.append(slot)
        self._drop_empty_scopes()

    def forget_engine_now(self, replica: str) -> None:
        """Drop what the replica's engine reported, in every scope and tier; its routed entries
        stay (its KV events stopped, so nothing would evict the engine's entries any more)."""
        self.tiers.forget(replica)
        slot = self._slots.get(replica)
        if slot is None:
            return
        bit = 1 << slot
        for st in self._scopes.values():
            held = st.eheld.pop(replica, None)
            if held:
                self._grow(st, -len(held))
                for h in held:
                    clear_bit(st.etable, h, bit)
        self._drop_empty_scopes()

    @property
    def precise_replicas(self) -> frozenset[str]:
        """The replicas marked with `set_precise`: the index takes their engines' word."""
        return frozenset(self._precise)

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
                clear_bit(table, h, bit)
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
                    clear_bit(st.etable, h, bit)
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
                    if expiry == NEVER or expiry > cap:
                        lru[h] = cap
                st.next_expiry = min(st.next_expiry, next(iter(lru.values())))
            holes = st.holes.get(replica)
            if holes:
                for h, expiry in holes.items():
                    if expiry == NEVER or expiry > cap:
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
