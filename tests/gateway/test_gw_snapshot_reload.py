"""A reload in the middle of 200 in-flight streams: every request runs on exactly one snapshot.

The two configs differ in every part a request reads: the pool's replica and upstream key
(pools), the tenant's cache salt and rate limit (tenants), whether the decision header may be
shown (server). 50 streams are being relayed from replica A and 150 wait in admission when the
config that moves the pool to replica B is applied. Each request's answer headers and what its
replica received must all belong to one config: the old one for the 200 that arrived before the
reload (the 150 queued ones included), the new one for those after it. None may fail.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import orjson
import yaml

from gateway import create_app, load_config
from tests.gateway.fake_replica import Upstream
from tests.support import poll_until, start_server

ADMIN = "admin-key-0123456789"
KEY = "tenant-key-0123456789"
BEFORE, AFTER = 200, 50
SLOTS = 50  # max_inflight_per_replica: the other 150 wait in the admission queue


def write(path: Path, version: int, replica_url: str) -> None:
    cfg = {
        "server": {"admin_key": ADMIN, "expose_upstream_errors": version == 1},
        "priority_classes": {
            "interactive": {"rank": 0, "max_queue_wait_s": 60, "max_queue_len": 1000},
        },
        "ratelimit": {"backend": "memory"},
        "tenants": [
            {
                "name": "t",
                "api_keys": [KEY],
                "cache_salt": f"salt-{version}-0123456789",
                "limits": {"requests_per_minute": 100_000 * version},
            }
        ],
        "pools": {
            "chat": {
                "replicas": [replica_url],
                "policy": "round_robin",
                "upstream_api_key": f"upstream-key-{version}",
                "max_inflight_per_replica": SLOTS,
                "health": {"interval_s": 0.2},
                "timeouts": {"total_s": 60, "first_byte_s": 30, "idle_s": 30},
            }
        },
    }
    path.write_text(yaml.safe_dump(cfg))


def config_seen(res: httpx.Response, body: bytes, upstream_headers: dict[bytes, bytes]) -> set[int]:
    """Which config version each observable part of one request came from."""
    sent = orjson.loads(body)
    auth = upstream_headers[b"authorization"].decode()
    return {
        int(auth.rsplit("-", 1)[1]),  # the pool's upstream key
        int(sent["cache_salt"].split("-")[1]),  # the tenant's salt
        int(res.headers["x-ratelimit-limit-requests"]) // 100_000,  # the tenant's limit
        1 if "x-gateway-decision" in res.headers else 2,  # the server's expose setting
    }


async def test_reload_mid_streams_gives_every_request_exactly_one_snapshot(tmp_path: Path) -> None:
    a = Upstream("a", mode="drip", chunks=20, chunk_delay_s=0.05)
    b = Upstream("b", mode="drip", chunks=20, chunk_delay_s=0.05)
    sa, sb = await start_server(a), await start_server(b)
    path = tmp_path / "routes.yaml"
    write(path, 1, sa.url)
    app = create_app(load_config(path), config_path=str(path))
    gw = await start_server(app, lifespan="on")
    limits = httpx.Limits(max_connections=BEFORE + AFTER)
    try:
        async with httpx.AsyncClient(timeout=60, limits=limits) as h:

            async def one(i: int) -> tuple[str, httpx.Response, bytes]:
                rid = f"req-{i}"
                body = {"model": "m", "stream": True,
                        "messages": [{"role": "user", "content": f"question {i}"}]}  # fmt: skip
                headers = {"authorization": f"Bearer {KEY}", "x-request-id": rid,
                           "x-gateway-explain": "1"}  # fmt: skip
                async with h.stream("POST", gw.url + "/v1/chat/completions", json=body,
                                    headers=headers) as res:  # fmt: skip
                    data = await res.aread()
                return rid, res, data

            before = [asyncio.create_task(one(i)) for i in range(BEFORE)]
            queued = lambda: app.gateway.admission.stats().queues.get("chat", {})  # noqa: E731
            await poll_until(lambda: a.calls == SLOTS, timeout_s=20)
            await poll_until(
                lambda: sum(q.queued for q in queued().values()) == BEFORE - SLOTS, timeout_s=20
            )
            assert a.completed == 0  # every old request is still streaming or queued
            write(path, 2, sb.url)
            res = await h.post(gw.url + "/admin/reload", headers={"authorization": f"Bearer {ADMIN}"})
            assert res.status_code == 200 and res.json()["applied"] is True
            after = [asyncio.create_task(one(BEFORE + i)) for i in range(AFTER)]
            done = await asyncio.gather(*before, *after)
    finally:
        await gw.stop()
        await sa.stop()
        await sb.stop()

    received = {}
    for replica in (a, b):
        for body, hdrs in zip(replica.bodies, replica.headers, strict=True):
            received[hdrs[b"x-request-id"].decode()] = (replica.name, body, hdrs)
    assert len(received) == BEFORE + AFTER  # each request reached one replica, once
    for i, (rid, res, data) in enumerate(done):
        assert res.status_code == 200, (rid, res.status_code, data[:200])
        assert data.rstrip().endswith(b"data: [DONE]"), (rid, data[-200:])  # a whole stream
        replica, body, hdrs = received[rid]
        seen = config_seen(res, body, hdrs)
        expected = 1 if i < BEFORE else 2
        assert seen == {expected}, (rid, seen)  # never a mix of two configs
        assert replica == ("a" if expected == 1 else "b"), (rid, replica)
    assert a.calls == BEFORE and b.calls == AFTER
