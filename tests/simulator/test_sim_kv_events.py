"""KV events from the simulator: ZMQ PUB batches, replay, drops, restarts, and the index fed by them."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from simulator import Fleet
from simulator.cli import fleet_from_args, parser
from tests.simulator.tiny_tokenizer import train_tokenizer

zmq = pytest.importorskip("zmq")
pytest.importorskip("zmq.asyncio")
msgpack = pytest.importorskip("msgspec.msgpack")
pytest.importorskip("tokenizers")

from prefix_index import KvEventApplier, MemoryIndex, TokenChunker, decode_batch, scope_key  # noqa: E402
from simulator.kv_publisher import END_SEQ, encode_batch  # noqa: E402

# shared/reference/vllm-sglang-interfaces.md §1.4 (hashes from §2.6, tokens 100..115).
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
H1, H2 = 10428775992902877628, 8101442038445348984
PROMPT = (
    "You are a helpful assistant. Answer briefly and cite the document. The quick brown fox "
    "jumps over the lazy dog while the cat sleeps. Routing requests to the replica that holds "
    "the prefix saves prefill time."
)
WAIT_S = 5.0


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return train_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


class Subscriber:
    """A SUB socket on one replica's events, plus its replay socket (a DEALER)."""

    def __init__(self, endpoint: str, replay_endpoint: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint

    async def next(self, wait_s: float = WAIT_S) -> tuple[bytes, int, bytes]:
        # poll, then receive: cancelling a pending recv can lose the message it was getting
        if not await self.sub.poll(round(wait_s * 1000)):
            raise TimeoutError
        topic, seq, payload = await self.sub.recv_multipart(zmq.NOBLOCK)
        return topic, int.from_bytes(seq, "big"), payload

    async def live(self, http: httpx.AsyncClient, url: str) -> int:
        """Poll until the subscription is through (ZMQ's slow joiner): ask for an
        AllBlocksCleared batch until one arrives; returns its sequence number."""
        async with asyncio.timeout(WAIT_S):
            while True:
                assert (await http.post(url + "/reset_prefix_cache")).status_code == 200
                try:
                    _topic, seq, payload = await self.next(0.1)
                except TimeoutError:
                    continue
                raw = msgpack.decode(payload)
                if any(_tag(e) == "AllBlocksCleared" for e in raw[1]):
                    return seq

    async def replay(self, start: int) -> list[list[bytes]]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            out = []
            async with asyncio.timeout(WAIT_S):
                while True:
                    frames = await dealer.recv_multipart()
                    out.append(frames)
                    if END_SEQ in frames:
                        return out
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


def _tag(event: Any) -> str:
    return str(event[0] if isinstance(event, list) else event["type"])


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10.0) as client:
        yield client


async def complete(http: httpx.AsyncClient, url: str, prompt: Any, max_tokens: int = 2) -> Any:
    r = await http.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    return r.json()


async def collect(sub: Subscriber, until: Any) -> list[tuple[int, Any]]:
    """(seq, decoded batch) until `until(events so far)` holds."""
    got: list[tuple[int, Any]] = []
    events: list[Any] = []
    async with asyncio.timeout(WAIT_S):
        while not until(events):
            _topic, seq, payload = await sub.next()
            raw = msgpack.decode(payload)
            got.append((seq, raw))
            events.extend(raw[1])
    return got


def stored_tokens(events: list[Any]) -> list[int]:
    out: list[int] = []
    for e in events:
        if _tag(e) == "BlockStored":
            out.extend(e[3] if isinstance(e, list) else e["token_ids"])
    return out


# -- encodings ----------------------------------------------------------------------------


@pytest.mark.parametrize(("encoding", "fixture"), [("legacy", LEGACY_HEX), ("map", MAP_HEX)])
def test_batches_are_byte_identical_to_the_reference_fixtures(encoding: str, fixture: str) -> None:
    events = [("stored", [H1], None, list(range(100, 116))), ("removed", H2), ("cleared",)]
    assert encode_batch(events, encoding, 16, ts=1700000000.5) == bytes.fromhex(fixture)


# -- a live replica -------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["legacy", "map"])
async def test_block_stored_carries_the_prompt_tokens(
    encoding: str, tokenizer_path: str, http: httpx.AsyncClient
) -> None:
    async with Fleet(n=1, speedup=1000.0, tokenizer=tokenizer_path, kv_events_port=0,
                     kv_events_encoding=encoding) as fleet:  # fmt: skip
        url = fleet.urls[0]
        sub = Subscriber(*fleet.kv_event_endpoints[0])
        try:
            first = await sub.live(http, url)
            ids = TokenChunker(tokenizer_path).encode(PROMPT)  # the gateway's ids, same file
            r = await http.post(url + "/tokenize", json={"prompt": PROMPT})
            assert r.json()["tokens"] == ids
            full = len(ids) // 16 * 16
            await complete(http, url, PROMPT)
            got = await collect(sub, lambda ev: len(stored_tokens(ev)) >= full)
        finally:
            sub.close()
    assert [seq for seq, _ in got] == list(range(first + 1, first + 1 + len(got)))
    events = [e for _seq, raw in got for e in raw[1]]
    assert stored_tokens(events)[:full] == ids[:full]
    first_stored = next(e for e in events if _tag(e) == "BlockStored")
    if encoding == "legacy":
        assert isinstance(first_stored, list) and len(first_stored) == 7
        assert first_stored[2] is None and first_stored[4:] == [16, None, "GPU"]
    else:
        assert list(first_stored) == [
            "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
            "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
        ]  # fmt: skip
        assert first_stored["parent_block_hash"] is None
    assert all(len(raw) == 3 and raw[2] == 0 for _seq, raw in got)


