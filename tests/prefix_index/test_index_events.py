"""KV events: the decoder against the reference's byte-exact fixtures, and the applier."""

from __future__ import annotations

from typing import Any

import pytest

from prefix_index import ByteChunker, MemoryIndex, scope_key
from prefix_index.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBlockMap,
    EventBatch,
    EventDecodeError,
    KvEventApplier,
    decode_batch,
    engine_hash,
)

msgpack = pytest.importorskip("msgspec.msgpack")

# shared/reference/vllm-sglang-interfaces.md §1.4, generated with msgspec from vLLM's structs.
LEGACY_HEX = (
    "93cb41d954fc402000009397ab426c6f636b53746f72656491cf90ba7482f31901bcc0dc0010646566676869"
    "6a6b6c6d6e6f7071727310c0a347505593ac426c6f636b52656d6f76656491cf706e1a9c55f39878a3475055"
    "91b0416c6c426c6f636b73436c656172656400"
)
MAP_HEX = (
    "93cb41d954fc40200000938ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cf"
    "90ba7482f31901bcb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc001064656667"
    "68696a6b6c6d6e6f70717273aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da3475055"
    "a96c6f72615f6e616d65c0aa65787472615f6b65797391c0a967726f75705f69647800b26b765f6361636865"
    "5f737065635f6b696e64ae66756c6c5f617474656e74696f6e84a474797065ac426c6f636b52656d6f766564"
    "ac626c6f636b5f68617368657391cf706e1a9c55f39878a66d656469756da3475055a967726f75705f696478"
    "0081a474797065b0416c6c426c6f636b73436c656172656400"
)
H1, H2 = 10428775992902877628, 8101442038445348984  # §2.6: the two blocks' event ints
TOKENS = list(range(100, 116))
S = scope_key("model")


def test_the_legacy_fixture_decodes() -> None:
    payload = bytes.fromhex(LEGACY_HEX)
    assert len(payload) == 107
    batch = decode_batch(payload)
    assert batch == EventBatch(
        ts=1700000000.5,
        events=[
            BlockStored([H1], None, TOKENS, 16, lora_id=None, medium="GPU"),
            BlockRemoved([H2], medium="GPU"),
            AllBlocksCleared(),
        ],
        dp_rank=0,
    )


def test_the_map_fixture_decodes() -> None:
    payload = bytes.fromhex(MAP_HEX)
    assert len(payload) == 289
    batch = decode_batch(payload)
    assert batch == EventBatch(
        ts=1700000000.5,
        events=[
            BlockStored(
                [H1],
                None,
                TOKENS,
                16,
                medium="GPU",
                extra_keys=[None],
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            ),
            BlockRemoved([H2], medium="GPU", group_idx=0),
            AllBlocksCleared(),
        ],
        dp_rank=0,
    )


def test_batches_without_dp_rank_and_integer_timestamps() -> None:
    payload = msgpack.encode([17, [["AllBlocksCleared"]]])
    assert decode_batch(payload) == EventBatch(17.0, [AllBlocksCleared()], None)
    assert decode_batch(msgpack.encode([1.5, [], None])).dp_rank is None


def test_sglang_signed_int64_and_bytes_hashes() -> None:
    digest = bytes(range(32))  # a raw 32-byte digest: its last 8 bytes, big-endian
    events: list[Any] = [
        {  # SGLang >= 0.5.20: maps, one block per event, signed int64 hashes
            "type": "BlockStored",
            "block_hashes": [-2],
            "parent_block_hash": -(1 << 63),
            "token_ids": TOKENS,
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "cache_salt": None,
            "session_id": None,
            "lora_name": None,
        },
        ["BlockStored", [digest], digest, TOKENS, 16, None, None],  # positional, bytes
        ["BlockRemoved", [-1]],  # a positional event older than `medium`
    ]
    batch = decode_batch(msgpack.encode([2.0, events, None]))
    stored, raw, removed = batch.events
    assert isinstance(stored, BlockStored) and isinstance(raw, BlockStored)
    assert stored.block_hashes == [(1 << 64) - 2]
    assert stored.parent_block_hash == 1 << 63
    assert raw.block_hashes == [int.from_bytes(digest[-8:], "big")]
    assert raw.parent_block_hash == raw.block_hashes[0]
    assert removed == BlockRemoved([(1 << 64) - 1], medium=None)
    assert batch.dp_rank is None


