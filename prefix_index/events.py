"""KV cache events from vLLM and SGLang: apply decoded batches (prefix_index/event_decode.py)
to the index, GPU blocks and the lower tiers (prefix_index/tiers.py).

No sockets and no engine hashes of our own: the gateway's subscriber feeds payloads in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prefix_index.base import EngineEventSink
from prefix_index.event_decode import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    KvEvent,
    decode_batch,
    engine_hash,
)
from prefix_index.tiers import GPU as GPU_TIER
from prefix_index.tiers import normalize_medium

__all__ = [
    "AllBlocksCleared",
    "ApplyCounts",
    "BlockRemoved",
    "BlockStored",
    "EngineBlockMap",
    "EventBatch",
    "EventDecodeError",
    "KvEvent",
    "KvEventApplier",
    "decode_batch",
    "engine_hash",
]

FULL_ATTENTION = "full_attention"
DEFAULT_MAP_CAPACITY = 1_000_000  # engine hashes remembered per replica (a safety cap)

# -- applying events to the index -------------------------------------------------------------


class TokenHasher(Protocol):
    """What the applier needs from a chunker (TokenChunker and ByteChunker both have it)."""

    def hash_tokens_after(
        self, scope: str, parent: int | None, token_ids: Sequence[int]
    ) -> list[int]: ...


class EngineBlockMap:
    """One replica's engine hash -> (scope, own hash), with a count of stores per engine hash.

    BlockRemoved carries engine hashes only, and a BlockStored's parent is an engine hash; this
    map resolves both to the gateway's own chain. An engine may store the same hash twice
    (two physical blocks); the block is gone only when every copy was removed. Bounded by
    `capacity`: past it, the oldest entry goes (returned by `add`, so its block can be
    evicted from the index too).
    """

    __slots__ = ("_map", "capacity", "overflowed")

    def __init__(self, capacity: int = DEFAULT_MAP_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._map: OrderedDict[int, list[Any]] = OrderedDict()  # eh -> [scope, own, copies]
        self.capacity = capacity
        self.overflowed = 0

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, engine_hash: int) -> bool:
        return engine_hash in self._map

    def get(self, engine_hash: int) -> tuple[str, int] | None:
        entry = self._map.get(engine_hash)
        return None if entry is None else (entry[0], entry[1])

    def add(self, engine_hash: int, scope: str, own: int) -> tuple[str, int] | None:
        """Remember a stored block; returns an entry pushed out by the cap, if any."""
        entry = self._map.get(engine_hash)
        if entry is not None:
            entry[2] += 1
            if entry[0] != scope or entry[1] != own:  # cannot happen with a sound engine hash
                entry[0], entry[1] = scope, own
            return None
        self._map[engine_hash] = [scope, own, 1]
        if len(self._map) > self.capacity:
            self.overflowed += 1
            _eh, (old_scope, old_own, _n) = self._map.popitem(last=False)
            return old_scope, old_own
        return None

    def remove(self, engine_hash: int) -> tuple[str, int, bool] | None:
        """Forget one stored copy: (scope, own, gone) where `gone` means no copy is left;
        None when the hash is not known."""
        entry = self._map.get(engine_hash)
        if entry is None:
            return None
        entry[2] -= 1
        if entry[2] > 0:
            return entry[0], entry[1], False
        del self._map[engine_hash]
        return entry[0], entry[1], True

    def clear(self) -> None:
        self._map.clear()


@dataclass(slots=True)
class ApplyCounts:
    """What a KvEventApplier did with the events it saw (block counts unless named)."""

    batches: int = 0
    stored: int = 0  # blocks placed in the index
    removed: int = 0  # blocks taken out of the index
    cleared: int = 0  # AllBlocksCleared events (each forgets the replica)
    resets: int = 0  # forgets, for any reason (cleared, restart, unfillable gap)
    unknown_parent: int = 0  # BlockStored blocks skipped: their parent hash was never placed
    unknown_removed: int = 0  # BlockRemoved hashes never placed (or already gone)
    mismatched: int = 0  # token ids that do not cut into the event's blocks at our block size
    unscoped: int = 0  # blocks of an adapter, salt or extra key we have no scope for
    other_medium: int = 0  # lower-tier blocks of a sink that keeps no tiers (ignored)
    tier_stored: int = 0  # blocks placed on a lower tier (cpu, disk, shared)
    tier_removed: int = 0  # blocks taken off a lower tier
    placeholder: int = 0  # lower-tier BlockStored without token ids (vLLM's legacy offload)
    unknown_medium: int = 0  # blocks of a medium no engine we know names (ignored, not GPU)
    other_group: int = 0  # blocks of a non-full-attention KV cache group (hybrid models)
    undecoded: int = 0  # events the decoder skipped (unknown tag, malformed fields)
    overflowed: int = 0  # engine-map entries pushed out by its safety cap


class KvEventApplier:
    """Turns one replica's event batches into `record_engine` / `evict_engine` calls.

    The gateway never reproduces the engine's hashes: a BlockStored's token ids, hashed after
    the gateway's own hash of the parent block, give the gateway's own hashes (the ones its
    requests hash to), and `blocks` maps each engine hash to them. GPU blocks (medium
    "GPU" or unset) of full-attention groups go to `record_engine`; blocks of a lower tier
    (prefix_index/tiers.py: CPU, CPU_PINNED, STORAGE, DISK, EXTERNAL) to `record_tier` when the
    sink has it. Placeholder offload events (no token ids) and unknown media are counted and
    ignored. `scope_for_lora(lora_name)` gives the scope
    of a block (None: an adapter the gateway does not route; the block is skipped).
    Apply batches one at a time, in sequence order.
    """

    def __init__(
        self,
        index: EngineEventSink,
        chunker: TokenHasher,
        scope_for_lora: Callable[[str | None], str | None],
        replica: str,
        *,
        blocks: EngineBlockMap | None = None,
    ) -> None:
        self.index = index
        self.chunker = chunker
        self.scope_for_lora = scope_for_lora
        self.replica = replica
        self.blocks = blocks if blocks is not None else EngineBlockMap()
        self.counts = ApplyCounts()
        self._other_groups: set[int] = set()
        # lower tiers (cpu, disk, shared): engine hash -> own hash per tier, when the sink keeps
        # tiers (MemoryIndex.record_tier); else their blocks are counted in `other_medium`
        self.tier_blocks: dict[str, EngineBlockMap] = {}
        self._tiers = callable(getattr(index, "record_tier", None))

    async def apply(self, batch: EventBatch) -> None:
        c = self.counts
        c.batches += 1
        c.undecoded += batch.skipped
        for event in batch.events:
            if isinstance(event, BlockStored):
                await self._stored(event)
            elif isinstance(event, BlockRemoved):
                await self._removed(event)
            else:
                c.cleared += 1
                await self.reset()

    async def reset(self) -> None:
        """Forget everything about the replica (engine restart, cache cleared, lost events)."""
        self.counts.resets += 1
        self.blocks.clear()
        self.tier_blocks.clear()
        await self.index.forget(self.replica)

    async def _stored(self, ev: BlockStored) -> None:
        c = self.counts
        n = len(ev.block_hashes)
        if not n:
            return
        tier = normalize_medium(ev.medium)
        if tier is None:
            c.unknown_medium += n
            return
        if tier != GPU_TIER:
            if not ev.token_ids or not ev.block_size:
                c.placeholder += n  # vLLM's legacy offload event: one key, no tokens, no parent
                return
            if not self._tiers:
                c.other_medium += n
                return
        if ev.kv_cache_spec_kind is not None and ev.kv_cache_spec_kind != FULL_ATTENTION:
            if ev.group_idx is not None:
                self._other_groups.add(ev.group_idx)
            c.other_group += n
            return
        scope = None
        if ev.cache_salt is None and not (ev.lora_name is None and ev.lora_id is not None):
            scope = self.scope_for_lora(ev.lora_name)
        k = 0 if scope is None else self._plain_blocks(ev, n)
        if k < n:
            c.unscoped += n - k
        if not k or scope is None:
            return
        parent: int | None = None
        if ev.parent_block_hash is not None:
            placed = self._placed(ev.parent_block_hash)
            if placed is None or placed[0] != scope:
                c.unknown_parent += k
                return
            parent = placed[1]
        tokens = ev.token_ids if k == n else ev.token_ids[: k * ev.block_size]
        if len(tokens) != k * ev.block_size:
            c.mismatched += k
            return
        own = self.chunker.hash_tokens_after(scope, parent, tokens)
        if len(own) != k:
            c.mismatched += k
            return
        if tier != GPU_TIER:
            tmap = self.tier_blocks.get(tier)
            if tmap is None:
                tmap = self.tier_blocks[tier] = EngineBlockMap(self.blocks.capacity)
            for eh, oh in zip(ev.block_hashes, own, strict=False):
                tmap.add(eh, scope, oh)  # the tier's own cap (TierStore) bounds the index side
            await self.index.record_tier(scope, self.replica, tier, own)  # type: ignore[attr-defined]
            c.tier_stored += k
            return
        pushed: list[tuple[str, int]] = []
        for eh, oh in zip(ev.block_hashes, own, strict=False):
            out = self.blocks.add(eh, scope, oh)
            if out is not None:
                pushed.append(out)
        await self.index.record_engine(scope, self.replica, own)
        c.stored += k
        if pushed:
            c.overflowed += len(pushed)
            await self._evict(pushed)

    def _plain_blocks(self, ev: BlockStored, n: int) -> int:
        """Leading blocks whose extra keys name nothing but the event's adapter (a salt or a
        multimodal input changes the engine's chain in ways the token ids do not show)."""
        extra = ev.extra_keys
        if not extra:
            return n
        for i in range(n):
            keys = extra[i] if i < len(extra) else None
            if keys is None:
                continue
            items = keys if isinstance(keys, list | tuple) else [keys]
            if ev.lora_name is None or any(x != ev.lora_name for x in items):
                return i
        return n

    async def _removed(self, ev: BlockRemoved) -> None:
        c = self.counts
        n = len(ev.block_hashes)
        tier = normalize_medium(ev.medium)
        if tier is None:
            c.unknown_medium += n
            return
        if tier != GPU_TIER:
            await self._removed_tier(tier, ev.block_hashes)
            return
        if ev.group_idx is not None and ev.group_idx in self._other_groups:
            c.other_group += n
            return
        gone: list[tuple[str, int]] = []
        for eh in ev.block_hashes:
            out = self.blocks.remove(eh)
            if out is None:
                c.unknown_removed += 1
            elif out[2]:
                gone.append((out[0], out[1]))
        if gone:
            c.removed += len(gone)
            await self._evict(gone)

    async def _removed_tier(self, tier: str, hashes: list[int]) -> None:
        c = self.counts
        tmap = self.tier_blocks.get(tier)
        if tmap is None:
            c.unknown_removed += len(hashes)  # placeholders land here too: never placed
            return
        by_scope: dict[str, list[int]] = {}
        for eh in hashes:
            out = tmap.remove(eh)
            if out is None:
                c.unknown_removed += 1
            elif out[2]:
                by_scope.setdefault(out[0], []).append(out[1])
        for scope, owns in by_scope.items():
            c.tier_removed += len(owns)
            await self.index.evict_tier(scope, self.replica, tier, owns)  # type: ignore[attr-defined]

    def _placed(self, engine_hash: int) -> tuple[str, int] | None:
        """Where an engine hash was placed: on the GPU, else on a lower tier (a chain spilled
        block by block continues on the tier its parent went to)."""
        placed = self.blocks.get(engine_hash)
        if placed is None:
            for tmap in self.tier_blocks.values():
                placed = tmap.get(engine_hash)
                if placed is not None:
                    break
        return placed

    async def _evict(self, blocks: list[tuple[str, int]]) -> None:
        by_scope: dict[str, list[int]] = {}
        for scope, own in blocks:
            by_scope.setdefault(scope, []).append(own)
        for scope, owns in by_scope.items():
            await self.index.evict_engine(scope, self.replica, owns)
