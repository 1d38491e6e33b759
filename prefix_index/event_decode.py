"""KV cache events from vLLM and SGLang: decode one published batch (both encodings).

vLLM's positional (array_like) and map forms, SGLang's; the applier is prefix_index/events.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeGuard

_U64 = (1 << 64) - 1

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
        if not _is_int(size) or size < 0 or (size == 0 and tokens):
            raise ValueError("block_size must be a positive int (0 only without token ids)")
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
