"""The by-tier audit on the production path: a request predicted to load its prefix from a
replica's host tier, served or not, shows on /metrics (docs/tiers.md, "Predicted vs served")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway import create_app
from gateway.config import parse_config
from prefix_index.chunking import scope_key
from prefix_index.tiers import CPU
from simulator import Fleet
from tests.gateway.test_gw_kv_events import MODEL
from tests.gateway.test_gw_kv_tiers import text
from tests.simulator.tiny_tokenizer import train_tokenizer
from tests.support import poll_until, start_server

pytest.importorskip("zmq")


def config(fleet: Fleet, tokenizer: str) -> Any:
    (pub, replay), url = fleet.kv_event_endpoints[0], fleet.urls[0]
    replica = {"url": url, "name": "r0", "kv_events": pub, "kv_events_replay": replay}
    chunking = {"mode": "tokens", "tokenizer": tokenizer, "block_size": 16,
                "chat_template": "chatml"}  # fmt: skip
    return parse_config({
        "pools": {"chat": {"replicas": [replica], "policy": "ttft", "scrape": {"interval_s": 0.2}}},
        "index": {"chunking": chunking, "events": {"enabled": True, "routed_ttl_s": 0.5}},
    })  # fmt: skip


def sample(metrics: str, name: str, **labels: str) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    for line in metrics.splitlines():
        if line.startswith(name + "{") and all(w in line for w in want):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} {labels} in /metrics")


async def test_predicted_cpu_hits_served_and_unserved_show_on_metrics(tmp_path: Path) -> None:
    tok = train_tokenizer(tmp_path / "tok.json")
    # 160 GPU blocks of 16: a few prompts push the first ones out to the host tier
    async with Fleet(n=1, speedup=1000.0, kv_events_port=0, tokenizer=tok, num_gpu_blocks=160,
                     max_model_len=2048, cpu_kv_gb=3.0) as fleet:  # fmt: skip
        app = create_app(config(fleet, tok))
        gw = await start_server(app, lifespan="on")
        try:
            g = app.gateway
            kv = g.kv_events
            await poll_until(lambda: kv is not None and len(kv.subscribers) == 1)
            sub = kv.subscribers["r0"]
            await poll_until(lambda: sub.stats.connected and sub.stats.replays >= 1)
            scope = scope_key(MODEL)

            async def on_cpu(k: int) -> int:
                hashes = g.chunker.hash_text(scope, text(k))
                gpu = await g.index.match(scope, hashes, ["r0"])
                return int(g.index.match_tiers(scope, hashes, gpu).get("r0", {}).get(CPU, 0))

            async with httpx.AsyncClient(timeout=20) as h:

                async def ask(k: int) -> None:
                    res = await h.post(
                        gw.url + "/v1/completions",
                        json={"model": MODEL, "prompt": text(k), "max_tokens": 2},
                    )
                    assert res.status_code == 200

                for k in range(6):
                    await ask(k)
                await poll_until(lambda: sub.applier.counts.tier_stored > 0)
                assert await on_cpu(0) > 0 and await on_cpu(1) > 0
                await ask(0)  # loaded from the host tier, as predicted
                metrics = (await h.get(gw.url + "/metrics")).text
                assert sample(metrics, "gateway_tier_predicted_tokens_total", tier="cpu") > 0
                assert sample(metrics, "gateway_tier_unserved_tokens_total", tier="cpu") == 0
                assert sample(metrics, "gateway_tier_short_requests_total", pool="chat") == 0
                assert sample(metrics, "gateway_tier_load_gbps", tier="cpu") == 50
                # the replica loses its host tier without a word (lost removal events): the
                # index still predicts document 1 there, the replica recomputes it
                host = fleet.replicas[0].engine.cache.tiers
                assert host is not None and host.host is not None
                host.host.blocks.clear()
                await ask(1)
                metrics = (await h.get(gw.url + "/metrics")).text
                assert sample(metrics, "gateway_tier_unserved_tokens_total", tier="cpu") > 0
                assert sample(metrics, "gateway_tier_short_requests_total", pool="chat") == 1
        finally:
            await gw.stop()


@pytest.mark.parametrize("protocol", ["vllm-nixl", "sglang"])
async def test_a_pd_pool_audits_the_prefill_legs_cached_tokens(protocol: str) -> None:
    from tests.gateway.test_gw_pd import pd_rig

    async with pd_rig(protocol) as r, httpx.AsyncClient(timeout=20) as h:
        for _ in range(2):  # the second one is predicted to hit on the prefill replica
            res = await h.post(r.url + "/v1/chat/completions", json=r.body())
            assert res.status_code == 200, res.text
        cached = res.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0
        pd = r.app.gateway.pools["pd"].pd
        assert pd.prefill.audit.predicted["gpu"] > 0  # fed from the prefill leg
        assert pd.decode.audit.predicted["gpu"] == 0  # the decode leg reports no prefix hit
        metrics = (await h.get(r.url + "/metrics")).text
        total = sample(metrics, "gateway_tier_predicted_tokens_total", pool="pd", tier="gpu")
        assert total == pd.prefill.audit.predicted["gpu"]
