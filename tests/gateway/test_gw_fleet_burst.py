"""A burst on a new prefix through two gateways of one fleet (the Redis index and the shared
load, docs/scaleout.md) is prefilled on at most two replicas, as through one gateway
(tests/gateway/test_gw_router.py): real gateway apps, real Redis, simulated replicas whose own
counters say which replica computed the document."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import pytest

from gateway import create_app, parse_config
from simulator import Fleet
from simulator.workloads import text
from tests.support import poll_until, start_server

REDIS = "redis://127.0.0.1:6379/0"
MODEL = "qwen2.5-14b"
DOC_TOKENS = 4096
BURST = 20


def config(urls: list[str], fleet: str) -> Any:
    return parse_config(
        {
            "pools": {
                "chat": {
                    "replicas": [{"url": u, "name": f"r{i}"} for i, u in enumerate(urls)],
                    "scrape": {"interval_s": 0.2},
                    "health": {"interval_s": 0.2, "failures_to_open": 100},
                }
            },
            "index": {"backend": "redis", "redis_url": REDIS},
            "fleet": {"name": fleet},  # shared_load follows the Redis index: on
            "server": {"expose_upstream_errors": True},
        }
    )


async def stream(h: httpx.AsyncClient, url: str, content: str) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "stream": True,
    }
    async with h.stream("POST", url + "/v1/chat/completions", json=body) as res:
        assert res.status_code == 200
        async for _ in res.aiter_bytes():
            pass


@pytest.mark.parametrize("gap_ms", [0, 1, 2, 3, 5])
async def test_a_burst_split_between_two_gateways_is_prefilled_on_at_most_two_replicas(
    gap_ms: int,
) -> None:
    """20 requests on one new 4K-token document, `gap_ms` apart, alternately through gateway A
    and B: the replicas that computed the document (not a hit) number at most two. Arrivals a
    few ms apart are the hard case: a peer's load arrives by push before its blocks reach
    Redis, and a gateway's own blocks are still on their way there."""
    doc = text(f"fleet-burst-{uuid.uuid4().hex}", DOC_TOKENS)  # new to Redis in every run
    fleet_name = f"burst-{uuid.uuid4().hex[:10]}"
    async with Fleet(n=4, speedup=20.0) as fleet:
        apps = [create_app(config(fleet.urls, fleet_name)) for _ in range(2)]
        gws = [await start_server(app, lifespan="on") for app in apps]
        try:
            await poll_until(lambda: all(a.gateway.fleet.peers == 1 for a in apps))
            async with httpx.AsyncClient(timeout=60) as h:

                async def one(i: int) -> None:
                    await asyncio.sleep(i * gap_ms / 1000)
                    await stream(h, gws[i % 2].url, f"{doc}\nQuestion {i}?")

                await asyncio.gather(*(one(i) for i in range(BURST)))
            computed = [
                s["prompt_tokens"] - s["prefix_hit_tokens"]
                for s in (r.stats() for r in fleet.replicas)
            ]
            prefilled = sum(1 for c in computed if c >= 3000)
            assert 1 <= prefilled <= 2, computed
        finally:
            for gw in gws:
                await gw.stop()
