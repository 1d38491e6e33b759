"""HttpClient against real servers on loopback: uvicorn apps, and raw asyncio servers that misbehave.

Every test runs twice, on the plain asyncio loop and on uvloop (the gateway's loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import ssl
import struct
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import pytest
import uvloop

from bench.harness import read_body
from gateway.transport.client import (
    HIGH_WATER_BYTES,
    HttpClient,
    UpstreamBrokenError,
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamResponse,
    UpstreamTooLargeError,
)
from tests.support import free_port, poll_until, serving

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}
Case = Callable[[], Coroutine[Any, Any, None]]


def both_loops(case: Case) -> Callable[[str], None]:
    """A test of `case` on each event loop (pytest-asyncio would give the default loop only)."""

    @pytest.mark.parametrize("loop", sorted(LOOPS))
    def test(loop: str) -> None:
        with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
            runner.run(case())

    test.__name__, test.__doc__ = case.__name__, case.__doc__
    return test


# --- servers ---------------------------------------------------------------------------------------
@dataclass
class Req:
    conn: int  # which accepted connection it came on, from 1
    n: int  # its place on that connection, from 0
    head: bytes
    body: bytes


Handler = Callable[[Req, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]


@dataclass
class RawServer:
    """HTTP/1.1 on a loopback port, every answer scripted by `handler` (False: close after it)."""

    handler: Handler
    tls: ssl.SSLContext | None = None
    accepted: int = 0
    ended: int = 0  # connections over, whichever side closed them
    requests: list[Req] = field(default_factory=list)
    origin: str = ""
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    _server: asyncio.Server | None = None

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        port = self._server.sockets[0].getsockname()[1]
        self.origin = f"{'https' if self.tls else 'http'}://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.accepted += 1
        conn = self.accepted
        try:
            for n in range(1_000_000):
                head = await reader.readuntil(b"\r\n\r\n")
                body = await reader.readexactly(_content_length(head))
                req = Req(conn, n, head, body)
                self.requests.append(req)
                if not await self.handler(req, reader, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # a cancelled handler ends quietly: asyncio would log its CancelledError
        finally:
            self.ended += 1
            writer.close()
            self._tasks.discard(task)


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def reply(data: bytes, keep: bool = True) -> Handler:
    async def handler(req: Req, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(data)
        await writer.drain()
        return keep

    return handler


async def until_gone(reader: asyncio.StreamReader, gone: asyncio.Event) -> bool:
    """Wait for the client to hang up (EOF or reset), then say so."""
    with contextlib.suppress(ConnectionError):
        while await reader.read(65536):
            pass
    gone.set()
    return False


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


OK = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 5\r\n\r\nhello"
CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


class Timeouts(TypedDict):
    first_byte_timeout_s: float | None
    idle_timeout_s: float | None
    total_timeout_s: float | None


ALL_TIMEOUTS = Timeouts(first_byte_timeout_s=5.0, idle_timeout_s=5.0, total_timeout_s=30.0)


@contextlib.asynccontextmanager
async def open_pool(**kw: Any) -> AsyncIterator[HttpClient]:
    pool = HttpClient(connect_timeout_s=2.0, **kw)
    try:
        yield pool
    finally:
        await pool.aclose()


async def get(
    pool: HttpClient,
    origin: str,
    method: bytes = b"GET",
    first_byte_timeout_s: float | None = 5.0,
    idle_timeout_s: float | None = 5.0,
    total_timeout_s: float | None = 30.0,
) -> UpstreamResponse:
    return await pool.request(
        origin,
        method,
        b"/x",
        [],
        first_byte_timeout_s=first_byte_timeout_s,
        idle_timeout_s=idle_timeout_s,
        total_timeout_s=total_timeout_s,
    )


async def body_of(resp: UpstreamResponse) -> bytes:
    try:
        return await resp.read_all(100 * 2**20)
    finally:
        resp.release()


# --- uvicorn upstream ------------------------------------------------------------------------------
@dataclass
class App:
    """An OpenAI-ish ASGI app: JSON on POST /json, an SSE stream of `events` on POST /sse."""

    events: int = 500
    clients: set[int] = field(default_factory=set)  # client ports seen: one per connection
    seen: list[dict[bytes, bytes]] = field(default_factory=list)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.clients.add(scope["client"][1])
        self.seen.append(dict(scope["headers"]))
        body = await read_body(receive)
        if scope["path"] == "/sse":
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")],
                }
            )
            for i in range(self.events):
                await send(
                    {"type": "http.response.body", "body": b"data: %d\n\n" % i, "more_body": True}
                )
            await send({"type": "http.response.body", "body": b""})
            return
        out = b'{"echo":' + body + b"}"
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", b"%d" % len(out)),
                ],
            }
        )
        await send({"type": "http.response.body", "body": out})


@both_loops
async def test_content_length_body_and_request_on_the_wire() -> None:
    """A JSON answer with content-length; the server sees host, content-length and our headers."""
    app = App()
    async with serving(app) as up, open_pool() as pool:
        resp = await pool.request(
            up.url,
            b"POST",
            b"/json",
            [(b"content-type", b"application/json"), (b"x-request-id", b"r1"), (b"host", b"evil")],
            b'{"a":1}',
            **ALL_TIMEOUTS,
        )
        assert resp.status == 200
        assert (b"content-type", b"application/json") in resp.headers
        assert (b"content-length", b"16") in resp.headers
        assert await body_of(resp) == b'{"echo":{"a":1}}'
    h = app.seen[0]
    assert h[b"host"] == up.url.removeprefix("http://").encode()
    assert h[b"content-length"] == b"7" and h[b"x-request-id"] == b"r1"
    assert h[b"connection"] == b"keep-alive"


@both_loops
async def test_sse_stream_of_many_chunks() -> None:
    app = App(events=500)
    async with serving(app) as up, open_pool() as pool:
        resp = await pool.request(up.url, b"POST", b"/sse", [], b"{}", **ALL_TIMEOUTS)
        assert resp.status == 200
        parts = []
        while part := await resp.read_chunk():
            parts.append(part)
        resp.release()
        assert b"".join(parts) == b"".join(b"data: %d\n\n" % i for i in range(500))
        assert 1 <= len(parts) <= 500
        assert await resp.read_chunk() == b""  # the end stays the end


@both_loops
async def test_keep_alive_reuses_one_connection() -> None:
    app = App()
    async with serving(app) as up, open_pool() as pool:
        for _ in range(3):
            resp = await pool.request(up.url, b"POST", b"/json", [], b"1", **ALL_TIMEOUTS)
            assert await body_of(resp) == b'{"echo":1}'
        assert len(app.clients) == 1
        (conn,) = pool._conns
        assert conn.transport is not None
        sock = conn.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        # concurrent requests open more connections; all of them are kept and reused
        for _ in range(2):
            resps = await asyncio.gather(
                *(pool.request(up.url, b"POST", b"/sse", [], b"{}") for _ in range(4))
            )
            for resp in resps:
                assert (await body_of(resp)).startswith(b"data: 0\n\n")
            assert len(app.clients) == 4


# --- framing ---------------------------------------------------------------------------------------
@both_loops
async def test_chunked_body_is_dechunked_and_joined() -> None:
    """Chunks that arrive in one read come back as one read_chunk; names lowercased, no trailers."""
    body = (
        CHUNKED_HEAD
        + chunk(b"data: 1\n\n")
        + chunk(b"data: 2\n\n")
        + chunk(b"x" * 5000)
        + b"0\r\nx-checksum: abc\r\n\r\n"  # a trailer
    )
    async with RawServer(reply(body)) as srv, open_pool() as pool:
        resp = await get(pool, srv.origin)
        assert (b"content-type", b"text/event-stream") in resp.headers
        assert (b"transfer-encoding", b"chunked") in resp.headers
        first = await resp.read_chunk()
        assert first == b"data: 1\n\ndata: 2\n\n" + b"x" * 5000
        assert await resp.read_chunk() == b""
        assert [k for k, _ in resp.headers] == [b"content-type", b"transfer-encoding"]
        resp.release()
        assert await body_of(await get(pool, srv.origin)) == first
        assert srv.accepted == 1


@both_loops
async def test_body_until_eof() -> None:
    """No content-length, no chunking: the body ends when the server closes; not reused."""
    async with RawServer(reply(b"HTTP/1.1 200 OK\r\n\r\nhello world", keep=False)) as srv:
        async with open_pool() as pool:
            assert await body_of(await get(pool, srv.origin)) == b"hello world"
            assert await body_of(await get(pool, srv.origin)) == b"hello world"
        assert srv.accepted == 2


@both_loops
async def test_head_204_304_have_empty_bodies_and_keep_the_connection() -> None:
    answers = {
        b"HEAD": b"HTTP/1.1 200 OK\r\ncontent-length: 1234\r\n\r\n",
        b"GET": b"HTTP/1.1 204 No Content\r\n\r\n",
        b"PUT": b"HTTP/1.1 304 Not Modified\r\ncontent-length: 50\r\n\r\n",
    }

    async def handler(req: Req, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(answers.get(req.head.split(b" ", 1)[0], OK))
        return True

    async with RawServer(handler) as srv, open_pool() as pool:
        for method, status in ((b"HEAD", 200), (b"GET", 204), (b"PUT", 304), (b"HEAD", 200)):
            resp = await get(pool, srv.origin, method)
            assert resp.status == status
            assert await body_of(resp) == b""
        assert await body_of(await get(pool, srv.origin, b"POST")) == b"hello"
        assert srv.accepted == 1


@both_loops
async def test_interim_1xx_answers_are_skipped() -> None:
    async def handler(req: Req, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
        writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </a.css>\r\n\r\n" + OK)
        return True

    async with RawServer(handler) as srv, open_pool() as pool:
        for _ in range(2):
            resp = await get(pool, srv.origin)
            assert resp.status == 200
            assert [k for k, _ in resp.headers] == [b"content-type", b"content-length"]
            assert await body_of(resp) == b"hello"
        assert srv.accepted == 1


@both_loops
async def test_connection_close_answer_is_not_reused() -> None:
    answer = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"
    async with RawServer(reply(answer)) as srv, open_pool() as pool:
        for _ in range(2):
            assert await body_of(await get(pool, srv.origin)) == b"ok"
        assert srv.accepted == 2


@both_loops
async def test_bytes_after_the_message_make_the_connection_unusable() -> None:
    async with RawServer(reply(OK + b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")) as srv:
        async with open_pool() as pool:
            for _ in range(2):
                assert await body_of(await get(pool, srv.origin)) == b"hello"
        assert srv.accepted == 2


# --- pool behaviour --------------------------------------------------------------------------------
@both_loops
async def test_idle_connection_closed_by_the_server_is_replaced() -> None:
    """The server closes after answering (keep-alive promised): the next request opens anew."""
    async with RawServer(reply(OK, keep=False)) as srv, open_pool() as pool:
        assert await body_of(await get(pool, srv.origin)) == b"hello"
        await poll_until(lambda: srv.ended == 1)
        assert await body_of(await get(pool, srv.origin)) == b"hello"
        assert srv.accepted == 2


@both_loops
async def test_reused_connection_closed_before_any_answer_is_retried_once() -> None:
    """The race the pool can't see: the server drops a kept-alive connection as we send."""

    async def handler(req: Req, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        if req.n == 0:
            writer.write(OK)
            return True
        return False  # the second request on a connection: hang up, say nothing

    async with RawServer(handler) as srv, open_pool() as pool:
        assert await body_of(await get(pool, srv.origin)) == b"hello"
        assert await body_of(await get(pool, srv.origin)) == b"hello"  # retried on connection 2
        assert srv.accepted == 2
        assert [(r.conn, r.n) for r in srv.requests] == [(1, 0), (1, 1), (2, 0)]


@both_loops
async def test_fresh_connection_closed_before_any_answer_fails_without_retry() -> None:
    async with RawServer(reply(b"", keep=False)) as srv, open_pool() as pool:
        with pytest.raises(UpstreamConnectError, match="before response headers"):
            await get(pool, srv.origin)
        assert srv.accepted == 1


@both_loops
async def test_retry_happens_once_only() -> None:
    async def handler(req: Req, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        if req.conn == 1 and req.n == 0:
            writer.write(OK)
            return True
        return False

    async with RawServer(handler) as srv, open_pool() as pool:
        assert await body_of(await get(pool, srv.origin)) == b"hello"
        with pytest.raises(UpstreamConnectError):
            await get(pool, srv.origin)
        assert srv.accepted == 2


@both_loops
async def test_stale_idle_connections_are_closed_past_their_ttl() -> None:
    async with RawServer(reply(OK)) as srv, open_pool(idle_ttl_s=0.05) as pool:
        assert await body_of(await get(pool, srv.origin)) == b"hello"
        await asyncio.sleep(0.1)  # the TTL itself is under test
        assert await body_of(await get(pool, srv.origin)) == b"hello"
        assert srv.accepted == 2
        await poll_until(lambda: srv.ended == 1)


@both_loops
async def test_idle_list_is_capped_per_origin() -> None:
    async with RawServer(reply(OK)) as srv, open_pool(max_idle_per_origin=1) as pool:
        resps = await asyncio.gather(*(get(pool, srv.origin) for _ in range(3)))
        for resp in resps:
            assert await body_of(resp) == b"hello"
        await poll_until(lambda: srv.ended == 2)
        assert await body_of(await get(pool, srv.origin)) == b"hello"
        assert srv.accepted == 3


@both_loops
async def test_aclose_closes_idle_and_busy_connections() -> None:
    gone = asyncio.Event()

    async def handler(req: Req, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        if req.conn == 2:
            writer.write(OK)
            return True
        writer.write(CHUNKED_HEAD + chunk(b"data: 1\n\n"))
        return await until_gone(reader, gone)

    async with RawServer(handler) as srv:
        pool = HttpClient(connect_timeout_s=2.0)
        busy = await get(pool, srv.origin)  # connection 1, streaming
        assert await body_of(await get(pool, srv.origin)) == b"hello"  # connection 2, now idle
        assert await busy.read_chunk() == b"data: 1\n\n"
        await pool.aclose()
        with pytest.raises(UpstreamBrokenError):
            await busy.read_chunk()
        await asyncio.wait_for(gone.wait(), 2)
        await poll_until(lambda: srv.ended == srv.accepted == 2)
        with pytest.raises(RuntimeError, match="closed"):
            await get(pool, srv.origin)


# --- failures before the headers -------------------------------------------------------------------
@both_loops
async def test_connect_refused() -> None:
    async with open_pool() as pool:
        with pytest.raises(UpstreamConnectError, match="cannot connect"):
            await get(pool, f"http://127.0.0.1:{free_port()}")


@both_loops
async def test_garbage_instead_of_a_status_line() -> None:
    async with RawServer(reply(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")) as srv, open_pool() as pool:
        with pytest.raises(UpstreamProtocolError) as info:
            await get(pool, srv.origin)
        assert isinstance(info.value, UpstreamConnectError)  # retryable on another replica
        await poll_until(lambda: srv.ended == 1)


@both_loops
async def test_endless_headers_are_refused() -> None:
    async def handler(req: Req, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for i in range(40):
            writer.write(b"x-pad-%d: %s\r\n" % (i, b"a" * 65536))
            await writer.drain()
        return await until_gone(reader, asyncio.Event())

    async with RawServer(handler) as srv, open_pool() as pool:
        with pytest.raises(UpstreamProtocolError, match="headers larger than"):
            await get(pool, srv.origin)


@both_loops
async def test_unsolicited_bytes_on_an_idle_connection_drop_it() -> None:
    async def handler(req: Req, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(OK)
        if req.conn == 1:
            await writer.drain()
            await asyncio.sleep(0.01)  # after the client has the whole answer
            writer.write(b"HTTP/1.1 200 OK\r\n")
        return True

    async with RawServer(handler) as srv, open_pool() as pool:
        assert await body_of(await get(pool, srv.origin)) == b"hello"
        await poll_until(lambda: srv.ended == 1)
        assert await body_of(await get(pool, srv.origin)) == b"hello"
        assert srv.accepted == 2


@both_loops
async def test_no_headers_within_the_first_byte_timeout() -> None:
    """The first-byte deadline (0.15 s) ends the wait for headers: not before it (the idle
    timeout, 0.05 s, is not the one), and before a server that answers after 1 s does."""
    gone = asyncio.Event()

    async def handler(req: Req, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        try:
            async with asyncio.timeout(1.0):
                return await until_gone(reader, gone)
        except TimeoutError:
            writer.write(OK)  # a late answer: a client still waiting would take it
            return True

    async with RawServer(handler) as srv, open_pool() as pool:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(TimeoutError, match="headers"):
            await get(pool, srv.origin, first_byte_timeout_s=0.15, idle_timeout_s=0.05)
        assert loop.time() - t0 >= 0.14
        await asyncio.wait_for(gone.wait(), 2)  # the engine would abort the request


@both_loops
async def test_cancelled_while_waiting_for_headers_hangs_up() -> None:
    gone = asyncio.Event()

    async def handler(req: Req, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        return await until_gone(reader, gone)

    async with RawServer(handler) as srv, open_pool() as pool:
        task = asyncio.create_task(get(pool, srv.origin))
        await poll_until(lambda: len(srv.requests) == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(gone.wait(), 2)


# --- failures mid-body -----------------------------------------------------------------------------
@both_loops
async def test_stalled_stream_hits_the_idle_timeout() -> None:
    gone = asyncio.Event()

    async def handler(req: Req, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(CHUNKED_HEAD + chunk(b"data: 1\n\n"))
        return await until_gone(reader, gone)

    async with RawServer(handler) as srv, open_pool() as pool:
        resp = await get(pool, srv.origin, first_byte_timeout_s=5, idle_timeout_s=0.15)
        assert await resp.read_chunk() == b"data: 1\n\n"
        with pytest.raises(TimeoutError, match="no body bytes"):
            await resp.read_chunk()
        await asyncio.wait_for(gone.wait(), 2)
        resp.release()


@both_loops
async def test_slow_steady_stream_hits_the_total_timeout() -> None:
    """A tick every 20 ms never trips the idle timeout; the total one (0.3 s) ends the stream,
    not before it, and before the server would have ended it well (after 1.5 s of ticks)."""

    async def handler(req: Req, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(CHUNKED_HEAD)
        for _ in range(75):
            writer.write(chunk(b"data: tick\n\n"))
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.write(b"0\r\n\r\n")  # the stream's end: a client still reading completes
        return True

    async with RawServer(handler) as srv, open_pool() as pool:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        resp = await get(pool, srv.origin, idle_timeout_s=0.1, total_timeout_s=0.3)
        with pytest.raises(TimeoutError, match="did not complete"):
            while await resp.read_chunk():
                pass
        assert loop.time() - t0 >= 0.29


@both_loops
async def test_server_closing_mid_body() -> None:
    cut = {
        b"/len": b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789",
        b"/chunked": CHUNKED_HEAD + chunk(b"data: 1\n\n"),
    }

    async def handler(req: Req, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(cut[req.head.split(b" ")[1]])
        await writer.drain()
        return False

    async with RawServer(handler) as srv, open_pool() as pool:
        for path in cut:
            resp = await pool.request(srv.origin, b"GET", path, [], **ALL_TIMEOUTS)
            assert await resp.read_chunk() in (b"0123456789", b"data: 1\n\n")
            with pytest.raises(UpstreamBrokenError, match="closed mid-body"):
                await resp.read_chunk()
            resp.release()


@both_loops
async def test_server_resetting_mid_body() -> None:
    async def handler_rst(
        req: Req, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        writer.write(CHUNKED_HEAD + chunk(b"data: 1\n\n"))
        await writer.drain()
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
        return False

    async with RawServer(handler_rst) as srv, open_pool() as pool:
        resp = await get(pool, srv.origin)
        with pytest.raises(UpstreamBrokenError):
            while await resp.read_chunk():
                pass
        resp.release()


@both_loops
async def test_garbage_inside_a_chunked_body() -> None:
    answer = CHUNKED_HEAD + chunk(b"hello") + b"ZZZ not a chunk size\r\n\r\n"
    async with RawServer(reply(answer)) as srv, open_pool() as pool:
        resp = await get(pool, srv.origin)
        assert await resp.read_chunk() == b"hello"
        with pytest.raises(UpstreamBrokenError, match="invalid response body"):
            await resp.read_chunk()
        resp.release()
        await poll_until(lambda: srv.ended == 1)


@both_loops
async def test_read_all_over_the_limit() -> None:
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n" + b"x" * 1000
    async with RawServer(reply(answer)) as srv, open_pool() as pool:
        resp = await get(pool, srv.origin)
        with pytest.raises(UpstreamTooLargeError):
            await resp.read_all(999)
        assert await body_of(await get(pool, srv.origin)) == b"x" * 1000


@both_loops
async def test_abort_mid_stream_is_a_disconnect_the_server_sees() -> None:
    gone = asyncio.Event()

    async def handler(req: Req, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(CHUNKED_HEAD + chunk(b"data: 1\n\n"))
        return await until_gone(reader, gone)

    async with RawServer(handler) as srv, open_pool() as pool:
        resp = await get(pool, srv.origin)
        assert await resp.read_chunk() == b"data: 1\n\n"
        resp.abort()
        await asyncio.wait_for(gone.wait(), 2)
        with pytest.raises(UpstreamBrokenError):
            await resp.read_chunk()
        resp.abort()  # idempotent


@both_loops
async def test_backpressure_bounds_what_a_slow_reader_buffers() -> None:
    """50 MB from a fast server to a reader that stops: the client holds at most ~2 reads' worth."""
    size, block = 50 * 2**20, b"x" * 2**16
    sent = [0]

    async def handler(req: Req, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        sent[0] = 0
        while sent[0] < size:
            writer.write(block)
            sent[0] += len(block)
            await writer.drain()
        return True

    async with RawServer(handler) as srv, open_pool() as pool:
        resp = await get(pool, srv.origin, idle_timeout_s=0.2)
        await poll_until(lambda: resp.buffered > HIGH_WATER_BYTES)
        last = -1
        while sent[0] != last:  # until the server is stuck in drain(): the kernel buffers are full
            last = sent[0]
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # longer than the idle timeout: a paused read is not a stall
        assert HIGH_WATER_BYTES < resp.buffered <= 2 * HIGH_WATER_BYTES
        assert sent[0] < size // 2
        total, biggest = 0, 0
        while part := await resp.read_chunk():
            total += len(part)
            biggest = max(biggest, len(part))
        assert total == size
        assert biggest <= 2 * HIGH_WATER_BYTES
        resp.release()
        assert await body_of(await get(pool, srv.origin)) == b"x" * size
        assert srv.accepted == 1


# --- https -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl binary to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_https_origin(loop: str, certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=str(cert))

    async def case() -> None:
        async with RawServer(reply(OK), tls=server_ctx) as srv:
            async with open_pool(ssl_context=client_ctx) as pool:
                for _ in range(2):
                    assert await body_of(await get(pool, srv.origin)) == b"hello"
            async with open_pool() as pool:  # the default context does not trust it
                with pytest.raises(UpstreamConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                    await get(pool, srv.origin)
        assert srv.accepted == 1  # a failed handshake never reaches the handler

    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        runner.run(case())


def test_bad_origin_and_header_injection_are_refused() -> None:
    async def case() -> None:
        async with open_pool() as pool:
            with pytest.raises(ValueError, match="not an http"):
                await pool.request("ftp://x", b"GET", b"/", [])
            with pytest.raises(ValueError, match="path"):
                await pool.request("http://127.0.0.1:1/v1", b"GET", b"/", [])
            with pytest.raises(ValueError, match="CR or LF"):
                await pool.request("http://127.0.0.1:1", b"GET", b"/", [(b"x-a", b"1\r\nx-b: 2")])
            with pytest.raises(ValueError, match="CR or LF"):
                await pool.request("http://127.0.0.1:1", b"GET", b"/ HTTP/1.1\r\nx: y", [])

    asyncio.run(case())
