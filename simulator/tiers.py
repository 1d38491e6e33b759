"""KV tiers below a replica's GPU: a host-memory tier per replica, a store shared by a pool.

The GPU prefix cache (simulator/kv_cache.py) spills the blocks it evicts to the host tier (LRU,
`cpu_blocks`) and writes every block it computes through to the shared store when there is
one (LMCache / Mooncake style; one in-process object all engines of a DES cluster, or all
replicas of an HTTP Fleet, share). A request's prefix found there is loaded instead of
recomputed: the blocks come back to the GPU and the step pays tokens x bytes per token / the
tier's bandwidth (`load_s`). Host tier events go into the GPU cache's event list, the shared
store's into its own list (DES) or the writer's StoreOutbox (HTTP), as ("tier_stored" |
"tier_removed", medium, hash); the publisher turns them into vLLM's BlockStored / BlockRemoved
with `medium` (EventTokens keeps the token ids a self-describing event carries).
docs/tiers.md.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

CPU_MEDIUM = "CPU"  # vLLM's OffloadingConnector
SHARED_MEDIUM = "EXTERNAL"  # SGLang HiCache's shared L3 (vLLM emits none for LMCache's)
HOST_GBPS = 50.0  # PCIe Gen5 DMA, one direction (reference §4.4)
SHARED_GBPS = 12.5  # a 100 Gb/s link to the store


@dataclass(slots=True)
class TierCounters:
    """Tokens each tier served (hits) and what loading them cost, by tier, as the engines count
    them on /metrics (simulator/metrics.py): vLLM's kv_offload bytes and seconds per transfer
    direction for the host tier, LMCache's hit tokens and retrieve time for the shared store."""

    hit_tokens: dict[str, int] = field(default_factory=lambda: {"gpu": 0, "cpu": 0, "shared": 0})
    load_bytes: dict[str, int] = field(default_factory=lambda: {"cpu": 0, "shared": 0})
    load_s: dict[str, float] = field(default_factory=lambda: {"cpu": 0.0, "shared": 0.0})
    retrievals: int = 0  # loads that took blocks from the shared store (LMCache's retrieves)
    spilled: int = 0  # blocks the GPU evicted into the host tier
    offload_bytes: int = 0  # their bytes (gpu_to_cpu)
    offload_s: float = 0.0  # the time those spills take at the host bandwidth


