"""KV tiers below the GPU: which replica holds which block on its host memory or disk, and the
blocks of a store every replica of the fleet can load from (shared). No I/O.

Engines name tiers in KV events' `medium` (docs/tiers.md): vLLM "GPU" / "CPU" / "STORAGE",
SGLang HiCache "GPU" / "CPU_PINNED" / "DISK" / "EXTERNAL". `normalize_medium` maps both to
gpu | cpu | disk | shared, case-insensitively; a name it does not know gives None (the caller
counts it and ignores the block: an unknown tier is never taken for the GPU).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from prefix_index._scope import clear_bit

__all__ = [
    "CPU", "DISK", "GPU", "LOWER_TIERS", "SHARED", "TierAudit", "TierStore", "normalize_medium",
]  # fmt: skip

GPU = "gpu"
CPU = "cpu"
DISK = "disk"
SHARED = "shared"
LOWER_TIERS = (CPU, DISK, SHARED)  # fastest first: a block held on several counts on the first

_MEDIUMS: dict[str, str] = {
    "GPU": GPU, "DEVICE": GPU,
    "CPU": CPU, "CPU_PINNED": CPU, "HOST": CPU, "HOSTPINNED": CPU, "HOST_PINNED": CPU,
    "STORAGE": DISK, "DISK": DISK, "SSD": DISK, "NVME": DISK, "FS": DISK,
    "EXTERNAL": SHARED, "SHARED": SHARED, "REMOTE": SHARED,
}  # fmt: skip


def normalize_medium(medium: str | None) -> str | None:
    """An event's `medium` as a tier name; unset means GPU (events older than the field)."""
    if medium is None:
        return GPU
    return _MEDIUMS.get(medium.strip().upper())


class TierStore:
    """Per scope and lower tier: block hash -> bit set of replicas (cpu, disk), and the shared
    tier's blocks (any replica may load them). Each replica's blocks per scope and tier are kept
    in arrival order and capped at `capacity` (oldest out), the shared tier at `capacity` per
    scope. Not prefix-closed (a tier evicts as it likes), so `match` walks the chain."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.trimmed = 0
        self._tables: dict[tuple[str, str], dict[int, int]] = {}  # (scope, tier) -> h -> bits
        self._held: dict[tuple[str, str, str], OrderedDict[int, None]] = {}  # scope,tier,replica
        self._shared: dict[str, OrderedDict[int, None]] = {}  # scope -> blocks
        self._slots: dict[str, int] = {}

    def _bit(self, replica: str) -> int:
        slot = self._slots.get(replica)
        if slot is None:
            slot = self._slots[replica] = len(self._slots)
        return 1 << slot

    def record(self, scope: str, replica: str, tier: str, hashes: Sequence[int]) -> None:
        if tier == SHARED:
            held = self._shared.setdefault(scope, OrderedDict())
            for h in hashes:
                held[h] = None
                held.move_to_end(h)
            while len(held) > self.capacity:
                held.popitem(last=False)
                self.trimmed += 1
            return
        table = self._tables.setdefault((scope, tier), {})
        mine = self._held.setdefault((scope, tier, replica), OrderedDict())
        bit = self._bit(replica)
        for h in hashes:
            mine[h] = None
            mine.move_to_end(h)
            table[h] = table.get(h, 0) | bit
        while len(mine) > self.capacity:
            h, _none = mine.popitem(last=False)
            clear_bit(table, h, bit)
            self.trimmed += 1

    def evict(self, scope: str, replica: str, tier: str, hashes: Sequence[int]) -> None:
        if tier == SHARED:
            held = self._shared.get(scope)
            if held is not None:
                for h in hashes:
                    held.pop(h, None)
            return
        mine = self._held.get((scope, tier, replica))
        table = self._tables.get((scope, tier))
        if mine is None or table is None:
            return
        bit = self._bit(replica)
        for h in hashes:
            if mine.pop(h, 1) is None:
                clear_bit(table, h, bit)

    def forget(self, replica: str) -> None:
        """The replica's own tiers are gone (restart); the shared store is not its own."""
        bit = self._slots.get(replica)
        if bit is None:
            return
        for key in [k for k in self._held if k[2] == replica]:
            table = self._tables.get((key[0], key[1]), {})
            for h in self._held.pop(key):
                clear_bit(table, h, 1 << bit)

    def match(
        self, scope: str, hashes: Sequence[int], gpu: dict[str, int]
    ) -> dict[str, dict[str, int]]:
        """Per replica of `gpu` (its GPU depth), the blocks after that depth, one by one, that a
        lower tier holds (each counted on its fastest tier), up to the first held nowhere."""
        cpu_t = self._tables.get((scope, CPU), {})
        disk_t = self._tables.get((scope, DISK), {})
        shared: dict[int, None] | OrderedDict[int, None] = self._shared.get(scope, {})
        out: dict[str, dict[str, int]] = {}
        if not (cpu_t or disk_t or shared):
            return out
        n = len(hashes)
        for name, depth in gpu.items():
            slot = self._slots.get(name)
            bit = 0 if slot is None else 1 << slot
            got = {CPU: 0, DISK: 0, SHARED: 0}
            for i in range(depth, n):
                h = hashes[i]
                if cpu_t.get(h, 0) & bit:
                    got[CPU] += 1
                elif disk_t.get(h, 0) & bit:
                    got[DISK] += 1
                elif h in shared:
                    got[SHARED] += 1
                else:
                    break
            if got[CPU] or got[DISK] or got[SHARED]:
                out[name] = got
        return out

    def counts(self) -> dict[str, int]:
        """Entries per tier (a metrics snapshot)."""
        out = {CPU: 0, DISK: 0, SHARED: sum(map(len, self._shared.values()))}
        for (_scope, tier, _replica), held in self._held.items():
            out[tier] = out.get(tier, 0) + len(held)
        return out


class TierAudit:
    """Predicted vs served prefix tokens by tier: what the router expected a replica to find
    (GPU hit and per lower tier) against the cached tokens it reported. A shortfall is
    charged to the slowest tiers first (they sit after the GPU run in the chain): a predicted
    CPU hit the replica did not serve shows in `unserved["cpu"]`."""

    ORDER = (SHARED, DISK, CPU, GPU)

    def __init__(self) -> None:
        self.predicted = dict.fromkeys((GPU, *LOWER_TIERS), 0)
        self.unserved = dict.fromkeys((GPU, *LOWER_TIERS), 0)
        self.requests_short = 0

    def observe(self, gpu_tokens: int, tier_tokens: dict[str, int] | None, cached: int) -> None:
        pred = {GPU: gpu_tokens, **(tier_tokens or {})}
        for tier, n in pred.items():
            self.predicted[tier] = self.predicted.get(tier, 0) + n
        short = sum(pred.values()) - cached
        if short <= 0:
            return
        self.requests_short += 1
        for tier in self.ORDER:
            take = min(short, pred.get(tier, 0))
            self.unserved[tier] += take
            short -= take
