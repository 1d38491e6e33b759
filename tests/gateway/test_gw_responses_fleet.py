"""The Responses API behind several gateways (issue 35): which replica made each response is
shared through the fleet's Redis, so a response made through one gateway is continued
(`previous_response_id`), retrieved, cancelled and deleted through another and lands on the
replica that holds it. Without Redis each gateway keeps its own map (fail-open).

Two gateway apps with one real Redis (their own fleet name: their own keys) in front of the
same simulated replicas; round robin, so a follow-up the gateway could not place goes elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
from redis.asyncio import Redis

from bench.harness import stop_all
from gateway import create_app, parse_config
from gateway.fleet.shared_load import FleetLoad
from gateway.routing.sticky import SharedHomes
from simulator.fleet import Fleet
from tests.support import Served, free_port, start_server

REDIS_URL = "redis://127.0.0.1:6379/0"
MODEL = "qwen2.5-14b"


def _config(fleet: Fleet, name: str, redis_url: str = REDIS_URL) -> dict[str, Any]:
    return {
        "pools": {"chat": {
            "replicas": [{"url": u, "name": f"r{i}"} for i, u in enumerate(fleet.urls)],
            "policy": "round_robin",
            "health": {"interval_s": 0.2},
            "scrape": {"enabled": False},
        }},
        "fleet": {"shared_load": True, "redis_url": redis_url, "name": name},
        "tracing": {"exporter": "none"},
    }  # fmt: skip


@contextlib.asynccontextmanager
async def _gateways(cfg: dict[str, Any], n: int) -> AsyncIterator[list[Served]]:
    served: list[Served] = []
    try:
        for _ in range(n):
            served.append(await start_server(create_app(parse_config(cfg)), lifespan="on"))
        yield served
    finally:
        await stop_all(served)


@contextlib.asynccontextmanager
async def _fleet_keys(name: str) -> AsyncIterator[None]:
    try:
        yield
    finally:
        r = Redis.from_url(REDIS_URL)
        try:
            keys = [k async for k in r.scan_iter(match=f"kvgw:fleet:{{{name}}}*")]
            if keys:
                await r.delete(*keys)
        finally:
            await r.aclose()


async def _call(method: str, url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as h, h.request(method, url, json=body) as res:
        raw = await res.read()
        return res.status, orjson.loads(raw) if raw[:1] == b"{" else raw


async def _create(url: str, stream: bool = False, **extra: Any) -> tuple[int, Any]:
    body = {"model": MODEL, "input": "Say hi.", "max_output_tokens": 4, "stream": stream, **extra}
    status, answer = await _call("POST", url + "/v1/responses", body)
    if stream and status == 200:
        events = [e for e in answer.decode().split("\n\n") if e]
        answer = orjson.loads(events[-1].split("\ndata: ", 1)[1])["response"]
    return status, answer


async def _holders(fleet: Fleet, rid: str) -> list[int]:
    """The replicas that hold response `rid` (asked directly)."""
    out = []
    for i, u in enumerate(fleet.urls):
        if (await _call("GET", f"{u}/v1/responses/{rid}"))[0] == 200:
            out.append(i)
    return out


async def test_a_response_made_through_one_gateway_is_followed_up_through_another() -> None:
    name = f"t35-{uuid.uuid4().hex[:10]}"
    async with Fleet(n=3, speedup=1000.0) as fleet, _fleet_keys(name):
        async with _gateways(_config(fleet, name), 2) as (a, b):
            status, first = await _create(a.url)
            assert status == 200
            rid = first["id"]
            home = await _holders(fleet, rid)
            assert len(home) == 1
            # round robin at B would send two of three follow-ups to replicas without it
            for _ in range(3):
                status, follow = await _create(b.url, previous_response_id=rid)
                assert status == 200, follow
                assert await _holders(fleet, follow["id"]) == home
            # a streamed one, made through B, continued through A
            status, streamed = await _create(b.url, stream=True)
            assert status == 200
            s_home = await _holders(fleet, streamed["id"])
            for _ in range(3):
                status, follow = await _create(a.url, previous_response_id=streamed["id"])
                assert status == 200, follow
                assert await _holders(fleet, follow["id"]) == s_home

            # by id, through the other gateway, to the replica that made it
            status, got = await _call("GET", f"{b.url}/v1/responses/{rid}")
            assert status == 200 and got == first
            status, cancel = await _call("POST", f"{b.url}/v1/responses/{rid}/cancel")
            assert status == 400  # the home's own answer: it finished (others answer 404)
            assert cancel["error"]["message"] == "Cannot cancel a synchronous response."
            assert cancel["error"]["type"] == "invalid_request_error"
            status, gone = await _call("DELETE", f"{b.url}/v1/responses/{rid}")
            assert status == 200 and gone == {"id": rid, "object": "response.deleted",
                                              "deleted": True}
            assert await _holders(fleet, rid) == []
            status, err = await _call("GET", f"{b.url}/v1/responses/{rid}")
            assert status == 404 and err["error"]["code"] == "response_not_found", err
            assert err["error"]["type"] == "not_found_error" and err["error"]["param"] == "response_id"
            # one situation, one answer (issue 39): A made it and still knows where, so it asks
            # that replica, whose 404 makes A forget it too; A answers the very body B did,
            # before and after it forgot, and so does a delete or a cancel of it
            for method, path in [("GET", ""), ("GET", ""), ("DELETE", ""), ("POST", "/cancel")]:
                for gw in (a, b):
                    got_status, got = await _call(method, f"{gw.url}/v1/responses/{rid}{path}")
                    assert (got_status, got) == (404, err), (method, gw.url, got)

            status, err = await _call("GET", f"{a.url}/v1/responses/resp_nobodyknows")
            assert status == 404 and set(err["error"]) == {"message", "type", "param", "code"}
            assert "resp_nobodyknows" in err["error"]["message"]
            status, err = await _call("PUT", f"{a.url}/v1/responses/{follow['id']}")
            assert status == 405 and err["error"]["code"] == "method_not_allowed"


async def test_without_redis_each_gateway_follows_up_its_own_responses() -> None:
    """Redis down: never a failed request; each gateway still knows what it made (fail-open)."""
    dead = f"redis://127.0.0.1:{free_port()}/0"
    async with Fleet(n=3, speedup=1000.0) as fleet:
        cfg = _config(fleet, f"t35-{uuid.uuid4().hex[:10]}", redis_url=dead)
        async with _gateways(cfg, 1) as (a,):
            for stream in (False, True):
                status, first = await _create(a.url, stream=stream)
                assert status == 200
                home = await _holders(fleet, first["id"])
                for _ in range(3):
                    status, follow = await _create(a.url, previous_response_id=first["id"])
                    assert status == 200, follow
                    assert await _holders(fleet, follow["id"]) == home
                status, got = await _call("GET", f"{a.url}/v1/responses/{first['id']}")
                assert status == 200 and got["id"] == first["id"]



async def test_the_fleets_map_is_bounded_and_forgets_after_its_ttl() -> None:
    """At most `max_entries` ids (the oldest go first), each forgotten after `ttl_s`."""
    name = f"t35-{uuid.uuid4().hex[:10]}"
    cfg = parse_config({"pools": {"chat": {"replicas": ["http://127.0.0.1:1"]}},
                        "fleet": {"shared_load": True, "redis_url": REDIS_URL, "name": name}})
    fleet = FleetLoad(cfg, _no_snapshot, lambda _pool: None)  # its Redis client, never started
    homes = SharedHomes(fleet, max_entries=3, ttl_s=0.5)
    r = Redis.from_url(REDIS_URL)
    async with _fleet_keys(name):
        try:
            for i in range(5):
                await homes.put(f"resp_{i}", "chat", f"http://10.0.0.{i}:8000")
            got = [await homes.get(f"resp_{i}") for i in range(5)]
            assert got == [None, None, *[("chat", f"http://10.0.0.{i}:8000") for i in (2, 3, 4)]]
            assert await r.hlen(homes.key) == 3 and await r.zcard(homes.key + ":t") == 3
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while await homes.get("resp_4") is not None or await r.exists(homes.key):
                assert loop.time() < deadline, "not forgotten after its ttl"
                await asyncio.sleep(0.05)  # Redis expires the keys; nothing to wait on
            assert homes.failures == 0
        finally:
            await r.aclose()
            await fleet.stop()


def _no_snapshot() -> Any:
    raise AssertionError("the map needs no snapshot")
