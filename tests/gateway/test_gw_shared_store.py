"""The simulator's shared KV store end to end: replica 0 computes a prompt and publishes the
store's EXTERNAL events, the gateway's index puts the blocks on its shared tier, and the router
sees them as a `shared` hit on replica 1, which never computed the prompt; once replica 1 loads
them, they are known on its GPU; a block the store drops is removed from that tier by the
replica that announced it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway import create_app, parse_config
from prefix_index.chunking import scope_key
from prefix_index.tiers import SHARED
from simulator import Fleet, build_config
from tests.simulator.tiny_tokenizer import train_tokenizer
from tests.support import poll_until, start_server

pytest.importorskip("zmq")

MODEL = "qwen2.5-14b"
STORE_BLOCKS = 200  # room for one document's blocks, not two


def text(k: int) -> str:
    return f"Document {k}: " + " ".join(f"w{k}x{i}" for i in range(300))


def gateway_config(fleet: Fleet, tokenizer: str) -> Any:
    """A prefix scorer that counts a shared-store block at half a GPU block, KV events on."""
    replicas = [
        {"url": url, "name": f"r{i}", "kv_events": pub, "kv_events_replay": replay}
        for i, (url, (pub, replay)) in enumerate(
            zip(fleet.urls, fleet.kv_event_endpoints, strict=True)
        )
    ]
    policy = {"scorers": {"prefix": {"weight": 1, "tiers": {SHARED: 0.5}}}}
    return parse_config(
        {
            "server": {"expose_upstream_errors": True},  # lets a client see the decision header
            "pools": {
                "chat": {"replicas": replicas, "policy": policy, "scrape": {"interval_s": 0.2}}
            },
            "index": {
                "chunking": {"mode": "tokens", "tokenizer": tokenizer, "block_size": 16},
                "events": {"enabled": True, "routed_ttl_s": 0.5},
            },
        }
    )


@pytest.mark.parametrize("shared", [True, False])
async def test_the_router_sees_a_shared_hit_on_a_replica_that_never_computed(
    tmp_path: Path, shared: bool
) -> None:
    tok = train_tokenizer(tmp_path / "tok.json")
    bpt = build_config(MODEL, max_model_len=2048).perf.kv_bytes_per_token
    gb = STORE_BLOCKS * 16 * bpt / 1e9 if shared else None
    async with Fleet(n=2, speedup=1000.0, kv_events_port=0, tokenizer=tok, max_model_len=2048,
                     shared_kv_gb=gb) as fleet:  # fmt: skip
        app = create_app(gateway_config(fleet, tok))
        gw = await start_server(app, lifespan="on")
        try:
            kv = app.gateway.kv_events
            await poll_until(lambda: kv is not None and len(kv.subscribers) == 2)
            subs = [kv.subscribers["r0"], kv.subscribers["r1"]]
            await poll_until(lambda: all(s.stats.connected and s.stats.replays >= 1 for s in subs))
            scope = scope_key(MODEL)
            hashes = app.gateway.chunker.hash_text(scope, text(0))
            async with httpx.AsyncClient(timeout=20) as h:
                # straight to replica 0: the gateway learns of it from the events alone
                body = {"model": MODEL, "prompt": text(0), "max_tokens": 2}
                assert (
                    await h.post(fleet.urls[0] + "/v1/completions", json=body)
                ).status_code == 200
                applier = subs[0].applier
                await poll_until(lambda: applier.counts.stored >= len(hashes))
                if shared:
                    await poll_until(lambda: applier.counts.tier_stored >= len(hashes))
                gpu = await app.gateway.index.match(scope, hashes, ["r0", "r1"])
                assert gpu == {"r0": len(hashes), "r1": 0}
                tiers = app.gateway.index.match_tiers(scope, hashes, gpu)
                assert tiers.get("r1", {}).get(SHARED, 0) == (len(hashes) if shared else 0)
                res = await h.post(
                    gw.url + "/v1/completions", json=body, headers={"x-gateway-explain": "1"}
                )
                assert res.status_code == 200
                scores = orjson.loads(res.headers["x-gateway-decision"])["scores"]
                assert scores["r0"]["prefix"] == 1.0
                assert scores["r1"]["prefix"] == (0.5 if shared else 0.0)
                assert applier.counts.placeholder == applier.counts.unknown_medium == 0
                if not shared:
                    return
                # replica 1 loads it and goes on: its GPU copy and its new blocks are known
                longer = {**body, "prompt": text(0) + " and then some more words to compute"}
                res = await h.post(fleet.urls[1] + "/v1/completions", json=longer)
                assert res.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
                r1 = subs[1].applier
                await poll_until(
                    lambda: r1.counts.stored > len(hashes) and r1.counts.tier_stored > 0
                )
                gpu = await app.gateway.index.match(scope, hashes, ["r0", "r1"])
                assert gpu == {"r0": len(hashes), "r1": len(hashes)}
                assert r1.counts.unknown_parent == 0
                # replica 1 fills the store with another document: replica 0 removes document 0
                other = {"model": MODEL, "prompt": text(1), "max_tokens": 2}
                res = await h.post(fleet.urls[1] + "/v1/completions", json=other)
                assert res.status_code == 200
                await poll_until(lambda: applier.counts.tier_removed > 0)
                after = app.gateway.index.match_tiers(scope, hashes, {"r1": 0})
                assert after.get("r1", {}).get(SHARED, 0) == 0  # its first blocks went first
                assert r1.counts.unknown_removed == 0
        finally:
            await gw.stop()
