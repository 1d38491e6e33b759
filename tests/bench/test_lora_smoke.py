"""Smoke test of the LoRA benchmark (bench/lora.py): a few hundred requests through every router.

Checks that every request is recorded, the gateway's per-adapter in-flight counts drain to zero,
and the result that breaks when LoRA-aware routing does: it loads adapters far less often than
round robin and has a lower TTFT P99.
"""

from __future__ import annotations

import asyncio

from bench import lora as bench
from simulator.des import Cluster, run

N = 400


def test_lora_aware_loads_less_than_round_robin() -> None:
    requests = bench.workload(N, rate=15.0, seed=1)
    rows = asyncio.run(bench.bench(N, 15.0, 1, list(bench.POLICIES), bench.LOAD_S))
    by = {r.router: r for r in rows}
    assert set(by) == set(bench.POLICIES)
    rr, aware = by["round_robin"], by["lora_aware"]
    assert aware.loads_per_k * 3 < rr.loads_per_k
    assert aware.p99 < rr.p99
    assert by["lora_managed"].loads_per_k * 2 < rr.loads_per_k
    assert "loads vs rr" in bench.table(rows) and len(bench.goals(rows)) == 2
    assert len({r.meta["lora"] for r in requests}) > 10  # Zipf over many adapters


async def test_every_request_is_recorded_and_adapter_counts_drain() -> None:
    requests = bench.workload(200, rate=15.0, seed=2)
    for managed in (False, True):
        cluster = Cluster(bench.N_REPLICAS, seed=0, **bench.engine_config(managed=managed))
        router = bench.LoraDesRouter("ttft", cluster, 0, "x", managed=managed)
        result = await run(requests, cluster, router, scrape_interval_s=bench.SCRAPE_S)
        assert [r.id for r in result.records] == [q.id for q in requests]
        assert all(not r.lora.own for r in router.replicas)
        assert all(r.inflight == 0 for r in router.replicas)
        # what the gateway saw of the replicas came through the production parsers
        assert all(r.lora.max_loras == bench.MAX_LORAS for r in router.replicas)
