"""Shutdown and answer memory: a stream that outlasts the graceful shutdown ends with one error
event and a terminated body (its upstream hung up); non-streamed answers held at once are capped
(`server.max_answer_bytes_in_flight`), past it a request gets an OpenAI-shaped 503."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
import orjson
import uvicorn

from bench.access_log import access_lines
from gateway import create_app, parse_config
from gateway.transport.protocol import GuardedHttpToolsProtocol
from tests.gateway.fake_replica import Upstream
from tests.support import poll_until, start_server

KEY = "sk-shutdown-test-7c1d"
STREAM = {
    "model": "test-model",
    "messages": [{"role": "user", "content": "hello"}],
    "stream": True,
}
CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "hello"}]}


def _config(replicas: list[str], server: dict[str, Any] | None = None) -> Any:
    return parse_config(
        {
            "server": server or {},
            "pools": {
                "chat": {
                    "replicas": replicas,
                    "policy": "round_robin",
                    "health": {"interval_s": 0.2, "failures_to_open": 100},
                    "timeouts": {"connect_s": 1, "first_byte_s": 5, "idle_s": 5, "total_s": 20},
                }
            },
            "tenants": [{"name": "t", "api_keys": [KEY]}],
        }
    )


async def _production_server(
    app: Any, grace_s: int
) -> tuple[uvicorn.Server, asyncio.Task[None], int]:
    """The gateway as `gateway serve` runs it (its own protocol), on an ephemeral port."""
    served = await start_server(
        app, lifespan="on", http=GuardedHttpToolsProtocol, graceful_s=grace_s
    )
    return served.server, served.task, served.port


async def _stopped(server: uvicorn.Server, task: asyncio.Task[None], upstream: Any) -> None:
    """The gateway's server stopped (if the test did not get that far), then its replica."""
    server.should_exit = True
    with contextlib.suppress(Exception):
        await asyncio.wait_for(task, 10)
    await upstream.stop()


