"""What the Redis backend keeps in this process: the local view of this gateway's own routed
writes, and precise mode's engine-reported blocks and lower KV tiers.

Every gateway subscribes to every replica's KV events itself, so each sees the same engine
state; sharing it through Redis would only multiply the writes by the number of gateways. So
the engine's entries stay in this process, in a MemoryIndex (the local view of this gateway's
own routed writes when that is on, else one of their own), and only routed records go to
Redis, shared. A match takes, per replica, the longer of the Redis answer and the local one,
and only once an engine reported a block: without KV events a match costs what it did.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from prefix_index.base import EngineEventSink, IndexStats
from prefix_index.memory import MemoryIndex


class LocalEntries(EngineEventSink):
    """RedisIndex's local half: the local view `_local` (None when RedisTuning.local_view is
    off), engine entries and tiers in `_engine` (the local view itself, or a MemoryIndex of
    their own), precise replicas in `_precise` (their routed records get short lives in Redis).

    An engine's eviction cuts the routed guess of the local view only: the one in Redis,
    written with `routed_ttl_s`, ages out by itself within that time.
    """

    _local: MemoryIndex | None
    _engine: MemoryIndex
    _engine_fed: bool  # an engine reported a GPU block: `match` consults `_engine` from now on
    _precise: set[str]

    async def record_engine(self, scope: str, replica: str, hashes: Sequence[int]) -> None:
        if hashes:
            self._engine_fed = True
            self._engine.record_engine_now(scope, replica, hashes)

    async def evict_engine(self, scope: str, replica: str, hashes: Sequence[int]) -> None:
        self._engine.evict_engine_now(scope, replica, hashes)

    async def forget_engine(self, replica: str) -> None:
        """Drop what the replica's engine reported (kept in this process); the routed records,
        in Redis and in the local view, stay."""
        self._engine.forget_engine_now(replica)

    @property
    def precise_replicas(self) -> frozenset[str]:
        """The replicas marked with `set_precise`: the index takes their engines' word."""
        return frozenset(self._precise)

    async def record_tier(self, scope: str, replica: str, tier: str, hashes: Sequence[int]) -> None:
        """The engine reported blocks stored on a lower tier (cpu, disk, shared)."""
        self._engine.tiers.record(scope, replica, tier, hashes)

    async def evict_tier(self, scope: str, replica: str, tier: str, hashes: Sequence[int]) -> None:
        self._engine.tiers.evict(scope, replica, tier, hashes)

    def match_tiers(
        self, scope: str, hashes: Sequence[int], gpu: dict[str, int]
    ) -> dict[str, dict[str, int]]:
        """Per replica, the blocks after its GPU depth that its lower tiers or the shared store
        hold, by tier, as this gateway's engine events told it (docs/tiers.md)."""
        return self._engine.match_tiers(scope, hashes, gpu)

    def set_precise(self, replica: str, precise: bool = True) -> None:
        """Mark a replica whose engine reports its blocks: the routed records this gateway
        writes for it from now on expire in Redis after `routed_ttl_s` (or `ttl_s` if shorter),
        and the local view cuts its own at once. Records already in Redis keep their expiry
        until a gateway rewrites them. `precise=False` undoes it for the next writes."""
        if precise:
            self._precise.add(replica)
        else:
            self._precise.discard(replica)
        self._engine.set_precise(replica, precise)

    def match_local(
        self, scope: str, hashes: Sequence[int], replicas: Sequence[str]
    ) -> dict[str, int] | None:
        """This gateway's own writes (and engine reports), matched without a round trip (None:
        no local view)."""
        return None if self._local is None else self._local.match_now(scope, hashes, replicas)

    def _local_answer(
        self, scope: str, hashes: Sequence[int], replicas: Sequence[str]
    ) -> dict[str, int]:
        """The answer while Redis is out: what this gateway knows (its own writes, the engines'
        reports), zeros when it keeps nothing."""
        if self._local is None and not self._engine_fed:
            return dict.fromkeys(replicas, 0)
        return self._engine.match_now(scope, hashes, replicas)

    def _with_engine(
        self, scope: str, hashes: Sequence[int], replicas: Sequence[str], answer: dict[str, int]
    ) -> dict[str, int]:
        """`answer` (Redis') raised, per replica, to the local index's run where that is longer."""
        for name, depth in self._engine.match_now(scope, hashes, replicas).items():
            if depth > answer[name]:
                answer[name] = depth
        return answer

    def stats_now(self) -> IndexStats | None:
        """The part known without a round trip, for a metrics scrape: this gateway's engine
        entries (None before an engine reported; the routed figures need Redis: `stats`)."""
        if not self._engine_fed:
            return None
        return self._engine_stats(IndexStats(backend="redis"))

    def _engine_stats(self, stats: IndexStats) -> IndexStats:
        """`stats` with the engine_* fields of this gateway's engine entries."""
        if not self._engine_fed:
            return stats
        mine = self._engine.stats_now()
        return replace(
            stats,
            engine_blocks_per_replica=mine.engine_blocks_per_replica,
            engine_entries=mine.engine_entries,
            engine_trimmed=mine.engine_trimmed,
        )
