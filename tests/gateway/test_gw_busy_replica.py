"""A replica too busy to accept a connection is busy, not dead: its connect timeouts fail over but
open no circuit while it still sends bytes (its streams, its probes' answers); once it sends
nothing for `health.dead_after_s`, the same timeouts open its circuit. Real sockets: the busy
replica's front door stops accepting and its accept queue fills, so a new connection's SYN goes
unanswered, as on a server whose process cannot keep up."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket

import httpx
import pytest

from bench.harness import serving
from gateway import create_app, parse_config
from tests.gateway.fake_replica import Upstream
from tests.support import start_server

KEY = "sk-busy-replica-5d0e"
CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "hello"}]}
pytestmark = pytest.mark.timeout(60)


class FrontDoor:
    """A TCP relay in front of a replica whose accepting can stop: then its accept queue (backlog
    1) is filled, and new connections wait for a SYN-ACK that does not come."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.sock.setblocking(False)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(self.sock, self._accept)
        self.relays: set[asyncio.Task[None]] = set()
        self.writers: list[asyncio.StreamWriter] = []
        self.queued: list[socket.socket] = []

    def _accept(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except BlockingIOError:
            return
        task = asyncio.ensure_future(self._relay(conn))
        self.relays.add(task)
        task.add_done_callback(self.relays.discard)

    async def _relay(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        cr, cw = await asyncio.open_connection(sock=conn)
        ur, uw = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.writers += [cw, uw]

        async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            w.close()

        await asyncio.gather(pump(cr, uw), pump(ur, cw), return_exceptions=True)

    async def stop_accepting(self) -> None:
        """The server stops taking connections: its accept queue fills, later SYNs are dropped."""
        self.loop.remove_reader(self.sock)
        while True:
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(self.sock.getsockname())
            try:
                await asyncio.wait_for(self.loop.sock_connect(s, self.sock.getsockname()), 0.3)
            except TimeoutError:
                s.close()
                return
            except OSError:
                pass
            self.queued.append(s)

    def hang(self) -> None:
        """The process stops answering altogether: every connection it had goes silent."""
        for w in self.writers:
            w.transport.abort()

    def close(self) -> None:
        self.loop.remove_reader(self.sock)
        self.hang()
        for task in self.relays:
            task.cancel()
        for s in self.queued:
            s.close()
        self.sock.close()


def _gauge(text: str, family: str, replica: str) -> float:
    m = re.search(rf'^{family}{{pool="chat",replica="{replica}"}} (\S+)$', text, re.MULTILINE)
    assert m is not None, f"{family} {replica} not in /metrics"
    return float(m.group(1))


async def test_a_replica_slow_to_accept_is_busy_until_it_falls_silent() -> None:
    a = await start_server(Upstream("a", chunks=400, chunk_delay_s=0.05))  # 20 s streams
    b = await start_server(Upstream("b"))
    front = FrontDoor(a.port)
    config = parse_config({
        "pools": {"chat": {
            "replicas": [{"url": front.url, "name": "a"}, {"url": b.url, "name": "b"}],
            "policy": "round_robin", "retries": 1,
            "health": {"interval_s": 0.1, "timeout_s": 0.25, "failures_to_open": 2,
                       "dead_after_s": 1.5},
            "timeouts": {"connect_s": 0.3, "first_byte_s": 5, "total_s": 10},
        }},
        "tenants": [{"name": "t", "api_keys": [KEY]}],
    })  # fmt: skip
    headers = {"authorization": f"Bearer {KEY}"}
    try:
        async with serving(create_app(config), lifespan="on") as gw, httpx.AsyncClient(
            base_url=gw.url, headers=headers, timeout=10
        ) as http:
            streams = []
            for _ in range(2):  # round robin: one lands on a, and keeps sending
                cm = http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True})
                res = await cm.__aenter__()
                assert res.status_code == 200
                await res.aiter_bytes().__anext__()
                streams.append(cm)
            await front.stop_accepting()
            for _ in range(6):  # those for a time out connecting, and fail over to b
                res = await http.post("/v1/chat/completions", json=CHAT)
                assert res.status_code == 200, res.text
            text = (await http.get("/metrics")).text
            assert _gauge(text, "gateway_replica_busy_timeouts_total", "a") >= 1
            assert _gauge(text, "gateway_replica_up", "a") == 1.0  # busy, not dead

            for cm in streams:  # a falls silent: no stream, no probe answer
                await cm.__aexit__(None, None, None)
            front.hang()

            async def down() -> bool:
                return _gauge((await http.get("/metrics")).text, "gateway_replica_up", "a") == 0

            async with asyncio.timeout(10):
                while not await down():  # noqa: ASYNC110 - the state is in another server
                    await asyncio.sleep(0.1)
            text = (await http.get("/metrics")).text
            assert _gauge(text, "gateway_replica_silent_seconds", "a") >= 1.5
    finally:
        front.close()
        await a.stop()
        await b.stop()
