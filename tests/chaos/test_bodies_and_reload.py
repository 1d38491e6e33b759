"""Issue 22: slow bodies without credentials, request slots, reloads that half-apply, secrets shown,
idle upstream connections that outlive their TTL.

Real parts on loopback throughout: a `gateway --config` process where uvicorn's own settings matter
(request slots), the app in this loop elsewhere, raw sockets for the slow clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

from gateway import create_app, load_config
from gateway.config import ConfigError, parse_config
from gateway.transport.client import HttpClient
from tests.chaos.conftest import (
    ADMIN_KEY,
    MODEL,
    TENANT_KEY,
    GatewayProc,
    assert_openai_error,
    body_of,
    running_gateway,
    status_of,
)
from tests.gateway.fake_replica import Upstream
from tests.support import poll_until, start_server

BODY = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello"}]})
AUTH = {"authorization": f"Bearer {TENANT_KEY}"}
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
SLOTS = 4


def head(length: int, *, key: str | None = TENANT_KEY, path: str = "/v1/chat/completions") -> bytes:
    auth = f"authorization: Bearer {key}\r\n".encode() if key else b""
    return (
        b"POST " + path.encode() + b" HTTP/1.1\r\nhost: gw\r\n" + auth
        + b"content-type: application/json\r\ncontent-length: " + str(length).encode() + b"\r\n\r\n"
    )  # fmt: skip


def read_response(s: socket.socket, within_s: float) -> bytes:
    """The first whole response on `s`, or what arrived within `within_s` (b"" for nothing)."""
    s.settimeout(within_s)
    out = b""
    deadline = time.monotonic() + within_s
    try:
        while time.monotonic() < deadline:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
            head_, sep, body = out.partition(b"\r\n\r\n")
            if sep and b"content-length:" in head_.lower():
                n = int(head_.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                if len(body) >= n:
                    break
    except (TimeoutError, ConnectionResetError):
        pass
    return out


def header(resp: bytes, name: bytes) -> bytes | None:
    for line in resp.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == name:
            return v.strip()
    return None


# --- a gateway process with few request slots -------------------------------------------------


@pytest.fixture(scope="module")
def slotted(zero_upstream: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProc]:
    tmp = tmp_path_factory.mktemp("slotted")
    cfg: dict[str, Any] = {
        "server": {
            "admin_key": ADMIN_KEY,
            "log_level": "warning",
            "max_connections": SLOTS,
            "body_timeout_s": 5,
        },
        "pools": {"chat": {"replicas": [{"url": f"http://127.0.0.1:{zero_upstream}"}]}},
        "tenants": [{"name": "t", "api_keys": [TENANT_KEY]}],
    }
    with running_gateway(cfg, tmp) as proc:
        yield proc


def test_keyless_request_is_refused_before_its_body_is_read(slotted: GatewayProc) -> None:
    """No key, a big body promised and barely started: 401 at once, not after the body."""
    with socket.create_connection(("127.0.0.1", slotted.port)) as s:
        s.sendall(head(8 * 1024 * 1024 - 25, key=None) + b'{"model": "')
        resp = read_response(s, within_s=2.0)
    assert status_of(resp) == 401, resp[:200]
    assert_openai_error(401, body_of(resp))
    assert header(resp, b"connection") == b"close"
    with httpx.Client(base_url=slotted.url, timeout=5) as h:  # a wrong key the same way
        with socket.create_connection(("127.0.0.1", slotted.port)) as s:
            s.sendall(head(100_000, key="sk-wrong") + b"{")
            assert status_of(read_response(s, within_s=2.0)) == 401
        assert h.post("/v1/chat/completions", content=BODY, headers=AUTH).status_code == 200


def test_health_ready_metrics_answer_while_request_slots_are_full(slotted: GatewayProc) -> None:
    """SLOTS keyed clients hold every request slot with a slow body: probes still answer, and the
    next proxy request gets an OpenAI-shaped 503 with Retry-After."""
    holders = []
    try:
        for _ in range(SLOTS):
            s = socket.create_connection(("127.0.0.1", slotted.port))
            s.sendall(head(100_000) + b'{"model": "')
            holders.append(s)
        with httpx.Client(base_url=slotted.url, timeout=5) as h:
            deadline = time.monotonic() + 3
            while True:
                res = h.post("/v1/chat/completions", content=BODY, headers=AUTH)
                if res.status_code == 503 or time.monotonic() > deadline:
                    break
            assert res.status_code == 503, res.text
            err = res.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, err
            assert res.headers["content-type"] == "application/json"
            assert int(res.headers["retry-after"]) >= 1
            for path in ("/health", "/ready", "/metrics"):
                assert h.get(path).status_code == 200, path
    finally:
        for s in holders:
            s.close()
    with httpx.Client(base_url=slotted.url, timeout=5) as h:  # slots come back when they leave
        deadline = time.monotonic() + 5
        while h.post("/v1/chat/completions", content=BODY, headers=AUTH).status_code != 200:
            assert time.monotonic() < deadline, "request slots were not released"
            time.sleep(0.05)


# --- the app in this loop --------------------------------------------------------------------


def gw_config(upstream_url: str, **server: Any) -> dict[str, Any]:
    return {
        "server": {"admin_key": ADMIN_KEY, **server},
        "pools": {"chat": {"replicas": [upstream_url], "health": {"interval_s": 0.2}}},
        "tenants": [{"name": "t", "api_keys": [TENANT_KEY]}],
    }


async def _read_async(
    port: int, data: bytes, trickle: bytes, every_s: float, within_s: float
) -> tuple[bytes, int]:
    """Send `data`, then one byte of `trickle` every `every_s`; the answer, and how many bytes of
    the trickle had been sent when its head was in."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    out = b""
    sent = 0

    async def trickling() -> None:
        nonlocal sent
        for b in trickle:
            await asyncio.sleep(every_s)
            writer.write(bytes([b]))
            sent += 1
            await writer.drain()

    task = asyncio.create_task(trickling())
    try:
        async with asyncio.timeout(within_s):
            while b"\r\n\r\n" not in out:
                chunk = await reader.read(65536)
                if not chunk:
                    break
                out += chunk
    except TimeoutError:
        pass
    finally:
        task.cancel()
        writer.close()
    return out, sent