async def test_eviction_publishes_block_removed(http: httpx.AsyncClient) -> None:
    async with Fleet(n=1, speedup=1000.0, kv_events_port=0, num_gpu_blocks=8,
                     max_model_len=128) as fleet:  # fmt: skip
        url = fleet.urls[0]
        sub = Subscriber(*fleet.kv_event_endpoints[0])
        try:
            await sub.live(http, url)
            await complete(http, url, list(range(1000, 1064)), max_tokens=1)  # 4 blocks
            a = await collect(sub, lambda ev: len(stored_tokens(ev)) >= 64)
            stored_a = [h for _s, raw in a for e in raw[1] if e["type"] == "BlockStored"
                        for h in e["block_hashes"]]  # fmt: skip
            await complete(http, url, list(range(2000, 2112)), max_tokens=1)  # 7 blocks
            b = await collect(sub, lambda ev: sum(e["type"] == "BlockRemoved" for e in ev) >= 3)
        finally:
            sub.close()
    removed = [h for _s, raw in b for e in raw[1] if e["type"] == "BlockRemoved"
               for h in e["block_hashes"]]  # fmt: skip
    assert len(stored_a) == 4 and set(removed) <= set(stored_a) and len(removed) >= 3
    assert all(e["medium"] == "GPU" for _s, raw in b for e in raw[1])


@pytest.mark.parametrize("encoding", ["legacy", "map"])
async def test_replay_fills_a_dropped_gap(encoding: str, http: httpx.AsyncClient) -> None:
    async with Fleet(n=1, speedup=1000.0, kv_events_port=0, kv_events_encoding=encoding) as fleet:
        url = fleet.urls[0]
        sub = Subscriber(*fleet.kv_event_endpoints[0])
        try:
            first = await sub.live(http, url)
            r = await http.post(url + "/sim/kv_events", json={"drop": 2})
            assert r.json()["drop_remaining"] == 2
            for _ in range(3):
                await http.post(url + "/reset_prefix_cache")
            _topic, seq, payload = await sub.next()
            assert seq == first + 3  # two batches never reached us
            frames = await sub.replay(first + 1)
            state = (await http.get(url + "/sim/kv_events")).json()
        finally:
            sub.close()
    if encoding == "map":  # vLLM >= 0.26: [b"", topic, seq, payload], end [b"", b"", -1, b""]
        assert frames[-1] == [b"", b"", END_SEQ, b""]
        assert all(f[0] == b"" and f[1] == b"" for f in frames[:-1])
        data = [(int.from_bytes(f[2], "big"), f[3]) for f in frames[:-1]]
    else:  # vLLM <= 0.25: [b"", seq, payload], end [b"", -1, b""]
        assert frames[-1] == [b"", END_SEQ, b""]
        data = [(int.from_bytes(f[1], "big"), f[2]) for f in frames[:-1]]
    assert [s for s, _ in data] == [first + 1, first + 2, first + 3]
    assert data[-1][1] == payload
    assert all(decode_batch(p).events for _s, p in data)
    assert state["dropped"] == 2 and state["drop_remaining"] == 0 and state["replays"] == 1


async def test_a_drop_outside_the_replay_buffer_leaves_a_gap(http: httpx.AsyncClient) -> None:
    async with Fleet(n=1, speedup=1000.0, kv_events_port=0) as fleet:
        url = fleet.urls[0]
        sub = Subscriber(*fleet.kv_event_endpoints[0])
        try:
            first = await sub.live(http, url)
            await http.post(url + "/sim/kv_events", json={"drop": 1, "replayable": False})
            await http.post(url + "/reset_prefix_cache")
            await http.post(url + "/reset_prefix_cache")
            _t, seq, _p = await sub.next()
            frames = await sub.replay(first + 1)
        finally:
            sub.close()
    assert seq == first + 2
    assert [int.from_bytes(f[2], "big") for f in frames[:-1]] == [first + 2]


async def test_a_restarted_replica_counts_from_zero_again(http: httpx.AsyncClient) -> None:
    async with Fleet(n=2, speedup=1000.0, kv_events_port=0) as fleet:
        before = fleet.kv_event_endpoints[1]
        sub = Subscriber(*before)
        try:
            await sub.live(http, fleet.urls[1])
            await sub.live(http, fleet.urls[1])  # seq is past 0 now
            await fleet.stop(1)
            await fleet.start(1)
            assert fleet.kv_event_endpoints[1] == before
            seq = await sub.live(http, fleet.urls[1])  # the SUB reconnects by itself
        finally:
            sub.close()
    assert seq < 5  # a fresh publisher (a probe or two may be lost while reconnecting)


