"""The prefix index contract every backend meets (memory, redis), stated once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@runtime_checkable
class PrefixIndex(Protocol):
    """Which replica holds which KV blocks.

    `hashes` is a chain: hash i covers blocks 0..i. `match` returns, for each replica in
    `replicas`, how many *leading* blocks of the chain it holds (0 when none). Implementations
    never raise on a backend outage: they degrade (answer zeros, drop writes), log once, and
    recover by themselves.

    The five coroutines are the contract. The plain methods after them are optional
    capabilities with defaults that do nothing, so a caller never probes for them: a backend
    that subclasses PrefixIndex inherits the defaults and overrides what it can do.
    """

    async def match(
        self, scope: str, hashes: Sequence[int], replicas: Sequence[str]
    ) -> dict[str, int]: ...

    async def record(self, scope: str, replica: str, hashes: Sequence[int]) -> None: ...

    async def evict(self, scope: str, replica: str, hashes: Sequence[int]) -> None: ...

    async def forget(self, replica: str) -> None: ...

    async def aclose(self) -> None: ...

    # -- optional capabilities ------------------------------------------------------------------

    def record_nowait(self, scope: str, replica: str, hashes: Sequence[int]) -> bool:
        """`record` without awaiting: True when the write was taken (done, or queued; a later
        `match_local` sees it), False when the caller must await `record`. Default: False."""
        return False

    def match_local(
        self, scope: str, hashes: Sequence[int], replicas: Sequence[str]
    ) -> dict[str, int] | None:
        """`match` from what this process knows, without a round trip; None when it knows
        nothing of its own (the default)."""
        return None

    def set_capacity(self, replica: str, blocks: int) -> None:
        """Capacity of one replica in blocks (per scope). Default: ignored (the index-wide
        capacity applies)."""
        return None

    def set_max_blocks(self, blocks: int) -> None:
        """Bound the whole index at `blocks` entries from now on, in place of the `max_blocks`
        it was opened with (the least recently recorded scopes go first, as for that).
        Default: ignored (the backend keeps its own bound)."""
        return None

    def set_precise(self, replica: str, precise: bool = True) -> None:
        """Mark a replica whose engine reports its blocks (see EngineEventSink). Default:
        ignored (the backend takes no engine reports)."""
        return None

    def match_tiers(
        self, scope: str, hashes: Sequence[int], gpu: dict[str, int]
    ) -> dict[str, dict[str, int]]:
        """Per replica, the blocks after its GPU depth (`gpu`, what `match` said) that its lower
        KV tiers or the shared store hold, by tier (docs/tiers.md); replicas with none are left
        out. Default: {} (the backend keeps no tiers)."""
        return {}

    def stats_now(self) -> IndexStats | None:
        """A snapshot without awaiting, for a metrics scrape; None (the default) when taking one
        would need I/O (`stats`, where a backend has it, awaits)."""
        return None


@runtime_checkable
class EngineEventSink(Protocol):
    """Where engine-reported blocks go (precise mode; both backends implement it, the redis
    backend in this gateway's process: prefix_index/_redis_local.py).

    `record_engine` / `evict_engine` take blocks the engine reported stored / evicted, in the
    gateway's own hashes. They are kept apart from what `record` learned from routing
    decisions: no TTL and no LRU (the engine evicts by itself; a large safety cap only), and
    `match` answers, per replica, the longer of the two runs. `record_engine`'s hashes need
    not start at block 0 (an event continues a chain). `set_precise(replica)` turns the
    replica's routed entries into short-lived guesses (`routed_ttl_s`) that bridge the time
    until the engine's own report arrives. `forget` clears both kinds, `forget_engine` the
    engine's only.
    """

    async def record_engine(self, scope: str, replica: str, hashes: Sequence[int]) -> None: ...

    async def evict_engine(self, scope: str, replica: str, hashes: Sequence[int]) -> None: ...

    async def forget(self, replica: str) -> None: ...

    async def forget_engine(self, replica: str) -> None:
        """Drop what the replica's engine reported (its events stopped: nothing would evict
        those entries any more); what routing taught stays."""
        ...

    def set_precise(self, replica: str, precise: bool = True) -> None: ...


@dataclass(frozen=True, slots=True)
class IndexStats:
    """A snapshot for metrics: what the index holds and what it costs.

    `blocks_per_replica` counts (scope, block) entries per replica; `distinct_blocks` is None
    where counting it would cost a scan (redis). `bytes_estimate` is the index's own memory
    (memory backend) or the Redis memory its entries take (redis backend, from the measured
    bytes per entry). `healthy` is False while the backend is unreachable. The `engine_*`
    fields count engine-reported entries (precise mode; with redis, this gateway's own): per
    replica, in all, and how many the safety cap pushed out. `scopes` counts the scopes held; `bound_evicted`
    counts entries the global bound (`max_blocks`) pushed out, since start (memory) or over
    every gateway of the namespace (redis).
    """

    backend: str
    blocks_per_replica: dict[str, int] = field(default_factory=dict)
    entries: int = 0
    distinct_blocks: int | None = None
    bytes_estimate: int = 0
    healthy: bool = True
    pending_writes: int = 0
    dropped_writes: int = 0
    engine_blocks_per_replica: dict[str, int] = field(default_factory=dict)
    engine_entries: int = 0
    engine_trimmed: int = 0
    scopes: int = 0
    bound_evicted: int = 0
