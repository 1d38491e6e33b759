"""No open proxy, no leaks: the gateway connects only to its configured replicas whatever a request
says; hop-by-hop headers and client credentials stay at the gateway; upstream errors reach clients
in OpenAI shape with nothing internal when `expose_upstream_errors: false`; admin routes need the
admin key; API keys never appear in logs, metrics, traces or status pages.

Replicas here have no configured names, so their names are their `host:port`: any leak of a name
is a leak of an internal address.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bench.harness import stop_all
from gateway import create_app, parse_config
from gateway.telemetry.tracing import Tracing
from tests.gateway.fake_replica import Upstream
from tests.support import Served, free_port, start_server

KEY_A = "sk-leak-alpha-0d5e8f1a2b"
KEY_B = "sk-leak-beta-77c3a9e4f0"
KEY_WRONG = "sk-leak-wrong-4c1b2a9d8e"
ADMIN = "adm-leak-admin-5f6e7d8c9b"
UPSTREAM_KEY = "up-leak-upstream-a1b2c3d4"
SECRETS = (KEY_A, KEY_B, KEY_WRONG, ADMIN, UPSTREAM_KEY)
CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "hello"}]}


@dataclass
class Evil:
    """A listener on loopback that nobody should ever connect to."""

    port: int
    connections: int = 0
    data: list[bytes] = field(default_factory=list)

    async def handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            self.data.append(await asyncio.wait_for(r.read(4096), 1))
        w.close()


@dataclass
class Rig:
    url: str
    port: int
    upstreams: list[Any]
    served: list[Served]
    evil: Evil
    spans: InMemorySpanExporter
    app: Any


@contextlib.asynccontextmanager
async def rig(
    upstreams: list[Any] | None = None,
    *,
    dead: int = 0,
    server: dict[str, Any] | None = None,
    pool: dict[str, Any] | None = None,
    admin: bool = True,
) -> AsyncIterator[Rig]:
    ups = upstreams if upstreams is not None else [Upstream("a"), Upstream("b")]
    served = [await start_server(u) for u in ups]
    evil = Evil(free_port())
    evil_server = await asyncio.start_server(evil.handle, "127.0.0.1", evil.port)
    replicas = [s.url for s in served] + [f"http://127.0.0.1:{free_port()}" for _ in range(dead)]
    cfg = {
        "server": {"expose_upstream_errors": False, **({"admin_key": ADMIN} if admin else {}),
                   **(server or {})},
        "pools": {"chat": {"replicas": replicas, "policy": "round_robin",
                           "health": {"interval_s": 0.2, "failures_to_open": 100},
                           "timeouts": {"connect_s": 1, "first_byte_s": 5, "idle_s": 5,
                                        "total_s": 10},
                           **(pool or {})}},
        "tenants": [
            {"name": "alpha", "api_keys": [KEY_A], "allowed_priorities": ["interactive", "batch"]},
            {"name": "beta", "api_keys": [KEY_B], "limits": {"requests_per_minute": 3}},
        ],
    }  # fmt: skip
    spans = InMemorySpanExporter()
    app = create_app(parse_config(cfg), tracing=Tracing(None, exporter=spans, environ={}))
    gw = await start_server(app, lifespan="on")
    try:
        yield Rig(gw.url, gw.port, ups, served, evil, spans, app)
    finally:
        await gw.stop()
        await stop_all(served)
        evil_server.close()
        await evil_server.wait_closed()


async def raw(port: int, data: bytes, read_s: float = 3.0) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(data)
    await w.drain()
    out = b""
    with contextlib.suppress(TimeoutError, ConnectionResetError):
        async with asyncio.timeout(read_s):
            while chunk := await r.read(65536):
                out += chunk
    w.close()
    return out


def req(
    target: bytes,
    *,
    method: bytes = b"POST",
    host: bytes = b"gw",
    extra: bytes = b"",
    body: dict[str, Any] | None = None,
) -> bytes:
    raw_body = orjson.dumps(body or CHAT) if method == b"POST" else b""
    return (
        method + b" " + target + b" HTTP/1.1\r\nhost: " + host + b"\r\n"
        + f"authorization: Bearer {KEY_A}\r\n".encode() + extra
        + b"content-type: application/json\r\nconnection: close\r\n"
        + b"content-length: %d\r\n\r\n" % len(raw_body) + raw_body
    )  # fmt: skip


def status(resp: bytes) -> int:
    return int(resp.split(b" ", 2)[1]) if resp.startswith(b"HTTP/1.1 ") else 0


# --- no open proxy -------------------------------------------------------------------------------


async def test_requests_cannot_steer_the_gateway_to_other_hosts_or_paths() -> None:
    async with rig() as r:
        evil = f"127.0.0.1:{r.evil.port}".encode()
        url = b"http://" + evil
        tries: list[tuple[str, bytes]] = [
            ("absolute-form target", req(url + b"/v1/chat/completions", host=evil)),
            ("absolute-form, other path", req(url + b"/admin/status", method=b"GET", host=evil)),
            ("Host header", req(b"/v1/chat/completions", host=evil)),
            ("X-Forwarded-Host", req(b"/v1/chat/completions", extra=b"x-forwarded-host: " + evil + b"\r\nx-forwarded-proto: http\r\nforwarded: host=" + evil + b"\r\n")),
            ("X-Original-URL", req(b"/v1/chat/completions", extra=b"x-original-url: " + url + b"/x\r\nx-rewrite-url: /admin/status\r\n")),
            ("scheme-relative path", req(b"//" + evil + b"/v1/chat/completions")),
            ("CONNECT", b"CONNECT " + evil + b" HTTP/1.1\r\nhost: " + evil + b"\r\n\r\n"),
            ("GET absolute-form", req(url + b"/", method=b"GET", host=evil)),
        ]  # fmt: skip
        for model in (f"http://127.0.0.1:{r.evil.port}/v1", f"127.0.0.1:{r.evil.port}", "../x"):
            tries.append((f"model={model}", req(b"/v1/chat/completions", body={**CHAT, "model": model})))  # fmt: skip
        served = 0
        for what, data in tries:
            resp = await raw(r.port, data)
            assert status(resp) < 500, (what, resp[:200])
            served += status(resp) == 200
        assert r.evil.connections == 0, r.evil.data
        # whatever was served was served by the configured replicas
        assert served >= 6 and sum(u.calls for u in r.upstreams) == served


async def test_path_tricks_never_reach_admin_routes() -> None:
    async with rig() as r:
        for target in (b"/v1/../admin/status", b"/v1/chat/completions/../../admin/status",
                       b"/%2e%2e/admin/status", b"/v1/%2e%2e/debug/decisions", b"//admin/status",
                       b"/admin/status/", b"/ADMIN/status", b"/admin//status", b"/admin/status%00",
                       b"/admin/status?key=" + ADMIN.encode(), b"/./admin/status"):  # fmt: skip
            resp = await raw(r.port, req(target, method=b"GET"))
            assert status(resp) in (307, 400, 401, 404, 405), (target, resp[:200])
            assert b"pools" not in resp and b"replicas" not in resp, (target, resp[:300])


async def test_redirects_do_not_echo_the_clients_host() -> None:
    async with rig() as r:
        resp = await raw(r.port, req(b"/health/", method=b"GET", host=b"evil.example"))
    assert b"evil.example" not in resp, resp[:300]


async def test_admin_routes_need_the_admin_key() -> None:
    routes = [("GET", "/admin/status"), ("GET", "/admin/config"), ("GET", "/debug/decisions"),
              ("POST", "/admin/reload")]  # fmt: skip
    wrong = [
        {},
        {"authorization": f"Bearer {KEY_A}"},  # a tenant key is not the admin key
        {"authorization": f"Bearer {ADMIN}x"},
        {"authorization": f"Bearer {ADMIN[:-1]}"},
        {"authorization": f"Basic {ADMIN}"},
        {"authorization": ADMIN},
        {"authorization": "Bearer"},
        {"x-admin-key": ADMIN},
        {"cookie": f"admin_key={ADMIN}"},
    ]
    async with rig() as r, httpx.AsyncClient(base_url=r.url) as h:
        for method, path in routes:
            for hdrs in wrong:
                res = await h.request(method, path, headers=hdrs, params={"key": ADMIN})
                assert res.status_code == 401, (method, path, hdrs, res.text)
                assert res.json()["error"]["type"] == "authentication_error"
            ok = await h.request(method, path, headers={"authorization": f"Bearer {ADMIN}"})
            assert ok.status_code in (200, 404), (method, path, ok.text)  # reload: no config file
    async with rig(admin=False) as r, httpx.AsyncClient(base_url=r.url) as h:
        for method, path in routes:
            res = await h.request(method, path, headers={"authorization": f"Bearer {ADMIN}"})
            assert res.status_code == 404, (method, path)


# --- what the upstream receives -------------------------------------------------------------------

HOP_BY_HOP_AND_CREDENTIALS = {
    "connection": "keep-alive, x-secret-hop",
    "keep-alive": "timeout=99",
    "x-secret-hop": "hop",
    "te": "trailers",
    "trailer": "x-checksum",
    "upgrade": "h2c",
    "proxy-connection": "keep-alive",
    "proxy-authorization": f"Basic {KEY_B}",
    "cookie": f"session={KEY_B}",
    "x-api-key": KEY_B,
    "api-key": KEY_B,
    "openai-organization": "org-client",
    "x-forwarded-for": "203.0.113.9",
    "forwarded": "for=203.0.113.9",
    "via": "1.1 evil",
}


@pytest.mark.parametrize("upstream_key", [None, UPSTREAM_KEY])
async def test_hop_by_hop_and_client_credentials_are_not_forwarded(
    upstream_key: str | None,
) -> None:
    pool = {"upstream_api_key": upstream_key} if upstream_key else {}
    async with rig([Upstream("a")], pool=pool) as r, httpx.AsyncClient(base_url=r.url) as h:
        for stream in (False, True):
            res = await h.post(
                "/v1/chat/completions",
                json={**CHAT, "stream": stream},
                headers={"authorization": f"Bearer {KEY_A}", **HOP_BY_HOP_AND_CREDENTIALS},
            )
            assert res.status_code == 200
        up = r.upstreams[0]
        assert up.calls == 2
        for got in up.headers:
            names = {k.decode().lower() for k in got}
            leaked = names & (set(HOP_BY_HOP_AND_CREDENTIALS) - {"connection"})
            assert not leaked, leaked
            # the gateway's own connection header only (keep-alive to the replica)
            assert b"x-secret-hop" not in got.get(b"connection", b"").lower(), got
            blob = b"\n".join(k + b": " + v for k, v in got.items())
            for secret in (KEY_A, KEY_B):
                assert secret.encode() not in blob
            auth = got.get(b"authorization")
            assert auth == (f"Bearer {upstream_key}".encode() if upstream_key else None), auth


# --- upstream errors and internal addresses ---------------------------------------------------------


def _asgi_error(status_code: int, body: bytes, ctype: bytes = b"application/json") -> Any:
    """A replica that answers every completion with this error (and is healthy otherwise)."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        ok = scope["path"] in ("/health", "/metrics", "/v1/models")
        if not ok:
            while (await receive()).get("more_body"):
                pass
        await send({"type": "http.response.start", "status": 200 if ok else status_code,
                    "headers": [(b"content-type", b"text/plain" if ok else ctype),
                                (b"x-internal-host", b"10.0.0.7:8000"),
                                (b"server", b"vllm/10.0.0.7")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"" if ok else body})

    return app


INTERNAL = "10.0.0.7"
ERROR_BODIES = {
    "vllm shape": (500, orjson.dumps({"error": {"message": f"CUDA OOM on {INTERNAL}", "type": "InternalServerError", "param": None, "code": 500}})),
    "sglang flat shape": (400, orjson.dumps({"object": "error", "message": f"bad at {INTERNAL}", "type": "BadRequest", "param": None, "code": 400})),
    "html page": (500, f"<html><body>nginx at {INTERNAL}:8000</body></html>".encode()),
    "plain traceback": (422, f'Traceback (most recent call last):\n  File "/srv/{INTERNAL}/app.py"'.encode()),
    "empty": (500, b""),
}  # fmt: skip


@pytest.mark.parametrize("case", list(ERROR_BODIES), ids=list(ERROR_BODIES))
async def test_upstream_error_bodies_are_openai_shaped_and_hide_internals(case: str) -> None:
    code, body = ERROR_BODIES[case]
    async with rig([_asgi_error(code, body)]) as r, httpx.AsyncClient(base_url=r.url) as h:
        for stream in (False, True):
            res = await h.post("/v1/chat/completions", json={**CHAT, "stream": stream},
                               headers={"authorization": f"Bearer {KEY_A}"})  # fmt: skip
            assert res.status_code == code
            err = res.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            text = res.text + "\n".join(f"{k}: {v}" for k, v in res.headers.items())
            assert INTERNAL not in text and "127.0.0.1" not in text, text


async def test_upstream_error_fields_other_than_message_are_not_passed_raw() -> None:
    body = orjson.dumps({"error": {"message": "x", "type": f"ConnectError({INTERNAL}:5557)",
                                   "param": f"http://{INTERNAL}/kv", "code": f"{INTERNAL}"}})  # fmt: skip
    async with rig([_asgi_error(500, body)]) as r, httpx.AsyncClient(base_url=r.url) as h:
        res = await h.post("/v1/chat/completions", json=CHAT,
                           headers={"authorization": f"Bearer {KEY_A}"})  # fmt: skip
    assert INTERNAL not in res.text, res.text


async def test_all_replicas_failed_message_names_no_address() -> None:
    ups = [Upstream("bad", mode="error_503")]
    async with rig(ups, dead=2, pool={"retries": 3}) as r, httpx.AsyncClient(base_url=r.url) as h:
        for stream in (False, True):
            res = await h.post("/v1/chat/completions", json={**CHAT, "stream": stream},
                               headers={"authorization": f"Bearer {KEY_A}"})  # fmt: skip
            assert res.status_code in (502, 503, 504)
            err = res.json()["error"]
            kind = {502: "server_error", 503: "service_unavailable_error", 504: "timeout_error"}
            assert err["message"] and err["type"] == kind[res.status_code], err
            assert "127.0.0.1" not in res.text and "connection" not in err["message"], res.text


async def test_broken_stream_error_event_names_no_address() -> None:
    async with rig([Upstream("dies", mode="die_midstream")]) as r:
        async with httpx.AsyncClient(base_url=r.url) as h:
            res = await h.post("/v1/chat/completions", json={**CHAT, "stream": True},
                               headers={"authorization": f"Bearer {KEY_A}"})  # fmt: skip
        assert res.status_code == 200 and b'data: {"error"' in res.content
        assert b"127.0.0.1" not in res.content


async def test_explain_header_names_no_internal_address() -> None:
    async with rig() as r, httpx.AsyncClient(base_url=r.url) as h:
        res = await h.post("/v1/chat/completions", json=CHAT,
                           headers={"authorization": f"Bearer {KEY_A}", "x-gateway-explain": "1"})  # fmt: skip
    assert res.status_code == 200
    assert "127.0.0.1" not in res.headers.get("x-gateway-decision", ""), res.headers


# --- secrets never recorded ------------------------------------------------------------------------


class Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = logging.Formatter("%(name)s %(levelname)s %(message)s").format(record)
        self.lines.append(text + " " + repr(record.__dict__))


async def test_api_keys_never_appear_in_logs_metrics_traces_or_status() -> None:
    recorder = Recorder()
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(recorder)
    root.setLevel(logging.DEBUG)
    client_side: list[str] = []  # what clients were answered, and what the gateway exposes
    upstream_side: list[str] = []  # what the replicas received
    try:
        pool = {"upstream_api_key": UPSTREAM_KEY}
        async with rig(
            [Upstream("a"), Upstream("b", mode="die_midstream")], dead=1, pool=pool
        ) as r:
            async with httpx.AsyncClient(base_url=r.url, timeout=10) as h:
                for i in range(12):
                    for key in (KEY_A, KEY_B, KEY_WRONG):
                        res = await h.post(
                            "/v1/chat/completions" if i % 2 else "/v1/completions",
                            json={**CHAT, "prompt": "hi", "stream": i % 3 == 0},
                            headers={"authorization": f"Bearer {key}",
                                     "x-priority": "batch" if i % 4 == 0 else "interactive",
                                     "x-gateway-explain": "1", "x-request-id": f"r{i}"},
                        )  # fmt: skip
                        client_side.append(f"{res.status_code} {res.text} {dict(res.headers)!r}")
                res = await h.post("/v1/chat/completions", content=b"{bad",
                                   headers={"authorization": f"Bearer {KEY_A}"})  # fmt: skip
                client_side.append(res.text)
                for path in ("/metrics", "/admin/status", "/debug/decisions", "/admin/config",
                             "/dashboard", "/ready", "/v1/models", "/openapi.json"):  # fmt: skip
                    # /v1/models is a client's route: under `auth: required` it takes a tenant key
                    key = KEY_A if path == "/v1/models" else ADMIN
                    res = await h.get(path, headers={"authorization": f"Bearer {key}"})
                    assert res.status_code == 200, path
                    client_side.append(res.text)
            client_side += [span.to_json() for span in r.spans.get_finished_spans()]
            for up in r.upstreams:
                upstream_side += [repr(hd) for hd in up.headers] + [b.decode() for b in up.bodies]
            ups_auth = {hd.get(b"authorization") for up in r.upstreams for hd in up.headers}
            assert ups_auth == {f"Bearer {UPSTREAM_KEY}".encode()}  # the configured key only
    finally:
        root.removeHandler(recorder)
        root.setLevel(old_level)
    codes = {line.split(" ", 1)[0] for line in client_side[:36]}
    assert {"200", "401", "429"} <= codes, codes  # served, refused, rate limited: all recorded
    assert recorder.lines and len(client_side) > 40
    gateway_side = "\n".join(client_side + recorder.lines)
    for secret in (KEY_A, KEY_B, KEY_WRONG, ADMIN, UPSTREAM_KEY):
        assert secret not in gateway_side, f"{secret[:12]}... leaked"
    for secret in (KEY_A, KEY_B, KEY_WRONG, ADMIN):
        assert secret not in "\n".join(upstream_side), f"{secret[:12]}... sent upstream"
