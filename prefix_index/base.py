"""The prefix index contract every backend meets (memory, redis), stated once."""

from __future__ import annotations

from collections.abc import Sequence
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