def test_unknown_and_malformed_events_are_skipped_and_counted() -> None:
    events: list[Any] = [
        ["BlockStored", [1], None, TOKENS, 16, None, "GPU"],
        ["SomethingNew", 1, 2],
        {"type": "Future", "x": 1},
        {"no_type": True},
        ["BlockStored", "not a list", None, TOKENS, 16],
        {"type": "BlockRemoved", "block_hashes": [1.5]},
        42,
        ["AllBlocksCleared"],
    ]
    batch = decode_batch(msgpack.encode([1.0, events, 3]))
    assert [type(e).__name__ for e in batch.events] == ["BlockStored", "AllBlocksCleared"]
    assert batch.skipped == 6 and batch.dp_rank == 3


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xc1", msgpack.encode({"ts": 1}), msgpack.encode([1.0]), msgpack.encode(["x", []])],
)
def test_a_payload_that_is_no_batch_raises(payload: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_batch(payload)


def test_engine_hash_forms() -> None:
    assert engine_hash((1 << 64) - 1) == (1 << 64) - 1
    assert engine_hash(-1) == (1 << 64) - 1
    assert engine_hash(b"\x01\x02") == 0x0102
    assert engine_hash(bytes(24) + b"\x00\x00\x00\x00\x00\x00\x01\x00") == 256
    for bad in (True, 1.0, "ab", b""):
        with pytest.raises(ValueError):
            engine_hash(bad)


# -- the applier ------------------------------------------------------------------------------

CHUNKER = ByteChunker()  # token blocks of 16, the same chain as TokenChunker(block_size=16)
PROMPT = list(range(1000, 1000 + 16 * 6))  # six blocks
OWN = CHUNKER.hash_tokens(S, PROMPT)


def eh(i: int) -> int:
    """A stand-in engine hash of block i: unrelated to the gateway's own hashes."""
    return 0xE000_0000_0000_0000 + i


def stored(first: int, last: int, *, parent: bool = True, **kw: Any) -> BlockStored:
    """BlockStored for blocks first..last-1 of PROMPT."""
    return BlockStored(
        [eh(i) for i in range(first, last)],
        eh(first - 1) if parent and first else None,
        PROMPT[first * 16 : last * 16],
        16,
        **{"medium": "GPU", **kw},
    )


def batch(*events: Any) -> EventBatch:
    return EventBatch(0.0, list(events))


def applier(index: MemoryIndex, replica: str = "r1", **kw: Any) -> KvEventApplier:
    lora_scopes = {None: S, "ad": scope_key("model", "ad")}
    return KvEventApplier(index, CHUNKER, lora_scopes.get, replica, **kw)


async def test_stored_blocks_line_up_with_request_hashes() -> None:
    index = MemoryIndex()
    app = applier(index)
    await app.apply(batch(stored(0, 2)))
    await app.apply(batch(stored(2, 5)))  # continues the chain through the engine->own map
    assert await index.match(S, OWN, ["r1", "r2"]) == {"r1": 5, "r2": 0}
    assert app.counts.stored == 5 and len(app.blocks) == 5
    assert app.blocks.get(eh(3)) == (S, OWN[3])


async def test_removed_blocks_leave_through_the_map() -> None:
    index = MemoryIndex()
    app = applier(index)
    await app.apply(batch(stored(0, 5)))
    await app.apply(batch(BlockRemoved([eh(4)], "GPU"), BlockRemoved([eh(2)], "GPU")))
    assert await index.match(S, OWN, ["r1"]) == {"r1": 2}
    await app.apply(batch(BlockRemoved([eh(2), 12345], "GPU")))  # already gone, never seen
    assert app.counts.removed == 2 and app.counts.unknown_removed == 2


async def test_a_block_whose_parent_is_unknown_is_counted_and_skipped() -> None:
    index = MemoryIndex()
    app = applier(index)
    await app.apply(batch(stored(2, 4)))
    assert await index.match(S, OWN, ["r1"]) == {"r1": 0}
    assert app.counts.unknown_parent == 2 and app.counts.stored == 0
    await app.apply(batch(stored(4, 5)))  # its parent was never placed either
    assert app.counts.unknown_parent == 3


async def test_all_blocks_cleared_forgets_both_sources() -> None:
    index = MemoryIndex()
    index.set_precise("r1")
    app = applier(index)
    await index.record(S, "r1", OWN)
    await app.apply(batch(stored(0, 3)))
    await app.apply(batch(AllBlocksCleared()))
    assert await index.match(S, OWN, ["r1"]) == {"r1": 0}
    assert len(app.blocks) == 0 and app.counts.cleared == 1 and app.counts.resets == 1
    await app.apply(batch(stored(0, 1)))  # learning starts again from the root
    assert await index.match(S, OWN, ["r1"]) == {"r1": 1}


async def test_only_gpu_full_attention_blocks_count() -> None:
    index = MemoryIndex()
    app = applier(index)
    await app.apply(batch(stored(0, 2, medium="CPU"), stored(0, 2, medium=None)))
    assert app.counts.tier_stored == 2 and app.counts.stored == 2  # CPU: a lower tier
    sliding = stored(2, 4, group_idx=1, kv_cache_spec_kind="sliding_window")
    await app.apply(batch(sliding, stored(2, 4, group_idx=0, kv_cache_spec_kind="full_attention")))
    await app.apply(batch(BlockRemoved([eh(3)], "GPU", group_idx=1)))  # the sliding copy
    await app.apply(batch(BlockRemoved([eh(1)], "CPU")))  # an offloaded copy
    assert await index.match(S, OWN, ["r1"]) == {"r1": 4}
    assert app.counts.other_group == 3 and app.counts.tier_removed == 1


async def test_a_hash_stored_twice_goes_when_both_copies_go() -> None:
    index = MemoryIndex()
    app = applier(index)
    await app.apply(batch(stored(0, 2), stored(1, 2)))
    await app.apply(batch(BlockRemoved([eh(1)], "GPU")))
    assert await index.match(S, OWN, ["r1"]) == {"r1": 2}
    await app.apply(batch(BlockRemoved([eh(1)], "GPU")))
    assert await index.match(S, OWN, ["r1"]) == {"r1": 1}


async def test_adapters_salts_and_extra_keys_pick_or_refuse_a_scope() -> None:
    index = MemoryIndex()
    app = applier(index)
    lora = scope_key("model", "ad")
    await app.apply(batch(stored(0, 2, lora_name="ad", extra_keys=[["ad"], ["ad"]])))
    assert await index.match(lora, CHUNKER.hash_tokens(lora, PROMPT), ["r1"]) == {"r1": 2}
    assert await index.match(S, OWN, ["r1"]) == {"r1": 0}
    await app.apply(batch(stored(0, 1, lora_name="unknown-adapter")))
    await app.apply(batch(stored(0, 1, lora_id=7)))  # an id without a name: no scope
    await app.apply(batch(stored(0, 1, cache_salt="tenant-a")))
    await app.apply(batch(stored(0, 3, extra_keys=[None, None, ["mm-digest", 0]])))
    assert app.counts.unscoped == 4
    assert await index.match(S, OWN, ["r1"]) == {"r1": 2}  # the blocks before the image


async def test_blocks_that_do_not_cut_at_our_block_size_are_counted() -> None:
    index = MemoryIndex()
    app = applier(index)
    big = BlockStored([eh(0)], None, PROMPT[:32], 32, medium="GPU")
    short = BlockStored([eh(0), eh(1)], None, PROMPT[:24], 16, medium="GPU")
    await app.apply(batch(big, short))
    assert app.counts.mismatched == 3 and app.counts.stored == 0


async def test_signed_engine_hashes_resolve_like_unsigned_ones() -> None:
    index = MemoryIndex()
    app = applier(index)
    events = [
        {"type": "BlockStored", "block_hashes": [-5], "parent_block_hash": None,
         "token_ids": PROMPT[:16], "block_size": 16, "lora_id": None, "medium": "GPU"},
        {"type": "BlockStored", "block_hashes": [-6], "parent_block_hash": -5,
         "token_ids": PROMPT[16:32], "block_size": 16, "lora_id": None, "medium": "GPU"},
    ]  # fmt: skip
    await app.apply(decode_batch(msgpack.encode([1.0, events, None])))
    assert await index.match(S, OWN, ["r1"]) == {"r1": 2}
    await app.apply(decode_batch(msgpack.encode([1.0, [["BlockRemoved", [-6], "GPU"]]])))
    assert await index.match(S, OWN, ["r1"]) == {"r1": 1}


async def test_the_map_cap_evicts_what_it_pushes_out() -> None:
    index = MemoryIndex()
    app = applier(index, blocks=EngineBlockMap(capacity=3))
    await app.apply(batch(stored(0, 4)))
    assert len(app.blocks) == 3 and app.counts.overflowed == 1
    assert await index.match(S, OWN, ["r1"]) == {"r1": 0}  # block 0 left with its map entry
    stats = index.stats_now()
    assert stats.engine_blocks_per_replica == {"r1": 3}


async def test_undecoded_events_are_counted() -> None:
    index = MemoryIndex()
    app = applier(index)
    payload = msgpack.encode([1.0, [["Nope"], ["AllBlocksCleared"]], 0])
    await app.apply(decode_batch(payload))
    assert app.counts.undecoded == 1 and app.counts.batches == 1
