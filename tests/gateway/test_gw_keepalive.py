"""Client connections under the gateway's own server (`gateway serve`'s uvicorn settings, uvloop,
GuardedHttpToolsProtocol), with aiohttp, httpx and the OpenAI SDK at their defaults, on real
sockets: the gateway never closes an idle connection before those clients' pools do, it never
resets a connection under a request the client sent, and every close it makes is a clean one.

The gateway runs in a thread of its own (its own uvloop loop), so that a test can stall its loop
or the client's at a chosen moment: the races are provoked, not waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import select
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import httpx
import openai
import pytest
import uvicorn
import uvloop

from bench.access_log import access_lines
from bench.harness import start_server
from gateway import create_app, parse_config
from gateway.cli import server_options
from gateway.transport.protocol import DEADLINE_TICK_S, GuardedHttpToolsProtocol
from tests.gateway.fake_replica import Upstream

KEY = "sk-keepalive-test-41aa"
CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "hello"}]}
pytestmark = pytest.mark.timeout(60)


class _Counted(GuardedHttpToolsProtocol):
    """The gateway's protocol, unchanged, counting the connections it was given."""

    made = 0
    sockets: list[int] = []  # noqa: RUF012 - a fresh list per GatewayThread (its subclass)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        type(self).made += 1
        type(self).sockets.append(transport.get_extra_info("socket").fileno())
        super().connection_made(transport)


class GatewayThread:
    """Replicas (`Upstream("a")` unless given; a URL: one nothing serves) and the gateway in front
    of them, on a uvloop loop
    in their own thread, the gateway served with `gateway serve`'s uvicorn settings (`server`
    overrides its keys, `pool` the pool's)."""

    def __init__(
        self,
        server: dict[str, Any],
        replicas: list[Any] | None = None,
        pool: dict[str, Any] | None = None,
    ) -> None:
        self.server_cfg = server
        self.replicas = replicas or [Upstream("a")]
        self.pool = pool or {}
        self.loop = uvloop.new_event_loop()
        self.ready = threading.Event()
        self.url = ""
        self._stop: asyncio.Event | None = None
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._main(),))
        self.counted = type("Counted", (_Counted,), {"made": 0, "sockets": []})

    async def _main(self) -> None:
        ups = [await start_server(r) for r in self.replicas if not isinstance(r, str)]
        served = iter(ups)
        urls = [r if isinstance(r, str) else next(served).url for r in self.replicas]
        config = parse_config({
            "server": self.server_cfg,
            "pools": {"chat": {"replicas": urls, "policy": "round_robin", **self.pool}},
            "tenants": [{"name": "t", "api_keys": [KEY]}],
        })  # fmt: skip
        options = {**server_options(config), "port": 0, "loop": "none", "http": self.counted}
        server = uvicorn.Server(uvicorn.Config(create_app(config), **options))
        task = asyncio.create_task(server.serve())
        while not server.started:  # noqa: ASYNC110 - uvicorn sets a flag, no event
            await asyncio.sleep(0.01)
        self.url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        self._stop = asyncio.Event()
        self.ready.set()
        await self._stop.wait()
        server.should_exit = True
        await task
        for u in ups:
            await u.stop()

    def __enter__(self) -> GatewayThread:
        self.thread.start()
        assert self.ready.wait(20), "the gateway did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stop is not None
        self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(20)
        self.loop.close()

    def stall(self, seconds: float) -> threading.Event:
        """Block the gateway's loop inside an I/O callback, as a long run of them would, for at
        least `seconds` and until a client's bytes wait unread on one of its connections (a
        CPU-starved process): what turns due meanwhile runs in the same turn of the loop (libuv:
        poll, then timers), before the loop reads its sockets again. Set once it began."""
        began = threading.Event()
        ours, theirs = socket.socketpair()

        def block() -> None:
            self.loop.remove_reader(ours)
            began.set()
            time.sleep(seconds)
            poller = select.poll()
            for fd in self.counted.sockets:  # type: ignore[attr-defined]
                poller.register(fd, select.POLLIN)
            poller.poll(10_000)
            ours.close()
            theirs.close()

        def watch() -> None:
            self.loop.add_reader(ours, block)
            theirs.send(b"x")

        self.loop.call_soon_threadsafe(watch)
        return began

    @property
    def connections(self) -> int:
        return int(self.counted.made)  # type: ignore[attr-defined]