async def test_the_kv_events_endpoints(http: httpx.AsyncClient) -> None:
    async with Fleet(n=1, speedup=1000.0) as fleet:
        url = fleet.urls[0]
        assert (await http.get(url + "/sim/kv_events")).status_code == 404
        assert (await http.get(url + "/kv_event_sources")).json() == {}
        assert (await http.post(url + "/reset_prefix_cache")).status_code == 200
    async with Fleet(n=1, speedup=1000.0, kv_events_port=0) as fleet:
        url = fleet.urls[0]
        for bad in ({"drop": -1}, {"drop": True}, {"drop": 1, "replayable": 1}, {"x": 1}, []):
            assert (await http.post(url + "/sim/kv_events", json=bad)).status_code == 400
        sources = (await http.get(url + "/kv_event_sources")).json()
        assert sources["0"]["endpoint"] == fleet.kv_event_endpoints[0][0]
        assert sources["0"]["replay_endpoint"] == fleet.kv_event_endpoints[0][1]


def test_cli_flags_map_to_fleet_options(tokenizer_path: str) -> None:
    args = parser().parse_args(["--replicas", "2", "--kv-events-port", "5557",
                                "--kv-events-encoding", "legacy", "--tokenizer", tokenizer_path])
    fleet = fleet_from_args(args)
    assert fleet.kv_events is not None
    assert [(o.port, o.replay_port, o.encoding) for o in fleet.kv_events] == [
        (5557, 5558, "legacy"), (5559, 5560, "legacy")]  # fmt: skip
    assert fleet.tokenizer is not None and fleet.tokenizer.encode("hi") != []
    assert fleet_from_args(parser().parse_args([])).kv_events is None


def test_without_kv_events_zmq_is_never_imported() -> None:
    code = """
import asyncio, sys, httpx
from simulator import Fleet
import simulator.cli
async def main():
    async with Fleet(n=1, speedup=1000.0) as f:
        async with httpx.AsyncClient() as c:
            r = await c.post(f.urls[0] + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200
asyncio.run(main())
print(sorted(m for m in ("zmq", "msgspec") if m in sys.modules))
"""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         timeout=60, env={"PYTHONPATH": str(root), "PATH": ""})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().replace("'", '"')) == []


# -- the index, fed by a replica's events ---------------------------------------------------


async def feed(sub: Subscriber, applier: KvEventApplier, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            _topic, _seq, payload = await sub.next(0.05)
        except TimeoutError:
            continue
        await applier.apply(decode_batch(payload))


async def wait_for(predicate: Any) -> None:
    async with asyncio.timeout(WAIT_S):
        while not predicate():  # noqa: ASYNC110 - polls what another task changes
            await asyncio.sleep(0.01)



@pytest.mark.parametrize("parity", [True, False])
async def test_the_index_learns_exactly_what_the_replica_stored(
    parity: bool, tokenizer_path: str, http: httpx.AsyncClient
) -> None:
    """Same tokenizer file on both sides: the events land on the request's own hashes. A
    replica with another tokenizer (parity broken on purpose) stores blocks no request of the
    gateway hashes to."""
    chunker = TokenChunker(tokenizer_path)
    scope = scope_key("qwen2.5-14b")
    index = MemoryIndex()
    async with Fleet(n=2, speedup=1000.0, kv_events_port=0,
                     tokenizer=tokenizer_path if parity else None) as fleet:  # fmt: skip
        names = ["r0", "r1"]
        subs = [Subscriber(*ep) for ep in fleet.kv_event_endpoints]
        appliers = [KvEventApplier(index, chunker, lambda lora: scope, n) for n in names]
        stop = asyncio.Event()
        tasks: list[asyncio.Task[None]] = []
        try:
            for s, u in zip(subs, fleet.urls, strict=True):
                await s.live(http, u)
            for n in names:
                index.set_precise(n)
            for s, a in zip(subs, appliers, strict=True):
                tasks.append(asyncio.create_task(feed(s, a, stop)))
            hashes = chunker.hash_text(scope, PROMPT)
            r = await http.post(fleet.urls[0] + "/tokenize", json={"prompt": PROMPT})
            engine_blocks = r.json()["count"] // 16  # what the replica will report stored
            await complete(http, fleet.urls[0], PROMPT)
            await wait_for(lambda: appliers[0].counts.stored >= engine_blocks)
            got = await index.match(scope, hashes, names)
        finally:
            stop.set()
            await asyncio.gather(*tasks)
            for s in subs:
                s.close()
    if parity:
        assert got == {"r0": len(hashes), "r1": 0}
        assert appliers[0].counts.unknown_parent == 0 and appliers[0].counts.mismatched == 0
    else:
        assert got == {"r0": 0, "r1": 0} and engine_blocks > 0