class LruBlocks:
    """A bounded set of block hashes, least recently used first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a tier needs at least one block, got {capacity}")
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, h: int) -> bool:
        return h in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def put(self, h: int) -> int | None:
        """Hold `h` (most recent now); returns the block pushed out, if any."""
        blocks = self.blocks
        if h in blocks:
            blocks.move_to_end(h)
            return None
        blocks[h] = None
        return blocks.popitem(last=False)[0] if len(blocks) > self.capacity else None

    def touch(self, h: int) -> None:
        self.blocks.move_to_end(h)


class StoreOutbox:
    """The shared store's events about the blocks one replica wrote first: their BlockStored,
    and their BlockRemoved when the store's LRU drops them, whichever replica's write pushed
    them out (a gateway resolves a removed engine hash per replica, so the replica that
    announced a block announces its end). The replica's publisher sends `events` after the
    engine's own; `wake`, when set, asks it to publish soon (another replica queued one);
    `tokens(h)`, when set, gives the parent and token ids of a block it announced, so that
    another replica that loads the block can report it on its GPU with them."""

    __slots__ = ("events", "tokens", "wake")

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.wake: Callable[[], None] | None = None
        self.tokens: Callable[[int], tuple[int | None, list[int]] | None] | None = None


class SharedStore(LruBlocks):
    """A pool-wide KV store: every engine writes through, any engine loads. Its events go to
    `events` when that is a list (the DES bench drains it as one more publisher's), else to
    the outbox of the replica that wrote the block first (none: not published)."""

    def __init__(self, capacity: int, gbps: float = SHARED_GBPS) -> None:
        super().__init__(capacity)
        self.gbps = gbps
        self.events: list[tuple[Any, ...]] | None = None
        self._owner: dict[int, StoreOutbox] = {}  # block -> the outbox that announced it

    def write(self, h: int, outbox: StoreOutbox | None = None) -> None:
        fresh = h not in self.blocks
        out = self.put(h)
        if fresh:
            if outbox is not None and self.events is None:
                self._owner[h] = outbox
            self._emit(("tier_stored", SHARED_MEDIUM, h), outbox, outbox)
        if out is not None:
            self._emit(("tier_removed", SHARED_MEDIUM, out), self._owner.pop(out, None), outbox)

    def owner(self, h: int) -> StoreOutbox | None:
        """The outbox of the replica that announced block `h` (None: nobody did)."""
        return self._owner.get(h)

    def _emit(self, event: tuple[Any, ...], owner: StoreOutbox | None,
              writer: StoreOutbox | None) -> None:
        if self.events is not None:
            self.events.append(event)
        elif owner is not None:
            owner.events.append(event)
            if owner is not writer and owner.wake is not None:
                owner.wake()


def shared_store(gb: float, *, bytes_per_token: float, block_size: int,
                 gbps: float = SHARED_GBPS) -> SharedStore:
    """A store of `gb` GB: as many blocks of the model's KV as fit (the host tier's sizing)."""
    return SharedStore(int(gb * 1e9 / (bytes_per_token * block_size)), gbps)


class Tiers:
    """One engine's lower tiers: its host memory (None: none) and the pool's shared store."""

    def __init__(self, host_blocks: int, *, block_size: int, bytes_per_token: float,
                 host_gbps: float = HOST_GBPS, shared: SharedStore | None = None) -> None:
        self.host = LruBlocks(host_blocks) if host_blocks > 0 else None
        self.shared = shared
        self.outbox: StoreOutbox | None = None  # where this engine's shared-store events go
        self.block_size = block_size
        self.bytes_per_token = bytes_per_token
        self.host_gbps = host_gbps
        self.counters = TierCounters()
        self.pending_s = 0.0  # load time the next step pays

    def where(self, h: int) -> str | None:
        if self.host is not None and h in self.host:
            return "cpu"
        if self.shared is not None and h in self.shared:
            return "shared"
        return None

    def spill(self, h: int, events: list[tuple[Any, ...]] | None) -> None:
        """The GPU evicted block `h`: keep it in host memory (its LRU may push one out)."""
        host = self.host
        if host is None:
            return
        fresh = h not in host
        out = host.put(h)
        c = self.counters
        c.spilled += 1
        size = int(self.block_size * self.bytes_per_token)
        c.offload_bytes += size
        c.offload_s += size / (self.host_gbps * 1e9)
        if events is not None:
            if fresh:
                events.append(("tier_stored", CPU_MEDIUM, h))
            if out is not None:
                events.append(("tier_removed", CPU_MEDIUM, out))

    def computed(self, h: int) -> None:
        """The GPU computed block `h`: write it through to the shared store."""
        if self.shared is not None:
            self.shared.write(h, self.outbox)

    def load(self, hashes: Sequence[int]) -> None:
        """Blocks about to be loaded to the GPU: price them (per tier) into the next step."""
        per_block = self.block_size * self.bytes_per_token
        size = int(per_block)
        c = self.counters
        retrieved = False
        for h in hashes:
            tier = self.where(h)
            if tier == "cpu":
                assert self.host is not None
                self.host.touch(h)
                gbps = self.host_gbps
            elif tier == "shared":
                assert self.shared is not None
                self.shared.touch(h)
                gbps = self.shared.gbps
                retrieved = True
            else:
                continue
            c.hit_tokens[tier] += self.block_size
            t = per_block / (gbps * 1e9)
            c.load_bytes[tier] += size
            c.load_s[tier] += t
            self.pending_s += t
        c.retrievals += retrieved

    def take_load_s(self) -> float:
        """The load time of the blocks loaded since the last call (the step's stall)."""
        t, self.pending_s = self.pending_s, 0.0
        return t


class EventTokens:
    """Token ids and parent of every block an engine reported, so that a tier event can be
    self-describing (vLLM's `self_describing_kv_events`): hash -> (parent, tokens, copies)."""

    def __init__(self) -> None:
        self._info: dict[int, list[Any]] = {}

    def known(self, h: int) -> tuple[int | None, list[int]] | None:
        """The parent and token ids of a block this engine reported and still holds."""
        entry = self._info.get(h)
        return None if entry is None else (entry[0], entry[1])

    def expand(self, events: list[tuple[Any, ...]], *, placeholders: bool = False,
               lookup: Callable[[int], tuple[int | None, list[int]] | None] | None = None,
               ) -> list[tuple[Any, ...]]:
        """The engine's events with tier events in the publisher's form: ("stored", [h],
        parent, tokens, medium) and ("removed", h, medium). Tokens unknown, or `placeholders`:
        no tokens (vLLM's legacy offload events, which a router cannot place). `lookup(h)`:
        parent and tokens of a block another engine computed (one loaded from the shared
        store); without them a loaded block is not reported."""
        info = self._info
        out: list[tuple[Any, ...]] = []
        for e in events:
            kind = e[0]
            if kind == "stored":
                _, hashes, parent, tokens = e
                bs = len(tokens) // max(1, len(hashes))
                prev = parent
                for i, h in enumerate(hashes):
                    entry = info.get(h)
                    if entry is None:
                        info[h] = [prev, list(tokens[i * bs:(i + 1) * bs]), 1]
                    else:
                        entry[2] += 1
                    prev = h
                out.append(e)
            elif kind == "removed":
                self._drop(e[1])
                out.append(e)
            elif kind == "promoted":  # loaded back to the GPU: a GPU BlockStored
                entry = info.get(e[1])
                if entry is None and lookup is not None:
                    got = lookup(e[1])
                    if got is not None:
                        entry = info[e[1]] = [got[0], got[1], 0]
                if entry is not None:
                    entry[2] += 1
                    out.append(("stored", [e[1]], entry[0], entry[1]))
            elif kind == "tier_stored":
                entry = info.get(e[2])
                if entry is None or placeholders:
                    out.append(("stored", [e[2]], None, [], e[1]))
                    if entry is not None:
                        entry[2] += 1
                else:
                    entry[2] += 1
                    out.append(("stored", [e[2]], entry[0], entry[1], e[1]))
            elif kind == "tier_removed":
                self._drop(e[2])
                out.append(("removed", e[2], e[1]))
            else:
                info.clear()
                out.append(e)
        return out

    def _drop(self, h: int) -> None:
        entry = self._info.get(h)
        if entry is not None:
            entry[2] -= 1
            if entry[2] <= 0:
                del self._info[h]


def attach_shared(engines: Sequence[Any], shared: SharedStore,
                  outboxes: Sequence[StoreOutbox] | None = None) -> None:
    """Give every engine (of a DES cluster, or a Fleet's replicas) the same shared store (a
    host tier of none where the engine has no `cpu_kv_gb`); `outboxes[i]`: where engine i's
    store events go (its publisher's), when the store keeps no `events` list of its own."""
    for i, e in enumerate(engines):
        cache = e.cache
        if cache.tiers is None:
            bpt = e.config.perf.kv_bytes_per_token
            cache.tiers = Tiers(0, block_size=cache.block_size, bytes_per_token=bpt)
        cache.tiers.shared = shared
        if outboxes is not None:
            cache.tiers.outbox = outboxes[i]