Send = Callable[[], Awaitable[int]]


@contextlib.asynccontextmanager
async def client(kind: str, url: str) -> AsyncIterator[Send]:
    """A default client of `kind`; yields a call that sends one chat request and returns its
    status (raising what the client raises)."""
    headers = {"authorization": f"Bearer {KEY}"}
    if kind == "aiohttp":
        async with aiohttp.ClientSession() as session:

            async def send_aiohttp() -> int:
                async with session.post(url + "/v1/chat/completions", json=CHAT, headers=headers) as r:
                    await r.read()
                    return r.status

            yield send_aiohttp
    elif kind == "httpx":
        async with httpx.AsyncClient() as http:

            async def send_httpx() -> int:
                r = await http.post(url + "/v1/chat/completions", json=CHAT, headers=headers)
                return r.status_code

            yield send_httpx
    else:
        async with openai.AsyncOpenAI(api_key=KEY, base_url=url + "/v1") as sdk:

            async def send_openai() -> int:
                await sdk.chat.completions.create(**CHAT)  # type: ignore[call-overload]
                return 200

            yield send_openai


CLIENTS = ("aiohttp", "httpx", "openai")


async def test_idle_connections_outlive_the_clients_pools() -> None:
    """`gateway serve` keeps an idle connection longer than each client's pool keeps it: the
    client ends it, never the gateway under the client's next request."""
    keep_alive = server_options(parse_config({"pools": {"p": {"replicas": ["http://a:1"]}}}))[
        "timeout_keep_alive"
    ]
    connector = aiohttp.TCPConnector()
    sdk = openai.AsyncOpenAI(api_key="k")
    h = httpx.AsyncClient()
    pools = {
        "aiohttp": connector._keepalive_timeout,  # noqa: SLF001 - the defaults, as constructed
        "httpx": h._transport._pool._keepalive_expiry,  # type: ignore[attr-defined]  # noqa: SLF001
        "openai": sdk._client._transport._pool._keepalive_expiry,  # type: ignore[attr-defined]  # noqa: SLF001
    }
    await connector.close()
    await h.aclose()
    await sdk.close()
    for name, idle in pools.items():
        assert isinstance(idle, float) and keep_alive > idle + 5, (name, idle, keep_alive)


@pytest.mark.parametrize("kind", CLIENTS)
async def test_a_request_waiting_in_the_socket_at_the_idle_deadline_is_served(kind: str) -> None:
    """The gateway's loop stalls (a busy CPU) across a connection's keep-alive deadline while
    the client sends its next request on it: when the loop runs again the deadline and the
    request are both due (uvloop runs timers first). The request is served on that connection;
    closing it with the request unread would answer it with a reset (`Connection reset by
    peer` in the client, and no line in the request log)."""
    keep_alive = 0.3
    with access_lines() as lines, GatewayThread({"keep_alive_s": keep_alive}) as gw:
        async with client(kind, gw.url) as send:
            assert await send() == 200
            began = gw.stall(keep_alive + 2 * DEADLINE_TICK_S + 0.5)
            assert await asyncio.to_thread(began.wait, 5)
            assert await send() == 200  # sent while the loop stalls; it waits in the socket
            assert gw.connections == 1  # the pooled connection served it: no retry, no reset
    assert len([line for line in lines if line.get("status") == 200]) == 2


@pytest.mark.parametrize("kind", ("aiohttp", "httpx"))
async def test_a_refusal_is_read_while_the_client_still_sends(kind: str) -> None:
    """A body far past `server.max_body_bytes` is refused before it is read (413 and the
    connection's end) while the client still sends it. The gateway closes softly: it reads and
    drops the rest, so the client finishes sending and reads the 413; a plain close would reset
    the connection under the client's writes, and the client would see a reset, not the 413."""
    body = b"x" * (24 * 1024 * 1024)
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    with GatewayThread({}) as gw:
        url = gw.url + "/v1/chat/completions"
        if kind == "aiohttp":
            async with aiohttp.ClientSession() as session:
                async with session.post(url, data=io.BytesIO(body), headers=headers) as r:
                    status, answer = r.status, await r.json()
        else:
            async with httpx.AsyncClient() as http:
                res = await http.post(url, content=body, headers=headers)
                status, answer = res.status_code, res.json()
    assert status == 413
    assert answer["error"]["type"] == "invalid_request_error", answer