async def test_body_deadline_is_for_the_whole_body() -> None:
    """A byte every 0.25 s never trips a per-piece timeout of 1 s; the whole-body deadline does:
    the 408 comes while the body is still arriving, before its 8th byte (twice the deadline's
    worth of bytes; the gateway and the sender share this loop, so a slow machine delays both)."""
    up = Upstream("a")
    su = await start_server(up)
    app = create_app(parse_config(gw_config(su.url, body_timeout_s=1)))
    gw = await start_server(app, lifespan="on")
    try:
        resp, sent = await _read_async(
            gw.port, head(10_000) + b'{"model": "', b"m" * 100, every_s=0.25, within_s=5
        )
        assert status_of(resp) == 408, resp[:200]
        assert 1 <= sent < 8, sent  # pieces kept coming, and the deadline still fired
    finally:
        await gw.stop()
        await su.stop()


async def test_bodies_in_flight_have_a_byte_cap() -> None:
    """`server.max_body_bytes_in_flight` bounds request-body bytes held at once: past it a new body
    gets an OpenAI-shaped 503 (Retry-After) before it is read; the bytes come back when a body is done."""
    up = Upstream("a")
    su = await start_server(up)
    mib = 1 << 20
    app = create_app(
        parse_config(gw_config(su.url, max_body_bytes=mib, max_body_bytes_in_flight=mib + mib // 2))
    )
    gw = await start_server(app, lifespan="on")
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(head(mib) + b" " * (mib - 100))  # held: almost 1 MiB, not finished
        await writer.drain()
        await poll_until(lambda: app.bodies.held >= mib - 100, timeout_s=5)
        async with httpx.AsyncClient(base_url=gw.url, timeout=5) as h:
            big = orjson.dumps(
                {"model": MODEL, "messages": [{"role": "user", "content": "x" * 600_000}]}
            )
            res = await h.post("/v1/chat/completions", content=big, headers=AUTH)
            assert res.status_code == 503, res.text
            err = res.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["code"] == "body_bytes_in_flight" and "retry-after" in res.headers
            assert (
                await h.post("/v1/chat/completions", content=BODY, headers=AUTH)
            ).status_code == 200
            writer.close()
            await poll_until(lambda: app.bodies.held == 0, timeout_s=5)
            res = await h.post("/v1/chat/completions", content=big, headers=AUTH)
            assert res.status_code == 200, res.text
    finally:
        await gw.stop()
        await su.stop()


def test_in_flight_cap_must_hold_one_body() -> None:
    with pytest.raises(ConfigError, match="max_body_bytes_in_flight: .* less than max_body_bytes"):
        parse_config(
            {
                "server": {"max_body_bytes": 2 << 20, "max_body_bytes_in_flight": 1 << 20},
                "pools": {"chat": {"replicas": ["http://a:1"]}},
            }
        )


# --- reloads apply completely or not at all --------------------------------------------------


def write(path: Path, upstream_url: str, max_inflight: int, index: Any = None) -> None:
    pool = {"replicas": [upstream_url], "health": {"interval_s": 0.2}}
    cfg: dict[str, Any] = {
        "server": {"admin_key": ADMIN_KEY},
        "pools": {"chat": {**pool, "max_inflight_per_replica": max_inflight}},
    }
    if index is not None:
        cfg["index"] = index
    path.write_text(yaml.safe_dump(cfg))


def _bad_tokenizer(tmp: Path) -> dict[str, Any]:
    bogus = tmp / "tokenizer.json"
    bogus.write_text("this file exists, and is not a tokenizer\n")
    return {"chunking": {"mode": "tokens", "tokenizer": str(bogus)}}


@contextlib.asynccontextmanager
async def reloadable(
    tmp_path: Path,
) -> AsyncIterator[tuple[Path, str, Any, httpx.AsyncClient]]:
    """A gateway serving `routes.yaml` (watched, admin on) in front of one fake upstream: the
    file, the upstream's URL, the app, an admin client."""
    su = await start_server(Upstream("a"))
    path = tmp_path / "routes.yaml"
    write(path, su.url, max_inflight=64)
    app = create_app(load_config(path), config_path=str(path))
    gw = await start_server(app, lifespan="on")
    try:
        async with httpx.AsyncClient(base_url=gw.url, timeout=10, headers=ADMIN) as h:
            yield path, su.url, app, h
    finally:
        await gw.stop()
        await su.stop()


async def test_reload_that_fails_to_apply_changes_nothing(tmp_path: Path) -> None:
    async with reloadable(tmp_path) as (path, url, app, h):
        before = (await h.get("/admin/config")).json()["config"]
        write(path, url, max_inflight=3, index=_bad_tokenizer(tmp_path))
        res = await h.post("/admin/reload")
        assert res.status_code == 422, res.text
        err = res.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["code"] == "config_not_applied" and res.json()["applied"] is False
        status = (await h.get("/admin/status")).json()
        assert [r["max_inflight"] for r in status["pools"][0]["replicas"]] == [64]
        info = (await h.get("/admin/config")).json()
        assert info["config"] == before
        assert info["version"]["last_error"] and "not applied" in info["version"]["last_error"]
        assert info["version"]["reloads"] == 0
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        assert (await h.post("/v1/chat/completions", json=chat)).status_code == 200
        write(path, url, max_inflight=7)
        res = await h.post("/admin/reload")
        assert res.status_code == 200 and res.json()["applied"] is True
        info = (await h.get("/admin/config")).json()
        assert info["version"]["last_error"] is None and info["version"]["reloads"] == 1
        status = (await h.get("/admin/status")).json()
        assert [r["max_inflight"] for r in status["pools"][0]["replicas"]] == [7]


async def test_file_watcher_survives_a_reload_that_fails_to_apply(tmp_path: Path) -> None:
    async with reloadable(tmp_path) as (path, url, app, h):

        async def version() -> dict[str, Any]:
            return (await h.get("/admin/config")).json()["version"]  # type: ignore[no-any-return]

        write(path, url, max_inflight=3, index=_bad_tokenizer(tmp_path))
        deadline = time.monotonic() + 10
        while not (await version())["last_error"]:
            assert time.monotonic() < deadline, "the watcher never reported the failed reload"
            await asyncio.sleep(0.1)
        assert app.gateway.pools["chat"].replicas[0].max_inflight == 64
        write(path, url, max_inflight=5)  # a later edit still applies
        await poll_until(
            lambda: app.gateway.pools["chat"].replicas[0].max_inflight == 5, timeout_s=10
        )
        assert (await version())["last_error"] is None


# --- secrets in URLs ---------------------------------------------------------------------------

SECRETS = ("idx-pw-1", "rl-pw-2", "rep-pw-3", "tr-pw-4")


def _secret_config(replica: str) -> dict[str, Any]:
    return {
        "server": {"admin_key": ADMIN_KEY},
        "pools": {"chat": {"replicas": [replica]}},
        "index": {"redis_url": "redis://user:idx-pw-1@127.0.0.1:6379/0"},
        "ratelimit": {"redis_url": "redis://:rl-pw-2@127.0.0.1:6379/1"},
    }


def test_gateway_check_masks_url_passwords(tmp_path: Path) -> None:
    cfg = _secret_config("http://bob:rep-pw-3@127.0.0.1:9001")
    cfg["tracing"] = {"exporter": "otlp_http", "endpoint": "http://t:tr-pw-4@127.0.0.1:4318"}
    path = tmp_path / "secret.yaml"
    path.write_text(yaml.safe_dump(cfg))
    res = subprocess.run(
        [sys.executable, "-m", "gateway", "check", "--config", str(path)],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    for secret in SECRETS:
        assert secret not in res.stdout + res.stderr, secret
    shown = json.loads(res.stdout)
    assert shown["index"]["redis_url"] == "redis://user:***@127.0.0.1:6379/0"
    assert shown["ratelimit"]["redis_url"] == "redis://:***@127.0.0.1:6379/1"
    assert shown["pools"]["chat"]["replicas"][0]["url"] == "http://bob:***@127.0.0.1:9001"
    assert shown["tracing"]["endpoint"] == "http://t:***@127.0.0.1:4318"


async def test_admin_config_masks_url_passwords() -> None:
    up = Upstream("a")
    su = await start_server(up)
    replica = su.url.replace("http://", "http://bob:rep-pw-3@")
    app = create_app(parse_config(_secret_config(replica)))
    gw = await start_server(app, lifespan="on")
    try:
        async with httpx.AsyncClient(base_url=gw.url, timeout=10, headers=ADMIN) as h:
            res = await h.get("/admin/config")
            assert res.status_code == 200
            for secret in SECRETS:
                assert secret not in res.text, secret
            cfg = res.json()["config"]
            assert cfg["index"]["redis_url"] == "redis://user:***@127.0.0.1:6379/0"
            assert cfg["pools"]["chat"]["replicas"][0]["url"].startswith(
                "http://bob:***@127.0.0.1:"
            )
    finally:
        await gw.stop()
        await su.stop()


# --- idle upstream connections -----------------------------------------------------------------


async def test_idle_upstream_connections_close_after_their_ttl() -> None:
    """A pooled connection is closed once idle for idle_ttl_s, with no further request to notice."""
    closed = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        await reader.read()  # EOF: the pool hung up
        closed.set()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = HttpClient(1.0, idle_ttl_s=0.3)
    try:
        resp = await pool.request(f"http://127.0.0.1:{port}", b"GET", b"/", [])
        assert await resp.read_all(100) == b"ok"
        t0 = time.monotonic()
        async with asyncio.timeout(3):
            await closed.wait()
        assert time.monotonic() - t0 >= 0.25
    finally:
        await pool.aclose()
        server.close()
        await server.wait_closed()
