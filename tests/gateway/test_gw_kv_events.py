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


# --- the caught-up gauge tells the truth (issue 39) ---------------------------------------------
class HeldRelay:
    """A TCP relay in front of a replica's replay socket: while `held`, it takes connections and
    sends nothing (a replay that never answers); once opened, new connections reach `target`."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target = (host, int(port))
        self.held = True
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        return f"tcp://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.held:
            await reader.read()  # until the subscriber gives up and closes its socket
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(*self.target)

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
            w.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer),
                             return_exceptions=True)  # fmt: skip

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()


def caught_up(metrics: str, replica: str) -> float:
    line = f'gateway_kv_events_caught_up{{replica="{replica}"}} '
    return float(next(x for x in metrics.splitlines() if x.startswith(line)).split()[-1])


async def test_a_replay_that_times_out_reads_not_caught_up_and_the_blocks_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start-up replay does not answer: the gauge reads 0 (it read 1) and the index routes
    the replica as one without KV events (routed learning, `index.ttl_s`); when a later replay
    answers, it reads 1 and the replica is precise again."""
    from gateway.fleet import kv_events

    monkeypatch.setattr(kv_events, "REPLAY_TIMEOUT_MS", 300)
    monkeypatch.setattr(kv_events, "REPLAY_RETRY_S", 0.3)
    tok = train_tokenizer(tmp_path / "tok.json")
    async with Fleet(n=1, speedup=1000.0, kv_events_port=0, tokenizer=tok) as fleet:
        relay = HeldRelay(fleet.kv_event_endpoints[0][1])
        cfg = gateway_config(fleet, tok)
        replica = (
            cfg.pools["chat"]
            .replicas[0]
            .model_copy(update={"kv_events_replay": await relay.start()})
        )
        cfg = cfg.model_copy(
            update={
                "pools": {"chat": cfg.pools["chat"].model_copy(update={"replicas": (replica,)})}
            }
        )
        app = create_app(cfg)
        gw = await start_server(app, lifespan="on")
        index = app.gateway.index
        try:
            async with httpx.AsyncClient(timeout=10) as h:
                await poll_until(lambda: app.gateway.kv_events is not None
                                 and "r0" in app.gateway.kv_events.subscribers)  # fmt: skip
                sub = app.gateway.kv_events.subscribers["r0"]
                await poll_until(lambda: sub.stats.replays >= 1 and sub.stats.connected)
                await asyncio.sleep(0.5)  # past the replay's timeout
                assert caught_up((await h.get(gw.url + "/metrics")).text, "r0") == 0.0
                assert "r0" not in index.precise_replicas
                relay.held = False  # the replay socket answers again: the next retry catches up
                await poll_until(lambda: sub.stats.caught_up, timeout_s=5)
                assert caught_up((await h.get(gw.url + "/metrics")).text, "r0") == 1.0
                assert "r0" in index.precise_replicas
        finally:
            await gw.stop()
            await relay.stop()


async def test_a_dead_subscriber_reads_not_caught_up_and_its_engine_blocks_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The subscriber fails: the gauge reads 0 (it read 1), the engine-reported blocks leave the
    index (no eviction would reach them) and routing learns from its own decisions; started
    again, it catches up and the engine's blocks are back."""
    from gateway.fleet import kv_events

    monkeypatch.setattr(kv_events, "RESTART_S", 2.0)
    tok = train_tokenizer(tmp_path / "tok.json")
    async with Fleet(n=1, speedup=1000.0, kv_events_port=0, tokenizer=tok) as fleet:
        app = create_app(gateway_config(fleet, tok, ttl_s=60))
        gw = await start_server(app, lifespan="on")
        index = app.gateway.index
        scope = scope_key(MODEL)
        try:
            async with httpx.AsyncClient(timeout=10) as h:
                await poll_until(lambda: app.gateway.kv_events is not None
                                 and "r0" in app.gateway.kv_events.subscribers)  # fmt: skip
                sub = app.gateway.kv_events.subscribers["r0"]
                await poll_until(lambda: sub.stats.caught_up)
                body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
                assert (await h.post(gw.url + "/v1/completions", json=body)).status_code == 200
                hashes = app.gateway.chunker.hash_text(scope, PROMPT)
                await poll_until(lambda: engine_blocks_now(app, "r0") >= len(hashes))

                real = sub.applier.apply

                def fail(batch: Any) -> Any:  # the next batch kills the subscriber
                    sub.applier.apply = real  # type: ignore[method-assign]
                    raise RuntimeError("injected: the subscriber dies")

                sub.applier.apply = fail  # type: ignore[method-assign]
                other = {"model": MODEL, "prompt": "another prompt " * 40, "max_tokens": 2}
                assert (await h.post(gw.url + "/v1/completions", json=other)).status_code == 200
                await poll_until(lambda: sub.stats.deaths == 1)
                assert caught_up((await h.get(gw.url + "/metrics")).text, "r0") == 0.0
                assert "r0" not in index.precise_replicas and engine_blocks_now(app, "r0") == 0
                # routed learning holds a new prefix for index.ttl_s, not routed_ttl_s (0.5 s)
                third = {"model": MODEL, "prompt": "a third prompt " * 40, "max_tokens": 2}
                assert (await h.post(gw.url + "/v1/completions", json=third)).status_code == 200
                await asyncio.sleep(0.6)
                assert not sub.stats.caught_up  # the restart is 2 s after the death
                own = app.gateway.chunker.hash_text(scope, third["prompt"])
                assert (await index.match(scope, own, ["r0"]))["r0"] == len(own)
                await poll_until(lambda: sub.stats.caught_up, timeout_s=5)  # started again
                assert caught_up((await h.get(gw.url + "/metrics")).text, "r0") == 1.0
                assert "r0" in index.precise_replicas
                await poll_until(lambda: engine_blocks_now(app, "r0") >= len(hashes))  # replayed
        finally:
            await gw.stop()


def engine_blocks_now(app: Any, replica: str) -> int:
    st = app.gateway.index.stats_now()
    return int(st.engine_blocks_per_replica.get(replica, 0))
