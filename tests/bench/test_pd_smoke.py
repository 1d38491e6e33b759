"""P/D in the discrete-event mode: the fleet, the transfer cost, bench/pd.py and `gateway plan --pd`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench import pd as bench_pd
from simulator.des import RoundRobin, SimRequest
from simulator.engine import Engine, Step
from simulator.pd import transfer_seconds
from simulator.pd_des import PdCluster, run_pd
from simulator.plan_pd import LeastLoaded, PdWorkload


def _record_steps(engine: Engine, into: list[Step]) -> None:
    begin = engine.begin_step

    def spy(now: float, *, fuse: bool = False) -> Step | None:
        step = begin(now, fuse=fuse)
        if step is not None:
            into.append(step)
        return step

    engine.begin_step = spy  # type: ignore[method-assign]


async def test_pd_fleet_prefills_on_p_decodes_on_d_and_pays_the_transfer() -> None:
    w = PdWorkload("t", (4000, 12000), (20, 40), rate=2.0, requests=30)
    reqs = w.trace(1)
    cluster = PdCluster(2, 2, "qwen2.5-14b", "a100-80g", kv_link_gbps=25.0, max_model_len=16384)
    p_steps: list[Step] = []
    d_steps: list[Step] = []
    for e in cluster.prefill:
        _record_steps(e, p_steps)
    for e in cluster.decode:
        _record_steps(e, d_steps)
    result = await run_pd(reqs, cluster, LeastLoaded())
    assert len(result.records) == 30
    by_id = {r.id: r for r in reqs}
    per_token = cluster.config.perf.kv_bytes_per_token
    prefill_one = cluster.config.perf.prefill_time(4000)
    for rec in result.records:
        req = by_id[rec.id]
        assert rec.output_tokens == req.max_tokens  # D generates the whole answer
        assert rec.replica >= 2  # recorded on a decode engine
        # TTFT covers P's prefill and the KV crossing the 25 Gb/s link
        xfer = transfer_seconds(len(req.prompt_tokens), per_token, 25.0)
        assert rec.ttft_s >= xfer + prefill_one
    assert max(s.prefill_tokens for s in p_steps) > 1000
    # decode steps never carry a prefill: at most the last prompt token of each admitted request
    assert all(s.prefill_tokens <= len(s.admitted) for s in d_steps)
    for e in cluster.prefill:
        assert not e.held and e.cache.num_free == e.cache.num_blocks  # every hold released
        assert e.counters.generation_tokens == e.counters.requests_served  # one token each
    for e in cluster.decode:
        assert e.cache.num_free == e.cache.num_blocks


async def test_pd_transfer_queues_on_the_decode_link() -> None:
    prompt = list(range(100, 8292))  # 8192 tokens, two requests at once, one decode engine
    reqs = [SimRequest("a", 0.0, prompt, 4), SimRequest("b", 0.0, prompt[::-1], 4)]
    slow = PdCluster(2, 1, "qwen2.5-14b", "a100-80g", kv_link_gbps=10.0, max_model_len=16384)
    fast = PdCluster(2, 1, "qwen2.5-14b", "a100-80g", kv_link_gbps=1000.0, max_model_len=16384)
    # one request on each prefill engine: both prefills end together, then share D's link
    r_slow = await run_pd([SimRequest(r.id, 0.0, r.prompt_tokens, 4) for r in reqs], slow,
                          RoundRobin())
    r_fast = await run_pd(reqs, fast, RoundRobin())
    xfer = transfer_seconds(8192, slow.config.perf.kv_bytes_per_token, 10.0)
    ttfts = sorted(r.ttft_s for r in r_slow.records)
    fast_ttfts = sorted(r.ttft_s for r in r_fast.records)
    assert ttfts[0] - fast_ttfts[0] == pytest.approx(xfer, rel=0.05)
    assert ttfts[1] - fast_ttfts[1] == pytest.approx(2 * xfer, rel=0.05)  # waited for the link


async def test_bench_chat_mix_meets_the_goal_through_the_gateway_router() -> None:
    res = await bench_pd.run_workload("chat_mix", bench_pd.GATEWAY_DEFAULT, None, 0)
    agg = res["agg x8"]
    split = max((n for n in res if not n.startswith("agg")), key=lambda n: res[n]["goodput"])
    assert agg["tpot_p99"] / res[split]["tpot_p99"] >= 3.0
    assert res[split]["goodput"] / agg["goodput"] >= 1.5
    assert "MET" in "\n".join(bench_pd.goals("chat_mix", res))


def _plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway", "plan", "--pd", "--model",
                           "llama-3.1-70b", "--gpu", "h200", "--weight-dtype", "fp8",
                           "--kv-cache-dtype", "fp8", *args], capture_output=True, text=True,
                          timeout=120)


def test_gateway_plan_pd_prefers_aggregated_for_short_prompts_long_outputs() -> None:
    res = _plan("--prompt-range", "200:800", "--output-range", "500:1500", "--rate", "6",
                "--requests", "150", "--gpus", "4")
    assert res.returncode == 0, res.stderr
    assert "best aggregated: agg x4; best split:" in res.stdout
    assert "prefer aggregated (agg x4)" in res.stdout
    for name in ("agg x4", "1P3D", "2P2D", "3P1D"):
        assert f"  {name} " in res.stdout


def test_gateway_plan_pd_rejects_a_missing_rate() -> None:
    res = _plan("--prompt-range", "200:800", "--output-range", "500:1500")
    assert res.returncode == 2 and "--rate" in res.stderr


async def test_bench_long_output_planner_prefers_aggregated() -> None:
    from simulator.plan_pd import verdict

    res = await bench_pd.run_workload("long_output", bench_pd.GATEWAY_DEFAULT, 150, 0)
    assert verdict(res).startswith("prefer aggregated")
    assert res["agg x8"]["tpot_p99"] <= min(r["tpot_p99"] for r in res.values()) * 1.01
