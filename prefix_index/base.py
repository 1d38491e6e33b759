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
    """

    async def match(
        self, scope: str, hashes: Sequence[int], replicas: Sequence[str]
    ) -> dict[str, int]: ...

    async def record(self, scope: str, replica: str, hashes: Sequence[int]) -> None: ...

    async def evict(self, scope: str, replica: str, hashes: Sequence[int]) -> None: ...

    async def forget(self, replica: str) -> None: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True, slots=True)
class IndexStats:
    """A snapshot for metrics: what the index holds and what it costs.

    `blocks_per_replica` counts (scope, block) entries per replica; `distinct_blocks` is None
    where counting it would cost a scan (redis). `bytes_estimate` is the index's own memory
    (memory backend) or the Redis memory its entries take (redis backend, from the measured
    bytes per entry). `healthy` is False while the backend is unreachable.
    """

    backend: str
    blocks_per_replica: dict[str, int] = field(default_factory=dict)
    entries: int = 0
    distinct_blocks: int | None = None
    bytes_estimate: int = 0
    healthy: bool = True
    pending_writes: int = 0
    dropped_writes: int = 0
