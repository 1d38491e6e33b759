"""Tenants, rate limits, priorities and fairness through a running gateway."""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tests.gateway.conftest import rig
from tests.gateway.fake_replica import Upstream
from tests.support import gateway_process, poll_until, start_server, wait_ready

KEYS = {"a": "key-a-" + "x" * 20, "b": "key-b-" + "y" * 20}


def tenants(limits: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "auth": "required",
        "tenants": [
            {
                "name": "team-a",
                "api_keys": [KEYS["a"]],
                "priority": "interactive",
                "allowed_priorities": ["interactive", "batch"],
                **({"limits": limits} if limits else {}),
            },
            {
                "name": "team-b",
                "api_key_sha256": [hashlib.sha256(KEYS["b"].encode()).hexdigest()],
                "priority": "batch",
            },
        ],
    }


def assert_admitted(ok: int, per_minute: int, elapsed_s: float) -> None:
    """A full bucket admits `per_minute` at once, plus what refills while the burst runs, ±1."""
    refill = math.ceil(elapsed_s * per_minute / 60.0)
    assert per_minute - 1 <= ok <= per_minute + refill + 1, (ok, elapsed_s)


def queued(r: Any, klass: str) -> int:
    q = r.gateway.admission.stats().queues.get("chat", {}).get(klass)
    return 0 if q is None else int(q.queued)


