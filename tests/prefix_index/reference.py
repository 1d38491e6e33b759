"""A deliberately naive model of the index contract, the oracle of the differential tests.

Linear walks and full scans only: slow, obviously right, shares no code with the backends.
"""

from __future__ import annotations

from collections.abc import Sequence


class ReferenceIndex:
    """Per (scope, replica): block -> (recency, expiry ms or None). Capacity drops the least
    recent entry; within one record, block i is touched before block i-1 (root last)."""

    def __init__(self, capacity: int, ttl_s: float | None) -> None:
        self.capacity = capacity
        self.ttl_ms = None if ttl_s is None else round(ttl_s * 1000)
        self.entries: dict[tuple[str, str], dict[int, tuple[int, int | None]]] = {}
        self.tick = 0

    def record(self, now_s: float, scope: str, replica: str, hashes: Sequence[int]) -> None:
        if not hashes:
            return
        now = int(now_s * 1000)
        expiry = None if self.ttl_ms is None else now + self.ttl_ms
        held = self.entries.setdefault((scope, replica), {})
        for h in reversed(hashes):
            self.tick += 1
            held[h] = (self.tick, expiry)
        while len(held) > self.capacity:
            oldest = min(held, key=lambda b: held[b][0])
            del held[oldest]

    def evict(self, scope: str, replica: str, hashes: Sequence[int]) -> None:
        held = self.entries.get((scope, replica), {})
        for h in hashes:
            held.pop(h, None)

    def forget(self, replica: str) -> None:
        for key in [k for k in self.entries if k[1] == replica]:
            del self.entries[key]

    def match(
        self, now_s: float, scope: str, hashes: Sequence[int], replicas: Sequence[str]
    ) -> dict[str, int]:
        now = int(now_s * 1000)
        out: dict[str, int] = {}
        for replica in replicas:
            held = self.entries.get((scope, replica), {})
            depth = 0
            for h in hashes:
                entry = held.get(h)
                if entry is None or (entry[1] is not None and entry[1] <= now):
                    break
                depth += 1
            out[replica] = depth
        return out
