"""Precise routing end to end: simulated replicas publish KV events, the gateway's index follows them."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway import create_app, parse_config
from prefix_index.chunking import scope_key
from simulator import Fleet
from tests.simulator.tiny_tokenizer import train_tokenizer
from tests.support import poll_until, start_server

pytest.importorskip("zmq")

MODEL = "qwen2.5-14b"
PROMPT = "You are a helpful assistant. Answer briefly and cite the document. " * 12


def gateway_config(fleet: Fleet, tokenizer: str, **index: Any) -> Any:
    replicas = [
        {"url": url, "name": f"r{i}", "kv_events": pub, "kv_events_replay": replay}
        for i, (url, (pub, replay)) in enumerate(
            zip(fleet.urls, fleet.kv_event_endpoints, strict=True)
        )
    ]
    return parse_config(
        {
            "pools": {
                "chat": {
                    "replicas": replicas,
                    "policy": "prefix_aware",
                    "scrape": {"interval_s": 0.2},
                }
            },
            "index": {
                "chunking": {
                    "mode": "tokens",
                    "tokenizer": tokenizer,
                    "block_size": 16,
                    "chat_template": "chatml",
                },
                "events": {"enabled": True, "routed_ttl_s": 0.5},
                **index,
            },
        }
    )


async def engine_blocks(app: Any, replica: str) -> int:
    st = app.gateway.index.stats_now()
    return int(st.engine_blocks_per_replica.get(replica, 0))


async def test_events_drive_the_index_gaps_replay_and_restarts_forget(tmp_path: Path) -> None:
    tok = train_tokenizer(tmp_path / "tok.json")
    async with Fleet(n=2, speedup=1000.0, kv_events_port=0, tokenizer=tok) as fleet:
        app = create_app(gateway_config(fleet, tok))
        gw = await start_server(app, lifespan="on")
        try:
            await poll_until(
                lambda: app.gateway.parity.get("r0") == 1 and app.gateway.parity.get("r1") == 1
            )
            kv = app.gateway.kv_events
            await poll_until(lambda: kv is not None and len(kv.subscribers) == 2)
            async with httpx.AsyncClient(timeout=10) as h:
                res = await h.post(
                    gw.url + "/v1/completions",
                    json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4},
                )
                assert res.status_code == 200
                # the engine's BlockStored events land on the gateway's own hashes
                scope = scope_key(MODEL)
                hashes = app.gateway.chunker.hash_text(scope, PROMPT)
                await poll_until(lambda: any(s.stats.applied for s in kv.subscribers.values()))
                await poll_until(
                    lambda: (
                        kv.subscribers["r0"].applier.counts.stored
                        + kv.subscribers["r1"].applier.counts.stored
                        >= len(hashes)
                    )
                )
                got = await app.gateway.index.match(scope, hashes, ["r0", "r1"])
                holder = max(got, key=got.get)
                assert got[holder] == len(hashes) and min(got.values()) == 0, got
                # a chat request in ChatML renders to what the engine prefills, so it hashes alike too
                msgs = [{"role": "system", "content": PROMPT}, {"role": "user", "content": "hi"}]
                res = await h.post(
                    gw.url + "/v1/chat/completions",
                    json={"model": MODEL, "messages": msgs, "max_tokens": 2},
                )
                assert res.status_code == 200
                # a dropped batch is a gap the replay socket fills: nothing is forgotten
                i = int(holder[1])
                await h.post(fleet.urls[i] + "/sim/kv_events", json={"drop": 1})
                for k in range(3):  # each stores new blocks; the first batch is the dropped one
                    await h.post(
                        fleet.urls[i] + "/v1/completions",
                        json={"prompt": f"distinct prompt number {k} " * 10, "max_tokens": 2},
                    )
                sub = kv.subscribers[holder]
                await poll_until(lambda: sub.stats.gaps >= 1)
                assert (
                    sub.stats.replays >= 2 and sub.stats.forgets == 0
                )  # the catch-up replay + the gap's
                # a restarted engine counts from 0 again: the gateway forgets what it held
                await fleet.stop(i)
                await fleet.start(i)
                for k in range(50):  # the subscriber reconnects by itself; traffic makes events
                    if sub.stats.restarts:
                        break
                    await h.post(
                        fleet.urls[i] + "/v1/completions",
                        json={"prompt": f"fresh start {k} " * 20, "max_tokens": 2},
                    )
                    await asyncio.sleep(0.1)
                assert sub.stats.restarts >= 1 and sub.stats.forgets >= 1
                got = await app.gateway.index.match(scope, hashes, [holder])
                assert got[holder] == 0
                metrics = (await h.get(gw.url + "/metrics")).text
                assert 'gateway_kv_events_applied_total{replica="r0"}' in metrics
                assert 'gateway_token_parity{replica="r0"} 1.0' in metrics
        finally:
            await gw.stop()


async def test_broken_token_parity_falls_back_to_bytes_mode(tmp_path: Path) -> None:
    ours = train_tokenizer(tmp_path / "ours.json")
    theirs = train_tokenizer(tmp_path / "theirs.json", vocab_size=300)  # another vocabulary
    async with Fleet(n=1, speedup=1000.0, kv_events_port=0, tokenizer=theirs) as fleet:
        app = create_app(gateway_config(fleet, ours))
        gw = await start_server(app, lifespan="on")
        try:
            await poll_until(lambda: app.gateway.parity.get("r0") == 0)
            await poll_until(lambda: app.gateway.chunker.mode == "bytes")
            async with httpx.AsyncClient(timeout=10) as h:
                res = await h.post(
                    gw.url + "/v1/completions",
                    json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2},
                )
                assert res.status_code == 200
                assert (
                    'gateway_token_parity{replica="r0"} 0.0'
                    in (await h.get(gw.url + "/metrics")).text
                )
        finally:
            await gw.stop()


def test_events_need_tokens_mode() -> None:
    from gateway.config import ConfigError

    base = {"pools": {"chat": {"replicas": ["http://a:1"]}}}
    with pytest.raises(ConfigError) as info:
        parse_config({**base, "index": {"events": {"enabled": True}}})
    assert info.value.problems[0].startswith(
        "index.events.enabled: KV events require chunking.mode: tokens"
    )


async def test_live_batches_the_start_up_replay_gave_are_duplicates_not_a_restart() -> None:
    """Seen on real vLLM: a subscriber's start-up replay and its live socket overlap, so the
    last replayed batch arrives again live. That is a duplicate, skipped; only a sequence that
    goes back below what the replay gave is the engine starting over."""
    import msgspec

    from gateway.fleet.kv_events import KvEventSubscriber

    class Applier:
        def __init__(self) -> None:
            self.applied: list[float] = []
            self.resets = 0

        async def apply(self, batch: Any) -> None:
            self.applied.append(batch.ts)

        async def reset(self) -> None:
            self.resets += 1

    def frames(seq: int) -> list[bytes]:
        return [b"kv", seq.to_bytes(8, "big"), msgspec.msgpack.encode([float(seq), []])]

    applier = Applier()
    sub = KvEventSubscriber("r0", "tcp://127.0.0.1:1", None, applier, None)  # type: ignore[arg-type]
    for seq in range(4):  # what the replay applied
        await sub._apply(seq, frames(seq)[-1])
    sub._replayed_to = 3
    for seq in (2, 3, 4, 4, 5):  # live: two the replay gave, then new ones (4 twice: a repeat)
        await sub._handle(frames(seq))
    assert applier.applied == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and applier.resets == 0
    assert (sub.stats.duplicates, sub.stats.restarts) == (3, 0)
    await sub._handle(frames(0))  # the engine started over
    assert (sub.stats.restarts, applier.resets) == (1, 1) and applier.applied[-1] == 0.0
