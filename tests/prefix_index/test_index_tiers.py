"""Tiered KV in the index: `medium` of both engines' encodings (byte-exact fixtures), the
applier's lower-tier path, placeholder and unknown media counted, and `match_tiers` (on both
backends: the redis one keeps tiers in the gateway's process, beside its engine entries)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from prefix_index import ByteChunker, EngineEventSink, MemoryIndex, scope_key
from prefix_index.events import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEventApplier,
    decode_batch,
)
from prefix_index.tiers import CPU, DISK, GPU, SHARED, TierStore, normalize_medium
from tests.prefix_index.conftest import BACKENDS

pytest.importorskip("msgspec.msgpack")

# Generated with msgspec.msgpack from the shapes of docs/tiers.md (reference §4.1-4.2).
# vLLM map form, self-describing CPU event (OffloadingConnector, self_describing_kv_events):
VLLM_CPU_HEX = (
    "93cb41d954fc40200000918ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cf"
    "90ba7482f31901bcb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc001064656667"
    "68696a6b6c6d6e6f70717273aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da3435055"
    "a96c6f72615f6e616d65c0aa65787472615f6b65797391c0a967726f75705f69647800b26b765f6361636865"
    "5f737065635f6b696e64ae66756c6c5f617474656e74696f6e00"
)
# vLLM array form: a legacy placeholder CPU BlockStored (one key, no tokens, block_size 0) and
# a CPU BlockRemoved
VLLM_PLACEHOLDER_HEX = (
    "93cb41d954fc402000009297ab426c6f636b53746f726564914dc09000c0a343505593ac426c6f636b52656d"
    "6f76656491cf90ba7482f31901bca343505500"
)
# SGLang array form (signed int64 hashes, no dp_rank): CPU_PINNED, EXTERNAL, an unknown medium
SGLANG_HEX = (
    "92cb41d954fc402000009397ab426c6f636b53746f72656491d390ba7482f31901b0c0dc0010646566676869"
    "6a6b6c6d6e6f7071727310c0aa4350555f50494e4e454497ab426c6f636b53746f72656491d390ba7482f319"
    "01b0c0dc00106465666768696a6b6c6d6e6f7071727310c0a845585445524e414c97ab426c6f636b53746f72"
    "65649105c0dc00106465666768696a6b6c6d6e6f7071727310c0ab4e564c494e4b5f504f4f4c"
)
H1 = 10428775992902877628
TOKENS = list(range(100, 116))
S = scope_key("model")
CHUNKER = ByteChunker()
OWN1 = CHUNKER.hash_tokens(S, TOKENS)


def test_vllm_self_describing_cpu_event_decodes() -> None:
    payload = bytes.fromhex(VLLM_CPU_HEX)
    assert len(payload) == 202
    (ev,) = decode_batch(payload).events
    assert isinstance(ev, BlockStored)
    assert (ev.block_hashes, ev.token_ids, ev.block_size, ev.medium) == ([H1], TOKENS, 16, "CPU")


def test_vllm_placeholder_event_decodes_with_no_tokens() -> None:
    stored, removed = decode_batch(bytes.fromhex(VLLM_PLACEHOLDER_HEX)).events
    assert stored == BlockStored([77], None, [], 0, medium="CPU")
    assert removed == BlockRemoved([H1], medium="CPU")


def test_a_block_size_of_zero_with_tokens_is_malformed() -> None:
    import msgspec

    bad = ["BlockStored", [1], None, TOKENS, 0, None, "CPU"]
    assert decode_batch(msgspec.msgpack.encode([0.0, [bad]])).skipped == 1


def test_sglang_media_decode() -> None:
    batch = decode_batch(bytes.fromhex(SGLANG_HEX))
    assert batch.dp_rank is None
    assert [e.medium for e in batch.events if isinstance(e, BlockStored)] == [
        "CPU_PINNED", "EXTERNAL", "NVLINK_POOL",
    ]  # fmt: skip
    assert batch.events[0].block_hashes == [(-8017968080806674000) & ((1 << 64) - 1)]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("medium", "tier"),
    [
        (None, GPU), ("GPU", GPU), ("gpu", GPU), ("CPU", CPU), ("cpu_pinned", CPU),
        ("CPU_PINNED", CPU), ("STORAGE", DISK), ("DISK", DISK), ("EXTERNAL", SHARED),
        ("NVLINK_POOL", None), ("", None),
    ],
)  # fmt: skip
def test_media_normalise(medium: str | None, tier: str | None) -> None:
    assert normalize_medium(medium) == tier


def applier(index: EngineEventSink, replica: str = "r1") -> KvEventApplier:
    return KvEventApplier(index, CHUNKER, lambda lora: S, replica)


@pytest.fixture(params=BACKENDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_fixtures_place_blocks_on_their_tiers(
    kind: str, make_index: Callable[..., Any]
) -> None:
    index = make_index(kind)
    vllm, sgl = applier(index, "v"), applier(index, "s")
    await vllm.apply(decode_batch(bytes.fromhex(VLLM_CPU_HEX)))
    await sgl.apply(decode_batch(bytes.fromhex(SGLANG_HEX)))
    assert await index.match(S, OWN1, ["v", "s", "x"]) == {"v": 0, "s": 0, "x": 0}  # no GPU
    tiers = index.match_tiers(S, OWN1, {"v": 0, "s": 0, "x": 0})
    assert tiers["v"] == {CPU: 1, DISK: 0, SHARED: 0}
    assert tiers["s"] == {CPU: 1, DISK: 0, SHARED: 0}  # CPU_PINNED counts before EXTERNAL
    assert tiers["x"] == {CPU: 0, DISK: 0, SHARED: 1}  # the shared store: any replica
    assert sgl.counts.unknown_medium == 1 and sgl.counts.stored == 0  # never taken for GPU
    assert sgl.counts.tier_stored == 2


async def test_placeholders_are_ignored_and_counted() -> None:
    index = MemoryIndex()
    app = applier(index)
    await app.apply(decode_batch(bytes.fromhex(VLLM_PLACEHOLDER_HEX)))
    assert app.counts.placeholder == 1 and app.counts.tier_stored == 0
    assert app.counts.unknown_removed == 1  # its removal names a block never placed
    assert index.tiers.counts() == {CPU: 0, DISK: 0, SHARED: 0}


async def test_a_spilled_chain_continues_on_the_cpu_tier(
    kind: str, make_index: Callable[..., Any]
) -> None:
    prompt = list(range(1000, 1000 + 16 * 4))
    own = CHUNKER.hash_tokens(S, prompt)
    index = make_index(kind)
    app = applier(index)
    gpu = BlockStored([1, 2, 3, 4], None, prompt, 16, medium="GPU")
    await app.apply(EventBatch(0.0, [gpu]))
    # blocks 2 and 3 leave the GPU for the CPU (the parent of the CPU run is a GPU block)
    spill = BlockStored([3, 4], 2, prompt[32:], 16, medium="CPU")
    await app.apply(EventBatch(0.0, [BlockRemoved([3, 4], "GPU"), spill]))
    assert await index.match(S, own, ["r1"]) == {"r1": 2}
    assert index.match_tiers(S, own, {"r1": 2}) == {"r1": {CPU: 2, DISK: 0, SHARED: 0}}
    # block 2 also spills: the CPU run now starts at block 1 and its parent is on the CPU
    await app.apply(EventBatch(0.0, [BlockRemoved([2], "GPU"),
                                     BlockStored([2], 1, prompt[16:32], 16, medium="CPU")]))  # fmt: skip
    assert await index.match(S, own, ["r1"]) == {"r1": 1}
    assert index.match_tiers(S, own, {"r1": 1}) == {"r1": {CPU: 3, DISK: 0, SHARED: 0}}
    await app.apply(EventBatch(0.0, [BlockRemoved([3], "CPU")]))  # a hole ends the run
    assert index.match_tiers(S, own, {"r1": 1}) == {"r1": {CPU: 1, DISK: 0, SHARED: 0}}
    assert app.counts.tier_removed == 1
    await index.forget("r1")
    assert index.match_tiers(S, own, {"r1": 0}) == {}


def test_tier_store_caps_and_keeps_the_shared_store_across_forget() -> None:
    store = TierStore(capacity=2)
    store.record(S, "a", CPU, [1, 2, 3])
    store.record(S, "a", SHARED, [1, 2])
    assert store.trimmed == 1
    # block 1 left a's CPU tier (the cap) but the shared store has it
    assert store.match(S, [1, 2, 3], {"a": 0}) == {"a": {CPU: 2, DISK: 0, SHARED: 1}}
    store.forget("a")
    assert store.match(S, [1, 2, 3], {"b": 0}) == {"b": {CPU: 0, DISK: 0, SHARED: 2}}


def test_each_block_counts_on_its_fastest_tier() -> None:
    store = TierStore(capacity=100)
    store.record(S, "a", DISK, [1, 2, 3])
    store.record(S, "a", CPU, [2])
    store.record(S, "z", SHARED, [3, 4])
    got = store.match(S, [0, 1, 2, 3, 4, 5], {"a": 1, "b": 3})
    assert got == {"a": {CPU: 1, DISK: 2, SHARED: 1}, "b": {CPU: 0, DISK: 0, SHARED: 2}}
