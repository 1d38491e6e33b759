"""What the server layer answers by itself (gateway/transport/protocol.py, uvicorn under it): the
app's failures and uvicorn's own refusals are OpenAI-shaped JSON errors, read over a raw socket
(issue 39). The parser's 400s and the header caps' 431s are in tests/chaos/test_fuzz_transport.py,
against a gateway process."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from bench.harness import Served, serve, server_config
from gateway import create_app, parse_config
from gateway.transport.protocol import GuardedHttpToolsProtocol
from tests.support import start_server

ADMIN = "adm-errors-7f3a0c2e91"


async def exchange(port: int, data: bytes) -> tuple[int, dict[bytes, bytes], Any]:
    """Send `data` on a fresh connection; the answer's status, headers and JSON body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 5)  # each of these answers closes
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = dict(line.lower().split(b": ", 1) for line in lines[1:])
    assert int(headers[b"content-length"]) == len(body), raw
    return int(lines[0].split()[1]), headers, orjson.loads(body)


def openai_error(headers: dict[bytes, bytes], body: Any, code: str) -> None:
    assert headers[b"content-type"] == b"application/json" and headers[b"connection"] == b"close"
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == code, body


async def test_an_app_that_fails_before_answering_gets_a_json_500() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/raise":
            raise RuntimeError("a bug")
        # "/silent": returns without answering

    gw = await start_server(app, http=GuardedHttpToolsProtocol)
    try:
        for path in (b"/raise", b"/silent"):
            status, headers, body = await exchange(
                gw.port, b"GET %s HTTP/1.1\r\nhost: x\r\n\r\n" % path
            )
            assert status == 500
            openai_error(headers, body, "internal_error")
            assert body["error"]["type"] == "server_error"
    finally:
        await gw.stop()


async def test_a_gateway_route_that_fails_gets_a_json_500() -> None:
    """A route of the gateway's own (Starlette's part: /debug/decisions here) that raises: its
    500 is the gateway's error body, not Starlette's plain text."""
    cfg = parse_config({"pools": {"chat": {"replicas": ["http://127.0.0.1:9"]}},
                        "server": {"admin_key": ADMIN}, "tracing": {"exporter": "none"}})  # fmt: skip
    app = create_app(cfg)

    def broken() -> Any:
        raise RuntimeError("a bug")

    app.gateway.decisions = broken  # type: ignore[method-assign]
    gw = await start_server(app, lifespan="on", http=GuardedHttpToolsProtocol)
    try:
        status, headers, body = await exchange(
            gw.port,
            b"GET /debug/decisions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\n"
            b"connection: close\r\n\r\n" % ADMIN.encode(),
        )
        assert status == 500
        assert headers[b"content-type"] == b"application/json"
        assert body["error"]["code"] == "internal_error" and body["error"]["type"] == "server_error"
    finally:
        await gw.stop()


async def test_past_uvicorns_concurrency_limit_a_json_503() -> None:
    """uvicorn's `limit_concurrency` (not set by `gateway serve`, which holds
    `server.max_connections` itself) answers past it with the gateway's 503, not plain text."""
    held = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await held.wait()
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    config = server_config(app, http=GuardedHttpToolsProtocol)
    config.limit_concurrency = 1
    server, task = await serve(config, 15.0)
    port = int(server.servers[0].sockets[0].getsockname()[1])
    gw = Served(server, task, port)
    try:
        _, first = await asyncio.open_connection("127.0.0.1", port)
        first.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")  # holds the only slot
        await first.drain()
        status, headers, body = await exchange(port, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        assert status == 503 and b"retry-after" in headers
        openai_error(headers, body, "limit_concurrency")
        assert body["error"]["type"] == "service_unavailable_error"
        first.close()
    finally:
        held.set()
        await gw.stop()
