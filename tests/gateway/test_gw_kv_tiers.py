"""Tiered KV end to end: a simulated replica with a host tier publishes CPU-medium events, the
gateway's index places them on its CPU tier, both /metrics say so."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest

from gateway import create_app, parse_config
from prefix_index import RedisIndex
from prefix_index.chunking import scope_key
from prefix_index.tiers import CPU
from simulator import Fleet
from tests.gateway.test_gw_kv_events import MODEL, gateway_config
from tests.simulator.tiny_tokenizer import train_tokenizer
from tests.support import poll_until, start_server

pytest.importorskip("zmq")

REDIS = "redis://127.0.0.1:6379/0"


def text(k: int) -> str:
    return f"Document {k}: " + " ".join(f"w{k}x{i}" for i in range(300))


async def test_spilled_blocks_reach_the_gateway_cpu_tier(tmp_path: Path) -> None:
    tok = train_tokenizer(tmp_path / "tok.json")
    # 160 GPU blocks of 16: a few prompts push the first one out to the host tier
    async with Fleet(n=1, speedup=1000.0, kv_events_port=0, tokenizer=tok, num_gpu_blocks=160,
                     max_model_len=2048, cpu_kv_gb=3.0) as fleet:  # fmt: skip
        app = create_app(gateway_config(fleet, tok))
        gw = await start_server(app, lifespan="on")
        try:
            kv = app.gateway.kv_events
            await poll_until(lambda: kv is not None and len(kv.subscribers) == 1)
            sub = kv.subscribers["r0"]
            await poll_until(lambda: sub.stats.connected and sub.stats.replays >= 1)
            async with httpx.AsyncClient(timeout=20) as h:
                for k in range(6):
                    res = await h.post(gw.url + "/v1/completions",
                                       json={"model": MODEL, "prompt": text(k), "max_tokens": 2})
                    assert res.status_code == 200
                await poll_until(lambda: sub.applier.counts.tier_stored > 0)
                scope = scope_key(MODEL)
                hashes = app.gateway.chunker.hash_text(scope, text(0))
                gpu = await app.gateway.index.match(scope, hashes, ["r0"])
                tiers = app.gateway.index.match_tiers(scope, hashes, gpu)
                assert tiers["r0"][CPU] > 0 and gpu["r0"] + tiers["r0"][CPU] >= len(hashes) - 1
                # the same prompt again: the replica loads it from its host tier
                res = await h.post(gw.url + "/v1/completions",
                                   json={"model": MODEL, "prompt": text(0), "max_tokens": 2})
                cached = res.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert cached >= 16 * (len(hashes) - 1)
                replica = (await h.get(fleet.urls[0] + "/metrics")).text
                assert 'vllm:prefix_cache_tier_hits_total{' in replica
                assert 'tier="cpu"' in replica
                metrics = (await h.get(gw.url + "/metrics")).text
                line = next(x for x in metrics.splitlines()
                            if x.startswith("gateway_kv_events_tier_blocks_total")
                            and 'kind="stored"' in x)  # fmt: skip
                assert float(line.rsplit(" ", 1)[1]) > 0
                assert sub.applier.counts.placeholder == 0
                assert sub.applier.counts.unknown_medium == 0
        finally:
            await gw.stop()


async def test_a_prompt_on_a_cpu_tier_is_routed_there_with_the_redis_index(
    tmp_path: Path,
) -> None:
    """`index.backend: redis` with KV events: the engine's tiers are kept in the gateway's own
    process (routed records in Redis), and the router weighs them as with the memory index."""
    tok = train_tokenizer(tmp_path / "tok.json")
    tag = uuid.uuid4().hex[:8]  # replica names unique to this run keep its Redis keys apart
    async with Fleet(n=2, speedup=1000.0, kv_events_port=0, tokenizer=tok, num_gpu_blocks=160,
                     max_model_len=2048, cpu_kv_gb=3.0) as fleet:  # fmt: skip
        names = [f"{tag}-r{i}" for i in range(2)]
        replicas = [
            {"url": url, "name": name, "kv_events": pub, "kv_events_replay": replay}
            for url, name, (pub, replay) in zip(
                fleet.urls, names, fleet.kv_event_endpoints, strict=True
            )
        ]
        policy = {"preset": "prefix_aware",
                  "scorers": {"prefix": {"weight": 3, "tiers": {"cpu": 0.8}}, "queue": 1}}  # fmt: skip
        chunking = {"mode": "tokens", "tokenizer": tok, "block_size": 16, "chat_template": "chatml"}
        app = create_app(parse_config({
            "pools": {"chat": {"replicas": replicas, "policy": policy}},
            "index": {"backend": "redis", "redis_url": REDIS, "chunking": chunking,
                      "events": {"enabled": True, "routed_ttl_s": 0.5}},
        }))  # fmt: skip
        gw = await start_server(app, lifespan="on")
        index = app.gateway.index
        try:
            assert isinstance(index, RedisIndex)
            kv = app.gateway.kv_events
            await poll_until(lambda: kv is not None and len(kv.subscribers) == 2)
            subs = [kv.subscribers[name] for name in names]
            await poll_until(lambda: all(s.stats.connected and s.stats.replays for s in subs))
            scope = scope_key(MODEL)
            hashes = app.gateway.chunker.hash_text(scope, text(0))
            async with httpx.AsyncClient(timeout=20) as h:
                # straight to the second replica: its events alone tell the gateway
                for k in range(6):
                    res = await h.post(
                        fleet.urls[1] + "/v1/completions",
                        json={"model": MODEL, "prompt": text(k), "max_tokens": 2},
                    )
                    assert res.status_code == 200
                await poll_until(lambda: subs[1].applier.counts.tier_stored > 0)
                gpu = await index.match(scope, hashes, names)
                tiers = index.match_tiers(scope, hashes, gpu)
                assert names[0] not in tiers and tiers[names[1]][CPU] > gpu[names[1]]
                assert (await index.stats()).engine_blocks_per_replica.get(names[1], 0) > 0
                scraped = (await h.get(gw.url + "/metrics")).text  # the engine's, held here
                assert f'gateway_index_blocks{{replica="{names[1]}",source="engine"}}' in scraped
                assert "gateway_index_bytes" not in scraped  # redis: its figures need Redis
                # through the gateway: to the replica whose host tier holds the prompt
                res = await h.post(
                    gw.url + "/v1/completions",
                    json={"model": MODEL, "prompt": text(0), "max_tokens": 2},
                )
                cached = res.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert cached >= 16 * (len(hashes) - 1)
        finally:
            for name in names:  # the test's Redis records go now, not after the TTL
                await index.forget(name)
            await gw.stop()
