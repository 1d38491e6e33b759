"""Tier load rates measured by the engine: the scrape parser reads vLLM's transfer counters and
LMCache's retrieve families, the replica's meter turns successive scrapes into seconds per byte
or per token, and the ttft scorer prices a tier hit at that instead of a wrong configured
bandwidth (docs/tiers.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway import create_app
from gateway.config import parse_config
from gateway.fleet.scrape import parse_metrics
from gateway.fleet.tier_load import DECAY, TierLoadMeter
from prefix_index.chunking import scope_key
from prefix_index.tiers import CPU
from simulator import Fleet
from tests.gateway.test_gw_kv_events import MODEL
from tests.gateway.test_gw_kv_tiers import text
from tests.gateway.test_gw_tier_audit import sample
from tests.simulator.tiny_tokenizer import train_tokenizer
from tests.support import poll_until, start_server

# as vLLM's prometheus_client writes them (a Counter gets `_total` and `_created`), two engines
VLLM = """\
# HELP vllm:kv_offload_total_bytes_total Number of bytes offloaded by KV connector
# TYPE vllm:kv_offload_total_bytes_total counter
vllm:kv_offload_total_bytes_total{engine="0",model_name="m",transfer_type="gpu_to_cpu"} 9.0e+09
vllm:kv_offload_total_bytes_total{engine="0",model_name="m",transfer_type="cpu_to_gpu"} 4.0e+09
vllm:kv_offload_total_bytes_total{engine="1",model_name="m",transfer_type="cpu_to_gpu"} 1.0e+09
vllm:kv_offload_total_bytes_total{engine="0",model_name="m",transfer_type="storage_to_gpu"} 7.0e+08
vllm:kv_offload_total_bytes_total{engine="0",model_name="m",transfer_type="tape_to_gpu"} 5.0e+08
vllm:kv_offload_total_bytes_total{engine="0",model_name="m",transfer_type="gpu_to_gpu"} 5.0e+08
vllm:kv_offload_total_bytes_created{engine="0",model_name="m",transfer_type="cpu_to_gpu"} 1.7e+09
# HELP vllm:kv_offload_total_time_total Total time measured by all KV offloading operations
# TYPE vllm:kv_offload_total_time_total counter
vllm:kv_offload_total_time_total{engine="0",model_name="m",transfer_type="gpu_to_cpu"} 0.3
vllm:kv_offload_total_time_total{engine="0",model_name="m",transfer_type="cpu_to_gpu"} 0.08
vllm:kv_offload_total_time_total{engine="1",model_name="m",transfer_type="cpu_to_gpu"} 0.02
vllm:kv_offload_total_time_total{engine="0",model_name="m",transfer_type="storage_to_gpu"} 0.1
vllm:kv_offload_total_time_total{engine="0",model_name="m",transfer_type="tape_to_gpu"} 9.0
vllm:kv_offload_total_time_created{engine="0",model_name="m",transfer_type="cpu_to_gpu"} 1.7e+09
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
"""
# the same counters as an exporter without the `_total` suffix writes them
VLLM_BARE = """\
vllm:kv_offload_total_bytes{engine="0",transfer_type="cpu_to_gpu"} 5000000000
vllm:kv_offload_total_time{engine="0",transfer_type="cpu_to_gpu"} 0.1
"""
LMCACHE = """\
# TYPE lmcache:num_hit_tokens_total counter
lmcache:num_hit_tokens_total{model_name="m",worker_id="0"} 3000.0
lmcache:num_hit_tokens_total{model_name="m",worker_id="1"} 1000.0
lmcache:num_hit_tokens_created{model_name="m",worker_id="0"} 1.7e+09
# TYPE lmcache:time_to_retrieve histogram
lmcache:time_to_retrieve_bucket{le="0.01",model_name="m",worker_id="0"} 1.0
lmcache:time_to_retrieve_bucket{le="+Inf",model_name="m",worker_id="0"} 2.0
lmcache:time_to_retrieve_count{model_name="m",worker_id="0"} 2.0
lmcache:time_to_retrieve_sum{model_name="m",worker_id="0"} 0.03
lmcache:time_to_retrieve_sum{model_name="m",worker_id="1"} 0.01
"""


def test_vllm_transfer_counters_are_read_by_tier_in_both_spellings() -> None:
    s = parse_metrics(VLLM)
    # loads only (<tier>_to_gpu), engines summed; storage is the disk tier; tape is no medium
    assert s.transfer_bytes == {"cpu": 5.0e9, "disk": 7.0e8}
    assert s.transfer_s == pytest.approx({"cpu": 0.1, "disk": 0.1})
    assert s.waiting == 2.0 and s.retrieve_s is None
    bare = parse_metrics(VLLM_BARE)
    assert (bare.transfer_bytes, bare.transfer_s) == ({"cpu": 5e9}, {"cpu": 0.1})
    assert parse_metrics("vllm:num_requests_waiting 1\n").transfer_bytes is None


def test_lmcache_retrieve_families_are_read() -> None:
    s = parse_metrics(LMCACHE)
    assert s.retrieve_tokens == 4000.0 and s.retrieve_s == pytest.approx(0.04)
    assert (
        parse_metrics(LMCACHE.replace("num_hit_tokens_total", "num_hit_tokens")).retrieve_tokens
        == 4000.0
    )


def test_the_meter_rates_what_moved_and_restarts_on_a_counter_reset() -> None:
    m = TierLoadMeter()
    m.update(parse_metrics("vllm:num_requests_waiting 0\n"))
    assert m.rates is None  # the engine reports no tier load
    m.update(parse_metrics(VLLM + LMCACHE))
    assert m.rates is not None
    assert m.rates["cpu"] == pytest.approx((0.1 / 5e9, 0.0))  # 50 GB/s
    assert m.rates["disk"] == pytest.approx((0.1 / 7e8, 0.0))
    assert m.rates["shared"] == pytest.approx((0.0, 0.04 / 4000))  # LMCache: per token
    first = m.rates
    m.update(parse_metrics(VLLM + LMCACHE))  # nothing moved since: the same rates, same dict
    assert m.rates is first
    # 1 GB more at 10 GB/s: the decayed sums lean toward the new link speed
    m.update(parse_metrics(_cpu(6e9, 0.2)))
    assert m.rates["cpu"][0] == pytest.approx((DECAY * 0.1 + 0.1) / (DECAY * 5e9 + 1e9))
    # the engine restarted: its counters count from 0, and the old sums are gone
    m.update(parse_metrics(_cpu(2e9, 0.1)))
    assert m.rates["cpu"] == pytest.approx((0.1 / 2e9, 0.0))  # 20 GB/s, not a negative delta
    m.update(parse_metrics(_cpu(4e9, 0.2)))
    assert m.rates["cpu"][0] == pytest.approx((DECAY * 0.1 + 0.1) / (DECAY * 2e9 + 2e9))
    assert first["cpu"] == pytest.approx((0.1 / 5e9, 0.0))  # an older view keeps its rates


def test_a_vllm_transfer_for_the_shared_tier_wins_over_lmcache() -> None:
    m = TierLoadMeter()
    m.update(parse_metrics(LMCACHE + _cpu(1e9, 0.1, "external_to_gpu")))
    assert m.rates == {"shared": pytest.approx((0.1 / 1e9, 0.0))}


def _cpu(n: float, s: float, kind: str = "cpu_to_gpu") -> str:
    return (
        f'vllm:kv_offload_total_bytes_total{{engine="0",transfer_type="{kind}"}} {n}\n'
        f'vllm:kv_offload_total_time_total{{engine="0",transfer_type="{kind}"}} {s}\n'
    )


def config(fleet: Fleet, tokenizer: str) -> Any:
    replicas = [
        {"url": url, "name": f"r{i}", "kv_events": pub, "kv_events_replay": replay}
        for i, ((pub, replay), url) in enumerate(
            zip(fleet.kv_event_endpoints, fleet.urls, strict=True)
        )
    ]
    chunking = {"mode": "tokens", "tokenizer": tokenizer, "block_size": 16,
                "chat_template": "chatml"}  # fmt: skip
    # the host tier configured at 0.01 GB/s: 2000x slower than the replicas' 20
    policy = {"scorers": {"ttft": {"weight": 1, "tier_gbps": {"cpu": 0.01}}}, "picker": "max_score"}
    return parse_config({
        "pools": {"chat": {"replicas": replicas, "policy": policy, "scrape": {"interval_s": 0.1}}},
        "index": {"chunking": chunking, "events": {"enabled": True, "routed_ttl_s": 0.5}},
        "server": {"expose_upstream_errors": True},
    })  # fmt: skip


async def test_the_measured_host_rate_reaches_metrics_and_routing(tmp_path: Path) -> None:
    pytest.importorskip("zmq")
    tok = train_tokenizer(tmp_path / "tok.json")
    # 160 GPU blocks of 16: a few prompts push the first ones out to r0's host tier
    async with Fleet(n=2, speedup=1000.0, kv_events_port=0, tokenizer=tok, num_gpu_blocks=160,
                     max_model_len=2048, cpu_kv_gb=3.0, cpu_kv_gbps=20.0) as fleet:  # fmt: skip
        app = create_app(config(fleet, tok))
        gw = await start_server(app, lifespan="on")
        try:
            g = app.gateway
            kv = g.kv_events
            await poll_until(lambda: kv is not None and len(kv.subscribers) == 2)
            sub = kv.subscribers["r0"]
            await poll_until(lambda: sub.stats.connected and sub.stats.replays >= 1)
            scope = scope_key(MODEL)
            r0 = next(r for r in g.all_replicas() if r.name == "r0")
            async with httpx.AsyncClient(timeout=20) as h:

                async def on_r0(k: int) -> None:  # straight to the replica: its events tell
                    body = {"model": MODEL, "prompt": text(k), "max_tokens": 2}
                    res = await h.post(fleet.urls[0] + "/v1/completions", json=body)
                    assert res.status_code == 200

                for k in [*range(6), 1]:  # document 1 comes back from r0's host tier
                    await on_r0(k)
                await poll_until(lambda: r0.tier_load.rates is not None)  # the next scrape
                await poll_until(lambda: sub.applier.counts.tier_stored > 0)
                hashes = g.chunker.hash_text(scope, text(0))
                gpu = await g.index.match(scope, hashes, ["r0", "r1"])
                assert g.index.match_tiers(scope, hashes, gpu).get("r0", {}).get(CPU, 0) > 0
                metrics = (await h.get(gw.url + "/metrics")).text
                got = sample(metrics, "gateway_replica_tier_load_gbps", replica="r0", tier="cpu")
                assert got == pytest.approx(20.0, rel=1e-3)  # the simulator's --cpu-kv-gbps
                assert not any(  # r1 loaded nothing: no sample
                    line.startswith("gateway_replica_tier_load_gbps{") and 'replica="r1"' in line
                    for line in metrics.splitlines()
                )
                assert sample(metrics, "gateway_tier_load_gbps", tier="cpu") == 0.01  # config
                # document 0 is on r0's host tier: at 0.01 GB/s r1's recompute would win, at the
                # measured 20 GB/s loading it on r0 is faster
                res = await h.post(
                    gw.url + "/v1/completions",
                    json={"model": MODEL, "prompt": text(0), "max_tokens": 2},
                    headers={"x-gateway-explain": "1"},
                )
                assert res.status_code == 200
                decision = orjson.loads(res.headers["x-gateway-decision"])
                assert decision["ranked"][0] == "r0"
                assert decision["scores"]["r0"]["ttft"] == 1.0
                assert decision["scores"]["r1"]["ttft"] < 1.0
        finally:
            await gw.stop()
