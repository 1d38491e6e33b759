"""Hot reload: a changed config file swaps in without dropping in-flight requests or losing state."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import yaml

from gateway import create_app, load_config
from tests.gateway.fake_replica import Upstream
from tests.support import poll_until, start_server

ADMIN = "admin-key-0123456789"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}


def write(path: Path, replicas: list[str], **extra: Any) -> None:
    cfg = {
        "server": {"admin_key": ADMIN},
        "pools": {"chat": {"replicas": replicas, "policy": "round_robin", "health": {"interval_s": 0.2}}},
        **extra,
    }
    path.write_text(yaml.safe_dump(cfg))


async def test_reload_adds_and_drains_replicas_without_dropping_requests(tmp_path: Path) -> None:
    a, b = Upstream("a", delay_s=0.5), Upstream("b")
    sa, sb = await start_server(a), await start_server(b)
    path = tmp_path / "routes.yaml"
    write(path, [sa.url])
    app = create_app(load_config(path), config_path=str(path))
    gw = await start_server(app, lifespan="on")
    admin = {"authorization": f"Bearer {ADMIN}"}
    try:
        async with httpx.AsyncClient(timeout=10) as h:
            state_a = app.gateway.pools["chat"].replicas[0]
            slow = asyncio.create_task(h.post(gw.url + "/v1/chat/completions", json=CHAT))
            await poll_until(lambda: a.calls == 1)
            write(path, [sb.url])  # a goes away while its request is in flight
            res = await h.post(gw.url + "/admin/reload", headers=admin)
            assert res.status_code == 200 and res.json()["applied"] is True
            assert (await slow).status_code == 200  # the in-flight request finished on a
            assert state_a.draining
            for _ in range(4):
                assert (await h.post(gw.url + "/v1/chat/completions", json=CHAT)).status_code == 200
            assert b.calls == 4 and a.calls == 1
            write(path, [sb.url, sa.url])  # a comes back: the file watcher picks it up
            await poll_until(lambda: len(app.gateway.pools["chat"].replicas) == 2, timeout_s=10)
            state_b = app.gateway.pools["chat"].by_name[app.gateway.pools["chat"].replicas[0].name]
            write(path, [sb.url, sa.url], index={"capacity_blocks": 1000})
            assert (await h.post(gw.url + "/admin/reload", headers=admin)).json()["applied"]
            # replicas that stay keep their state object (circuit, counters, learned load)
            assert app.gateway.pools["chat"].replicas[0] is state_b
            info = (await h.get(gw.url + "/admin/config", headers=admin)).json()
            assert info["version"]["reloads"] == 3 and info["version"]["last_error"] is None
            assert info["config"]["index"]["capacity_blocks"] == 1000
    finally:
        await gw.stop()
        await sa.stop()
        await sb.stop()


async def test_invalid_config_keeps_the_running_one(tmp_path: Path) -> None:
    up = Upstream("a")
    served = await start_server(up)
    path = tmp_path / "routes.yaml"
    write(path, [served.url])
    app = create_app(load_config(path), config_path=str(path))
    gw = await start_server(app, lifespan="on")
    try:
        async with httpx.AsyncClient(timeout=10) as h:
            path.write_text("pools: {chat: {replicas: [ftp://nope]}}\n")
            res = await h.post(gw.url + "/admin/reload", headers={"authorization": f"Bearer {ADMIN}"})
            assert res.status_code == 422
            assert "pools.chat.replicas[0].url: not an http(s) URL" in res.json()["version"]["last_error"]
            assert (await h.post(gw.url + "/v1/chat/completions", json=CHAT)).status_code == 200
    finally:
        await gw.stop()
        await served.stop()


async def test_sighup_reloads(tmp_path: Path) -> None:
    a, b = Upstream("a"), Upstream("b")
    sa, sb = await start_server(a), await start_server(b)
    path = tmp_path / "routes.yaml"
    write(path, [sa.url])
    app = create_app(load_config(path), config_path=str(path))
    gw = await start_server(app, lifespan="on")
    try:
        write(path, [sb.url])
        os.kill(os.getpid(), signal.SIGHUP)
        await poll_until(lambda: [r.url for r in app.gateway.pools["chat"].replicas] == [sb.url])
        async with httpx.AsyncClient(timeout=10) as h:
            assert (await h.post(gw.url + "/v1/chat/completions", json=CHAT)).status_code == 200
        assert b.calls == 1
    finally:
        await gw.stop()
        await sa.stop()
        await sb.stop()
