"""The control plane's client (the lean HttpClient) against a raw HTTP/1.1 server on loopback: what health probes,
metric scrapes, model lists and parity checks make of refusals, silence, bad and huge bodies; one
connection reused; nothing taken from the environment."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import orjson
import pytest

from gateway.config import HealthConfig, PoolConfig, ReplicaConfig, ScrapeConfig
from gateway.fleet.kv_events import check_parity
from gateway.fleet.replicas import ReplicaMonitor, ReplicaState
from gateway.transport.control import (
    BodyTooLarge,
    ControlClient,
    fetch,
    get_json,
    open_control_client,
    post_json,
    status_of,
)
from tests.support import free_port, poll_until

# path -> (method, request body) -> the whole response, or None to never answer
Handler = Callable[[str, bytes], bytes | None]


def answer(status: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> bytes:
    head = f"HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n\r\n"
    return head.encode() + body


@dataclass
class RawServer:
    routes: dict[str, Handler]
    url: str = ""
    connections: int = 0
    requests: list[tuple[str, str, bytes]] = field(default_factory=list)
    handlers: set[asyncio.Task[None]] = field(default_factory=set)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ")
                size = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        size = int(value)
                body = await reader.readexactly(size) if size else b""
                self.requests.append((method, target, body))
                route = self.routes.get(target)
                reply = answer(404, b"no such path") if route is None else route(method, body)
                if reply is None:
                    while await reader.read(65536):  # silence until the client hangs up
                        pass
                    return
                writer.write(reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            self.handlers.discard(task)


@contextlib.asynccontextmanager
async def raw_server(routes: dict[str, Handler]) -> AsyncIterator[RawServer]:
    srv = RawServer(routes)
    server = await asyncio.start_server(srv.handle, "127.0.0.1", 0)
    srv.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield srv
    finally:
        server.close()
        for task in list(srv.handlers):  # the connections still open (Python 3.11 has no
            task.cancel()  # Server.close_clients)
        await asyncio.gather(*srv.handlers, return_exceptions=True)
        await server.wait_closed()


@contextlib.asynccontextmanager
async def client() -> AsyncIterator[ControlClient]:
    async with open_control_client(2.0) as c:
        yield c


def monitor(url: str, c: ControlClient, timeout_s: float = 1.0) -> ReplicaMonitor:
    health = HealthConfig(timeout_s=timeout_s, failures_to_open=1)
    scrape = ScrapeConfig(timeout_s=timeout_s)
    pool = PoolConfig(replicas=(ReplicaConfig(url=url),), health=health, scrape=scrape)
    replica = ReplicaState.from_config("p", pool, pool.replicas[0])
    return ReplicaMonitor(replica, c, health, scrape)


def const(reply: bytes | None) -> Handler:
    return lambda method, body: reply


METRICS = (
    b"vllm:num_requests_waiting 3\nvllm:num_requests_running 2\nvllm:kv_cache_usage_perc 0.5\n"
)


# --- health probes ----------------------------------------------------------------------------


async def test_a_probe_is_judged_by_its_status() -> None:
    routes = {"/health": const(answer(200, b"")), "/sick": const(answer(503, b"down"))}
    async with raw_server(routes) as srv, client() as c:
        m = monitor(srv.url, c)
        assert await m.probe_once() is True
        m.health = m.health.model_copy(update={"path": "/sick"})
        assert await m.probe_once() is False
        assert m.replica.circuit.state == "open"


async def test_a_refused_or_silent_replica_fails_its_probe() -> None:
    async with raw_server({"/health": const(None)}) as srv, client() as c:
        assert await monitor(f"http://127.0.0.1:{free_port()}", c).probe_once() is False
        assert await monitor(srv.url, c, timeout_s=0.2).probe_once() is False


async def test_a_refused_probe_after_requests_opened_the_circuit_forgets_the_cache_once() -> None:
    """Requests (a stream broken mid-answer) opened the circuit before any probe failed: the first
    probe refused outright says the engine is gone, and its KV cache is forgotten, once; a probe
    that only times out says nothing of the sort."""
    async with client() as c:
        m = monitor(f"http://127.0.0.1:{free_port()}", c, timeout_s=0.2)
        lost: list[str] = []
        m.replica.on_lost = lambda r, why: lost.append(why)
        assert m.replica.failed("the stream broke mid-answer") is True  # requests opened it
        assert await m.probe_once() is False
        assert await m.probe_once() is False
        assert lost == ["its health probe failed with its circuit open"]
        m.replica.succeeded()  # back: the next loss is told again
        assert m.replica.failed("connection refused") is True
        assert await m.probe_once() is False
        assert len(lost) == 2


async def test_requests_never_wait_for_a_connection() -> None:
    """No cap on connections: 300 probes at once to a silent replica get 300 connections. (A capped
    pool queues requests, and httpcore loses a pool slot for good to a queued request cancelled
    at the wrong moment: enough of them and every probe fails.) Cancelled, they leave the client
    as usable as before."""
    routes = {"/silent": const(None), "/health": const(answer(200, b""))}
    async with raw_server(routes) as srv, client() as c:
        probes = [
            asyncio.create_task(status_of(c, srv.url + "/silent", timeout_s=60.0))
            for _ in range(300)
        ]
        await poll_until(lambda: srv.connections == 300, timeout_s=5.0)
        for task in probes:
            task.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        assert await status_of(c, srv.url + "/health", timeout_s=2.0) == 200


async def test_a_probe_drops_a_huge_body_and_keeps_its_verdict() -> None:
    routes = {"/health": const(answer(200, b"x" * (4 * 1024 * 1024)))}
    async with raw_server(routes) as srv, client() as c:
        m = monitor(srv.url, c)
        assert await m.probe_once() is True
        assert await m.probe_once() is True
        assert srv.connections == 2  # the unread rest of a body is not worth the connection


async def test_probes_and_scrapes_reuse_one_connection() -> None:
    routes = {"/health": const(answer(200, b"ok")), "/metrics": const(answer(200, METRICS))}
    async with raw_server(routes) as srv, client() as c:
        m = monitor(srv.url, c)
        for _ in range(5):
            assert await m.probe_once() is True
            assert await m.scrape_once() is not None
        assert srv.connections == 1 and len(srv.requests) == 10


async def test_nothing_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "all_proxy"):
        monkeypatch.setenv(var, dead)  # a proxy that is not there: using it would fail the probe
    async with raw_server({"/health": const(answer(200, b""))}) as srv, client() as c:
        assert await monitor(srv.url, c).probe_once() is True


# --- metric scrapes ---------------------------------------------------------------------------


async def test_a_scrape_reads_the_load_and_keeps_it() -> None:
    async with raw_server({"/metrics": const(answer(200, METRICS))}) as srv, client() as c:
        m = monitor(srv.url, c)
        sample = await m.scrape_once()
        assert sample is not None and (sample.waiting, sample.running) == (3, 2)
        assert m.replica.scraped is sample


async def test_failing_scrapes_are_logged_once_and_their_recovery_too(
    caplog: pytest.LogCaptureFixture,
) -> None:
    replies = [
        answer(500, b"oops"),
        answer(200, b"\xff\xfe not utf-8"),
        answer(200, METRICS, "text/plain; charset=no-such-charset"),
        answer(200, METRICS),
    ]
    routes = {"/metrics": lambda method, body: replies.pop(0)}
    async with raw_server(routes) as srv, client() as c:
        m = monitor(srv.url, c)
        with caplog.at_level(logging.INFO, logger="gateway.replicas"):
            assert [await m.scrape_once() for _ in range(3)] == [None, None, None]
            assert await m.scrape_once() is not None
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        f"replica {m.replica.name}: metrics scrape failing (HTTP 500)",
        f"replica {m.replica.name}: metrics scrape recovered",
    ]


async def test_a_silent_or_absent_metrics_endpoint_is_no_sample() -> None:
    async with raw_server({"/metrics": const(None)}) as srv, client() as c:
        assert await monitor(srv.url, c, timeout_s=0.2).scrape_once() is None
        assert await monitor(f"http://127.0.0.1:{free_port()}", c).scrape_once() is None


# --- bodies, JSON -----------------------------------------------------------------------------


async def test_a_body_past_the_limit_is_refused() -> None:
    async with raw_server({"/big": const(answer(200, b"x" * 4096))}) as srv, client() as c:
        reply = await fetch(c, "GET", srv.url + "/big", timeout_s=1.0, max_bytes=4096)
        assert reply.status == 200 and len(reply.body) == 4096
        with pytest.raises(BodyTooLarge):
            await fetch(c, "GET", srv.url + "/big", timeout_s=1.0, max_bytes=4095)


async def test_json_answers_and_everything_else_is_none() -> None:
    cards = orjson.dumps({"data": [{"id": "m"}]})
    routes = {
        "/v1/models": const(answer(200, cards, "application/json")),
        "/text": const(answer(200, b"<html>not json</html>", "text/html")),
        "/empty": const(answer(200, b"", "application/json")),
        "/error": const(answer(500, cards, "application/json")),
        "/silent": const(None),
        "/echo": lambda method, body: answer(200, body, "application/json"),
    }
    async with raw_server(routes) as srv, client() as c:
        assert await get_json(c, srv.url + "/v1/models", timeout_s=1.0) == {"data": [{"id": "m"}]}
        for path in ("/text", "/empty", "/error", "/missing"):
            assert await get_json(c, srv.url + path, timeout_s=1.0) is None, path
        assert await get_json(c, srv.url + "/silent", timeout_s=0.2) is None
        assert await get_json(c, f"http://127.0.0.1:{free_port()}/x", timeout_s=1.0) is None
        assert await post_json(c, srv.url + "/echo", {"a": [1]}, timeout_s=1.0) == {"a": [1]}
        assert await status_of(c, srv.url + "/error", timeout_s=1.0) == 500


# --- token parity -----------------------------------------------------------------------------


class Chunker:
    """Tokenizes as the replica below does: one id per character."""

    def encode(self, text: str) -> list[int]:
        return [ord(ch) for ch in text]

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode("".join(m["content"] for m in messages))


def tokenizer(chat: bool, skew: int = 0) -> Handler:
    def handle(method: str, body: bytes) -> bytes:
        req = orjson.loads(body)
        if "messages" in req:
            if not chat:
                return answer(400, b'{"error": "no chat template"}', "application/json")
            text = "".join(m["content"] for m in req["messages"])
        else:
            text = req["prompt"]
        tokens = [ord(ch) + skew for ch in text]
        return answer(200, orjson.dumps({"tokens": tokens}), "application/json")

    return handle


async def test_parity_asks_the_engine_to_tokenize() -> None:
    routes = {
        "/same/tokenize": tokenizer(chat=True),
        "/nochat/tokenize": tokenizer(chat=False),
        "/other/tokenize": tokenizer(chat=True, skew=1),
        "/garbled/tokenize": const(answer(200, b"tokens?", "application/json")),
    }
    async with raw_server(routes) as srv, client() as c:
        assert await check_parity(c, srv.url + "/same", "m", Chunker()) is True
        assert await check_parity(c, srv.url + "/nochat", "m", Chunker()) is True
        assert await check_parity(c, srv.url + "/other", "m", Chunker()) is False
        assert await check_parity(c, srv.url + "/garbled", "m", Chunker()) is None
        assert await check_parity(c, f"http://127.0.0.1:{free_port()}", None, Chunker()) is None
        _, _, first = srv.requests[0]
        assert orjson.loads(first)["model"] == "m"
