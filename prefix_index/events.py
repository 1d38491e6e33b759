"""KV cache events from vLLM and SGLang: decode one published batch, apply it to the index.

No sockets and no engine hashes of our own: the gateway's subscriber feeds payloads in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeGuard

from prefix_index.base import EngineEventSink

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

_U64 = (1 << 64) - 1
GPU = "GPU"
FULL_ATTENTION = "full_attention"
DEFAULT_MAP_CAPACITY = 1_000_000  # engine hashes remembered per replica (a safety cap)

# The positional (array_like) order of vLLM <= 0.23 and SGLang <= 0.5.19; the tag is element 0.
# Fields added after an engine's version are simply absent (short arrays read as None).
_LEGACY_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


class EventDecodeError(ValueError):
    """The payload is not a msgpack event batch (the whole batch is unusable)."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks the engine cached: `token_ids` covers every block in `block_hashes`."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    medium: str | None = None
    extra_keys: list[Any] | None = None  # one entry per block (vLLM >= 0.20), untagged
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    cache_salt: str | None = None  # SGLang (map encoding)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks the engine evicted; only engine hashes, no tokens."""

    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache (vLLM: reset_prefix_cache)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published batch. `skipped` counts events not understood (unknown tag, bad fields)."""

    ts: float
    events: list[KvEvent]
    dp_rank: int | None = None
    skipped: int = 0


def engine_hash(value: Any) -> int:
    """An engine block hash as an unsigned 64-bit int: vLLM's uint64, SGLang's signed int64,
    or raw digest bytes (their last 8 bytes, big-endian)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value & _U64
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        if not raw:
            raise ValueError("an empty block hash")
        return int.from_bytes(raw[-8:], "big")
    raise ValueError(f"a block hash must be an int or bytes, got {type(value).__name__}")


def decode_batch(payload: bytes) -> EventBatch:
    """Decode the third frame of a KV-event message: `[ts, events]` or `[ts, events, dp_rank]`,
    each event a positional array (tag first) or a map with `"type"`, in any mix."""
    try:
        from msgspec import DecodeError
        from msgspec.msgpack import decode
    except ImportError as exc:  # pragma: no cover - the `events` extra is missing
        raise RuntimeError("decoding KV events needs msgspec (the `events` extra)") from exc
    try:
        raw = decode(payload)
    except DecodeError as exc:
        raise EventDecodeError(f"not a msgpack event batch: {exc}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise EventDecodeError("an event batch is an array [ts, events, dp_rank?]")
    ts = raw[0]
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise EventDecodeError("the batch timestamp must be a number")
    dp = raw[2] if len(raw) > 2 else None
    if isinstance(dp, bool) or not isinstance(dp, int):
        dp = None
    events: list[KvEvent] = []
    skipped = 0
    for item in raw[1]:
        try:
            event = _event(item)
        except (TypeError, ValueError):
            event = None
        if event is None:
            skipped += 1
        else:
            events.append(event)
    return EventBatch(float(ts), events, dp, skipped)


def _event(item: Any) -> KvEvent | None:
    if isinstance(item, list):
        if not item or not isinstance(item[0], str):
            return None
        tag = item[0]
        names = _LEGACY_FIELDS.get(tag)
        if names is None:
            return None
        fields = dict(zip(names, item[1:], strict=False))
    elif isinstance(item, dict):
        kind = item.get("type")
        if not isinstance(kind, str) or kind not in _LEGACY_FIELDS:
            return None
        tag, fields = kind, item
    else:
        return None
    if tag == "BlockStored":
        hashes = _hashes(fields.get("block_hashes"))
        parent = fields.get("parent_block_hash")
        tokens = fields.get("token_ids")
        if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
            raise ValueError("token_ids must be a list of ints")
        size = fields.get("block_size")
        if not _is_int(size) or size < 1:
            raise ValueError("block_size must be a positive int")
        extra = fields.get("extra_keys")
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=None if parent is None else engine_hash(parent),
            token_ids=tokens,
            block_size=size,
            lora_id=_opt(fields.get("lora_id"), int),
            lora_name=_opt(fields.get("lora_name"), str),
            medium=_opt(fields.get("medium"), str),
            extra_keys=extra if isinstance(extra, list) else None,
            group_idx=_opt(fields.get("group_idx"), int),
            kv_cache_spec_kind=_opt(fields.get("kv_cache_spec_kind"), str),
            cache_salt=_opt(fields.get("cache_salt"), str),
        )
    if tag == "BlockRemoved":
        return BlockRemoved(
            block_hashes=_hashes(fields.get("block_hashes")),
            medium=_opt(fields.get("medium"), str),
            group_idx=_opt(fields.get("group_idx"), int),
        )
    return AllBlocksCleared()


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _opt(value: Any, kind: type) -> Any:
    """The value if it has the expected type, else None (a field we only read as a hint)."""
    if kind is int:
        return value if _is_int(value) else None
    return value if isinstance(value, kind) else None


def _hashes(value: Any) -> list[int]:
    if not isinstance(value, list):
        raise ValueError("block_hashes must be a list")
    return [engine_hash(h) for h in value]


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
    other_medium: int = 0  # blocks of a CPU / disk tier (not what a prefill hits)
    other_group: int = 0  # blocks of a non-full-attention KV cache group (hybrid models)
    undecoded: int = 0  # events the decoder skipped (unknown tag, malformed fields)
    overflowed: int = 0  # engine-map entries pushed out by its safety cap


class KvEventApplier:
    """Turns one replica's event batches into `record_engine` / `evict_engine` calls.

    The gateway never reproduces the engine's hashes: a BlockStored's token ids, hashed after
    the gateway's own hash of the parent block, give the gateway's own hashes (the ones its
    requests hash to), and `blocks` maps each engine hash to them. Only GPU blocks (medium
    "GPU" or unset) of full-attention groups count. `scope_for_lora(lora_name)` gives the scope
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
        await self.index.forget(self.replica)

    async def _stored(self, ev: BlockStored) -> None:
        c = self.counts
        n = len(ev.block_hashes)
        if not n:
            return
        if ev.medium is not None and ev.medium.upper() != GPU:
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
            placed = self.blocks.get(ev.parent_block_hash)
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
        if ev.medium is not None and ev.medium.upper() != GPU:
            c.other_medium += n
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

    async def _evict(self, blocks: list[tuple[str, int]]) -> None:
        by_scope: dict[str, list[int]] = {}
        for scope, own in blocks:
            by_scope.setdefault(scope, []).append(own)
        for scope, owns in by_scope.items():
            await self.index.evict_engine(scope, self.replica, owns)