def chat(tag: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": tag}]}


async def post(
    h: aiohttp.ClientSession, url: str, key: str | None, tag: str, **headers: str
) -> tuple[int, dict[str, str]]:
    hdrs = dict(headers)
    if key is not None:
        hdrs["authorization"] = f"Bearer {key}"
    async with h.post(url + "/v1/chat/completions", json=chat(tag), headers=hdrs) as res:
        await res.read()
        return res.status, dict(res.headers)


async def test_auth_and_allowed_classes() -> None:
    async with rig([Upstream("u")], extra=tenants()) as r, aiohttp.ClientSession() as h:
        assert (await post(h, r.url, None, "x"))[0] == 401
        assert (await post(h, r.url, "wrong", "x"))[0] == 401
        assert (await post(h, r.url, KEYS["a"], "x"))[0] == 200
        assert (await post(h, r.url, KEYS["a"], "x", **{"x-priority": "batch"}))[0] == 200
        assert (await post(h, r.url, KEYS["b"], "x", **{"x-priority": "interactive"}))[0] == 403
        assert (await post(h, r.url, KEYS["b"], "x", **{"x-priority": "gold"}))[0] == 400
        async with h.get(r.url + "/metrics") as res:
            text = await res.text()
    assert KEYS["a"] not in text and KEYS["b"] not in text
    # the client's key never reaches the replica
    assert all(KEYS["a"].encode() not in v for hd in r.upstreams[0].headers for v in hd.values())


async def test_string_priority_removed_before_forwarding() -> None:
    up = Upstream("u")
    async with rig([up], extra={**tenants(), "admission": {"forward_priority": True}}) as r:
        async with aiohttp.ClientSession() as h:
            body = {**chat("x"), "priority": "batch"}
            async with h.post(
                r.url + "/v1/chat/completions",
                json=body,
                headers={"authorization": f"Bearer {KEYS['a']}"},
            ) as res:
                assert res.status == 200
    assert orjson.loads(up.bodies[0])["priority"] == 1  # the batch class's rank, vLLM's direction


async def test_rate_limit_exact_under_a_burst_one_gateway() -> None:
    limits = {"requests_per_minute": 100}
    async with rig(
        [Upstream("u")], extra=tenants(limits), pool={"max_inflight_per_replica": 1000}
    ) as r:
        conn = aiohttp.TCPConnector(limit=200)
        t0 = time.monotonic()
        async with aiohttp.ClientSession(connector=conn) as h:
            results = await asyncio.gather(
                *(post(h, r.url, KEYS["a"], f"r{i}") for i in range(1000))
            )
        elapsed = time.monotonic() - t0
    statuses = [s for s, _ in results]
    assert_admitted(statuses.count(200), 100, elapsed)
    assert statuses.count(429) == 1000 - statuses.count(200)
    refused = next(hd for s, hd in results if s == 429)
    assert int(refused["Retry-After"]) >= 1
    ok = next(hd for s, hd in results if s == 200)
    assert ok["x-ratelimit-limit-requests"] == "100"


async def test_rate_limit_shared_by_two_gateway_processes(tmp_path: Path) -> None:
    up = Upstream("u")
    served = await start_server(up)
    ns = f"test-{uuid.uuid4().hex[:8]}"
    cfg = {
        **tenants({"requests_per_minute": 100}),
        # a tenant name unique to this run keeps the shared Redis buckets apart from other runs
        "pools": {
            "chat": {
                "replicas": [served.url],
                "policy": "round_robin",
                "max_inflight_per_replica": 1000,
            }
        },
        "ratelimit": {"backend": "redis", "redis_url": "redis://127.0.0.1:6379/0"},
    }
    cfg["tenants"][0]["name"] = ns
    procs = [gateway_process(cfg, tmp_path) for _ in range(2)]
    try:
        for proc, url in procs:
            await wait_ready(url, proc)
        conn = aiohttp.TCPConnector(limit=200)
        t0 = time.monotonic()
        async with aiohttp.ClientSession(connector=conn) as h:
            results = await asyncio.gather(
                *(post(h, procs[i % 2][1], KEYS["a"], f"r{i}") for i in range(1000))
            )
        elapsed = time.monotonic() - t0
    finally:
        for proc, _ in procs:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in procs:
            proc.wait(timeout=30)
        await served.stop()
    statuses = [s for s, _ in results]
    assert_admitted(statuses.count(200), 100, elapsed)
    assert up.calls == statuses.count(200)


async def test_interactive_overtakes_queued_batch() -> None:
    up = Upstream("u", delay_s=0.05)
    pool = {"max_inflight_per_replica": 1}
    async with rig([up], extra=tenants(), pool=pool) as r, aiohttp.ClientSession() as h:
        batch = [asyncio.create_task(post(h, r.url, KEYS["b"], f"batch{i}")) for i in range(20)]
        await poll_until(lambda: queued(r, "batch") >= 10)
        inter = [asyncio.create_task(post(h, r.url, KEYS["a"], f"inter{i}")) for i in range(3)]
        results = await asyncio.gather(*batch, *inter)
    assert all(s == 200 for s, _ in results)
    order = [orjson.loads(b)["messages"][0]["content"] for b in up.bodies]
    last_inter = max(order.index(f"inter{i}") for i in range(3))
    batch_after = [t for t in order[last_inter + 1 :] if t.startswith("batch")]
    assert len(batch_after) >= 5, order  # interactive went ahead of the batch backlog


async def test_fair_share_between_tenants_of_one_class() -> None:
    up = Upstream("u", delay_s=0.02)
    cfg = tenants()
    cfg["tenants"][1]["priority"] = "interactive"
    async with (
        rig([up], extra=cfg, pool={"max_inflight_per_replica": 1}) as r,
        aiohttp.ClientSession() as h,
    ):
        flood = [asyncio.create_task(post(h, r.url, KEYS["a"], f"a{i}")) for i in range(40)]
        await poll_until(lambda: queued(r, "interactive") >= 20)
        late = [asyncio.create_task(post(h, r.url, KEYS["b"], f"b{i}")) for i in range(5)]
        await asyncio.gather(*flood, *late)
    order = [orjson.loads(b)["messages"][0]["content"] for b in up.bodies]
    first_b = order.index("b0")
    last_b = max(order.index(f"b{i}") for i in range(5))
    assert last_b - first_b <= 10, (
        order
    )  # B alternates with A's backlog instead of waiting behind it


async def test_queue_sheds_with_retry_after() -> None:
    up = Upstream("u", delay_s=0.5)
    cfg = {
        "priority_classes": {
            "interactive": {"rank": 0, "max_queue_wait_s": 0.2, "max_queue_len": 2}
        }
    }
    async with (
        rig([up], extra=cfg, pool={"max_inflight_per_replica": 1}) as r,
        aiohttp.ClientSession() as h,
    ):
        results = await asyncio.gather(*(post(h, r.url, None, f"r{i}") for i in range(6)))
        async with h.get(r.url + "/metrics") as res:
            text = await res.text()
    statuses = sorted(s for s, _ in results)
    assert statuses.count(200) >= 1 and statuses.count(429) >= 3
    shed = next(hd for s, hd in results if s == 429)
    assert int(shed["Retry-After"]) >= 1
    assert (
        'gateway_shed_total{pool="chat",priority="interactive",reason="queue_full",tenant="anonymous"}'
        in text
    )


@pytest.mark.skipif(os.environ.get("CI_SKIP_REDIS") == "1", reason="no Redis")
def test_config_rejects_unknown_class() -> None:
    from gateway.config import ConfigError, parse_config

    cfg = {"pools": {"chat": {"replicas": ["http://a:1"]}}, **tenants()}
    cfg["tenants"][0]["priority"] = "gold"
    with pytest.raises(ConfigError) as info:
        parse_config(cfg)
    assert info.value.problems == [
        "tenants[0].priority: unknown priority class 'gold' (defined: batch, interactive)"
    ]