def _dechunk(raw: bytes) -> tuple[bytes, bool]:
    """The body of a chunked response and whether it ended with the final empty chunk."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower(), head
    body = b""
    while rest:
        size_line, sep, rest = rest.partition(b"\r\n")
        if not sep:
            return body, False
        size = int(size_line, 16)
        if size == 0:
            return body, rest == b"\r\n"
        if len(rest) < size + 2:
            return body, False
        body += rest[:size]
        assert rest[size : size + 2] == b"\r\n"
        rest = rest[size + 2 :]
    return body, False


async def test_stream_outlasting_graceful_shutdown_ends_with_error_event() -> None:
    up = Upstream("a", mode="drip", chunks=100_000, chunk_delay_s=0.05)
    served = await start_server(up)
    app = create_app(_config([served.url], {"graceful_shutdown_s": 2}))
    server, task, port = await _production_server(app, grace_s=2)
    try:
        body = orjson.dumps(STREAM)
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n"
            + f"authorization: Bearer {KEY}\r\n".encode()
            + b"content-type: application/json\r\n"
            + b"content-length: %d\r\n\r\n" % len(body)
            + body
        )
        await w.drain()
        raw = b""
        while raw.count(b"data: ") < 3:
            raw += await asyncio.wait_for(r.read(65536), 5)
        server.should_exit = True  # what SIGTERM does
        async with asyncio.timeout(10):
            while chunk := await r.read(65536):
                raw += chunk
        w.close()
        await asyncio.wait_for(task, 10)
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)
    payload, terminated = _dechunk(raw)
    assert terminated, raw[-200:]
    assert payload.endswith(b"\n\n")
    events = payload[:-2].split(b"\n\n")
    assert len(events) > 3
    for ev in events[:-1]:  # the replica's events, each whole
        assert ev.startswith(b"data: ")
        assert orjson.loads(ev[6:])["object"] == "chat.completion.chunk"
    last = orjson.loads(events[-1].removeprefix(b"data: "))
    assert last["error"]["code"] == "server_shutting_down", last
    assert "shutting down" in last["error"]["message"]
    assert b"[DONE]" not in payload
    await poll_until(lambda: up.cancelled == 1, 5)  # the gateway hung up: the engine aborts
    await served.stop()


async def test_stream_shutdown_is_clean_for_httpx() -> None:
    up = Upstream("a", mode="drip", chunks=100_000, chunk_delay_s=0.05)
    served = await start_server(up)
    app = create_app(_config([served.url]))
    server, task, port = await _production_server(app, grace_s=1)
    lines: list[str] = []
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            async with client.stream(
                "POST",
                f"http://127.0.0.1:{port}/v1/chat/completions",
                json=STREAM,
                headers={"authorization": f"Bearer {KEY}"},
            ) as res:
                assert res.status_code == 200
                async for line in res.aiter_lines():  # no RemoteProtocolError
                    lines.append(line)
                    if len(lines) == 4:
                        server.should_exit = True
        await asyncio.wait_for(task, 10)
    finally:
        await _stopped(server, task, served)
    data = [ln for ln in lines if ln.startswith("data: ")]
    assert orjson.loads(data[-1][6:])["error"]["type"] == "service_unavailable_error"


async def test_a_request_the_shutdown_cancels_is_answered_and_logged() -> None:
    """A non-streamed request still waiting on its replica when the graceful shutdown runs out
    is cancelled by the server; it still gets one OpenAI-shaped answer (503
    `server_shutting_down`, not uvicorn's plain-text 500) and one line in the request log."""
    up = Upstream("a", delay_s=30)
    served = await start_server(up)
    app = create_app(_config([served.url], {"graceful_shutdown_s": 1}))
    server, task, port = await _production_server(app, grace_s=1)
    try:
        with access_lines() as lines:
            async with httpx.AsyncClient(timeout=10) as client:
                pending = asyncio.ensure_future(client.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT,
                    headers={"authorization": f"Bearer {KEY}", "x-request-id": "cut-by-shutdown"},
                ))  # fmt: skip
                await poll_until(lambda: up.calls == 1, 5)
                server.should_exit = True
                res = await pending
            await asyncio.wait_for(task, 10)
    finally:
        await _stopped(server, task, served)
    assert res.status_code == 503, res.text
    assert res.json()["error"]["code"] == "server_shutting_down"
    mine = [line for line in lines if line.get("request_id") == "cut-by-shutdown"]
    assert len(mine) == 1 and mine[0]["status"] == 503, lines


async def test_answer_bytes_in_flight_are_capped() -> None:
    size = 3 * 1024 * 1024
    cap = 8 * 1024 * 1024  # two answers fit, not three
    up = Upstream("a", mode="big", chunks=size, chunk_delay_s=0.5)
    served = await start_server(up)
    app = create_app(_config([served.url], {"max_answer_bytes_in_flight": cap}))
    gw = await start_server(app, lifespan="on")
    answers = app.gateway.answers
    try:
        async with httpx.AsyncClient(timeout=20) as client:

            async def one() -> httpx.Response:
                return await client.post(
                    gw.url + "/v1/chat/completions",
                    json=CHAT,
                    headers={"authorization": f"Bearer {KEY}"},
                )

            results = await asyncio.gather(*(one() for _ in range(6)))
        ok = [r for r in results if r.status_code == 200]
        busy = [r for r in results if r.status_code == 503]
        assert len(ok) + len(busy) == 6, [r.status_code for r in results]
        assert ok and busy
        for r in ok:
            assert len(r.json()["choices"][0]["message"]["content"]) == size
        for r in busy:
            err = r.json()["error"]
            assert err["code"] == "answer_bytes_in_flight", err
            assert r.headers["retry-after"]
        assert 0 < answers.peak <= cap
        await poll_until(lambda: answers.held == 0, 5)
        # the cap frees up: the next answer goes through
        async with httpx.AsyncClient(timeout=20) as client:
            r = await client.post(
                gw.url + "/v1/chat/completions",
                json=CHAT,
                headers={"authorization": f"Bearer {KEY}"},
            )
        assert r.status_code == 200
        assert answers.held == 0
    finally:
        await gw.stop()
        await served.stop()
