"""The routing unit end to end: blocks count at dispatch, a failed dispatch takes them back, cold
prompts spread, and a burst on one new prompt sticks together (real gateway, simulated replicas)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson

from bench.harness import stop_all
from gateway import create_app, parse_config
from gateway.api.openai import parse_body
from gateway.routing.router import RouteInput
from simulator import Fleet
from simulator.workloads import text
from tests.gateway.fake_replica import Upstream
from tests.support import free_port, start_server

MODEL = "qwen2.5-14b"


def config(urls: list[str], **pool: Any) -> Any:
    return parse_config(
        {
            "pools": {
                "chat": {
                    "replicas": [{"url": u, "name": f"r{i}"} for i, u in enumerate(urls)],
                    "scrape": {"interval_s": 0.2},
                    "health": {"interval_s": 0.2, "failures_to_open": 100},
                    **pool,
                }
            },
            "server": {"expose_upstream_errors": True},
        }
    )


def chat(content: str, max_tokens: int = 4) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": True,
    }


async def stream(h: httpx.AsyncClient, url: str, body: dict[str, Any]) -> str:
    async with h.stream(
        "POST", url + "/v1/chat/completions", json=body, headers={"x-gateway-explain": "1"}
    ) as res:
        assert res.status_code == 200
        async for _ in res.aiter_bytes():
            pass
        return str(res.headers["x-gateway-decision"])


async def test_a_burst_on_one_new_prompt_is_prefilled_on_at_most_two_replicas() -> None:
    doc = text("burst-doc", 4096)
    async with Fleet(n=4, speedup=20.0) as fleet:
        app = create_app(config(fleet.urls))
        gw = await start_server(app, lifespan="on")
        try:
            async with httpx.AsyncClient(timeout=60) as h:
                await asyncio.gather(
                    *(stream(h, gw.url, chat(f"{doc}\nQuestion {i}?")) for i in range(20))
                )
            computed = [
                s["prompt_tokens"] - s["prefix_hit_tokens"]
                for s in (r.stats() for r in fleet.replicas)
            ]
            prefilled = sum(1 for c in computed if c >= 3000)
            assert 1 <= prefilled <= 2, computed
        finally:
            await gw.stop()


async def test_new_prefixes_one_at_a_time_spread_over_an_idle_fleet() -> None:
    async with Fleet(n=4, speedup=50.0) as fleet:
        app = create_app(config(fleet.urls))
        gw = await start_server(app, lifespan="on")
        try:
            async with httpx.AsyncClient(timeout=60) as h:
                for g in range(8):  # one after another: the fleet is idle at each arrival
                    await stream(h, gw.url, chat(text(f"group-{g}", 1024) + "\nq?"))
            served = [r.stats()["requests_served"] for r in fleet.replicas]
            assert sum(1 for s in served if s) >= 3, served
        finally:
            await gw.stop()


async def test_blocks_count_at_dispatch_and_a_failed_dispatch_takes_them_back() -> None:
    """Before any answer the chosen replica holds the chain in the index; a failed attempt takes
    back exactly the blocks it added, and a replica answering 503 ends up holding nothing."""
    bad, good = Upstream("bad", mode="error_503"), Upstream("good")
    servers = [await start_server(u) for u in (bad, good)]
    app = create_app(config([s.url for s in servers], policy="prefix_aware", retries=1))
    gw = await start_server(app, lifespan="on")
    try:
        gateway = app.gateway
        pool = gateway.pools["chat"]
        body = chat(text("fail-doc", 512) + "\nq?")
        parsed = parse_body("chat", orjson.dumps(body))
        routing = await gateway.router.route(
            parsed, pool, gateway.router.prompt(parsed), RouteInput("probe")
        )
        gateway.router.choose(pool, routing)
        routed = routing.routed
        n = len(routed.block_hashes)
        assert n and not any(routing.hits.values())
        d = await gateway.router.dispatch(pool, routing, "r0")
        assert (await gateway.index.match(routed.scope, routed.block_hashes, ["r0"]))["r0"] == n
        await d.failed("connection refused")
        d.done()
        assert (await gateway.index.match(routed.scope, routed.block_hashes, ["r0"]))["r0"] == 0
        assert pool.by_name["r0"].inflight == 0
        async with httpx.AsyncClient(timeout=30) as h:
            for _ in range(4):  # whichever replica is tried first, the 503 one fails over
                await stream(h, gw.url, body)
        hits = await gateway.index.match(routed.scope, routed.block_hashes, ["r0", "r1"])
        assert hits == {"r0": 0, "r1": n}
    finally:
        await gw.stop()
        await stop_all(servers)


async def test_dead_replica_dispatch_is_taken_back_and_the_retry_keeps_the_blocks() -> None:
    async with Fleet(n=1, speedup=50.0) as fleet:
        dead = f"http://127.0.0.1:{free_port()}"
        app = create_app(config([dead, fleet.urls[0]], policy="prefix_aware", retries=1))
        gw = await start_server(app, lifespan="on")
        try:
            body = chat(text("retry-doc", 512) + "\nq?")
            async with httpx.AsyncClient(timeout=30) as h:
                for _ in range(3):
                    await stream(h, gw.url, body)
            gateway = app.gateway
            pool = gateway.pools["chat"]
            parsed = parse_body("chat", orjson.dumps(body))
            routing = await gateway.router.route(
                parsed, pool, gateway.router.prompt(parsed), RouteInput("probe")
            )
            n = len(routing.routed.block_hashes)
            assert routing.hits.get("r0", 0) == 0 and routing.hits["r1"] == n
        finally:
            await gw.stop()


async def test_a_tenant_cache_salt_reaches_the_engine_and_scopes_the_index() -> None:
    up = Upstream("r0")
    server = await start_server(up)
    keys = {"a": "key-a-0123456789abcdef", "b": "key-b-0123456789abcdef"}
    cfg = parse_config(
        {
            "pools": {"chat": {"replicas": [{"url": server.url, "name": "r0"}],
                               "policy": "prefix_aware"}},  # fmt: skip
            "auth": "required",
            "tenants": [
                {"name": "a", "api_keys": [keys["a"]], "cache_salt": "salt-of-tenant-a"},
                {"name": "b", "api_keys": [keys["b"]]},
            ],
        }
    )
    app = create_app(cfg)
    gw = await start_server(app, lifespan="on")
    try:
        prompt = text("salted-doc", 256) + "\nq?"
        async with httpx.AsyncClient(timeout=30) as h:
            for tenant, salt in (("a", None), ("a", "mine"), ("b", None)):
                body = {**chat(prompt), "stream": False}
                if salt:
                    body["cache_salt"] = salt
                res = await h.post(
                    gw.url + "/v1/chat/completions",
                    json=body,
                    headers={"authorization": f"Bearer {keys[tenant]}"},
                )
                assert res.status_code == 200, res.text
        sent = [orjson.loads(b).get("cache_salt") for b in up.bodies]
        assert sent == ["salt-of-tenant-a", "salt-of-tenant-a/mine", None]
        # three scopes: nothing recorded for one tenant is a hit for another
        index = app.gateway.index
        stats = index.stats_now()
        assert stats.blocks_per_replica["r0"] == 3 * len(
            app.gateway.chunker.hash_text("x", app.gateway.chunker.chat_prompt(chat(prompt)["messages"]))
        )
    finally:
        await gw.stop()
        await server.stop()


def test_tier_hits_are_loaded_not_queued_prefill() -> None:
    """What a replica holds on a lower tier is loaded, not recomputed: a dispatch queues only the
    rest as prefill there (issue 42), and its whole prompt as KV held until it ends."""
    from gateway.routing.router import Dispatch
    from policies.types import RoutedRequest

    app = create_app(config(["http://127.0.0.1:9"]))
    pool = app.gateway.pools["chat"]
    replica = pool.replicas[0]
    routed = RoutedRequest("id", "m", "s", "p", 1600, list(range(100)), 16.0)
    view = replica.view(20, 0.0)  # 20 blocks on its GPU
    view.tier_hits = {"cpu": 50}  # 50 more on its host tier
    d = Dispatch(None, pool, replica, view, routed)
    assert (d.uncached, d.queued) == (1280, 480)
    assert (replica.inflight_prompt_tokens, replica.inflight_kv_tokens) == (480, 1600)
    d.done()
    assert (replica.inflight_prompt_tokens, replica.inflight_kv_tokens) == (0, 0)


def test_a_prefix_in_flight_is_held_once() -> None:
    """Requests in flight that share a prefix hold its KV once, as the engine's prefix cache
    does (issue 42): a second request on the same document adds only its own blocks, a new
    request that shares the prefix needs no room for it, and the prefix's KV is freed only when
    the last of them ends."""
    from gateway.routing.router import Dispatch, Routing
    from policies.types import RoutedRequest

    app = create_app(config(["http://127.0.0.1:9"]))
    pool = app.gateway.pools["chat"]
    replica = pool.replicas[0]
    replica.engine_kv = (16, 2400)  # the engine's KV: 2,400 tokens
    doc = list(range(1000, 1096))  # a 96-block document, then 4 blocks of a question each
    a = RoutedRequest("a", "m", "s", "p", 1600, [*doc, *range(4)], 16.0)
    b = RoutedRequest("b", "m", "s", "p", 1600, [*doc, *range(4, 8)], 16.0)
    da = Dispatch(None, pool, replica, replica.view(0, 0.0), a)
    assert replica.inflight_kv_tokens == 1600
    assert replica.kv_held(b.block_hashes) == 96
    assert replica.kv_held(doc[:90]) == 80  # to a multiple of KV_STRIDE (16 blocks)
    assert replica.kv_held(a.block_hashes) == 100  # a whole chain held
    db = Dispatch(None, pool, replica, replica.view(96, 0.0), b)
    assert replica.inflight_kv_tokens == 1664  # the document once, two questions
    c = RoutedRequest("c", "m", "s", "p", 1600, [*doc, *range(8, 12)], 16.0)
    other = RoutedRequest("o", "m", "s", "p", 1600, list(range(5000, 5100)), 16.0)
    routing = Routing(c, "", 0)
    routing.hits = {replica.name: 96}
    routing.epoch = pool.dispatches
    app.gateway.router._choose(pool, routing, 0.0)
    assert routing.views[0].kv_shared_tokens == 1536
    assert routing.views[0].kv_waits(1600) == 0  # its 64 tokens fit beside the two
    routing = Routing(other, "", 0)
    routing.epoch = pool.dispatches
    app.gateway.router._choose(pool, routing, 0.0)
    assert routing.views[0].kv_shared_tokens == 0
    assert routing.views[0].kv_waits(1600) == 2  # a new document waits for both to end
    da.done()
    assert replica.inflight_kv_tokens == 1600  # b still holds the document
    db.done()
    assert (replica.inflight_kv_tokens, replica.kv_blocks) == (0, {})
