"""A lean HTTP/1.1 keep-alive client for the gateway's hot path: asyncio protocols and httptools.

One request per connection at a time, idle ones pooled per origin and closed once idle past their
TTL. This module holds the connections, their pool and the timer wheel; `http_response.py` one
response (the parser, body buffer, backpressure), `http_errors.py` the errors. The control plane
(probes, scrapes, model lists) runs on its own instance (`control.py`).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections import deque
from collections.abc import Sequence
from urllib.parse import urlsplit

from gateway.transport.errors import (
    UpstreamBrokenError,
    UpstreamClientError,
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamProtocolError,
    UpstreamTooLargeError,
)
from gateway.transport.response import HIGH_WATER_BYTES, MAX_HEAD_BYTES, Header, UpstreamResponse

__all__ = [
    "HIGH_WATER_BYTES",
    "MAX_HEAD_BYTES",
    "UpstreamBrokenError",
    "UpstreamClientError",
    "UpstreamConnectError",
    "UpstreamConnectTimeout",
    "HttpClient",
    "UpstreamProtocolError",
    "UpstreamResponse",
    "UpstreamTooLargeError",
]

TIMER_SLOT_S = 0.05  # timeouts are checked on this grid: they fire up to this much late
_FRAMING = frozenset({b"host", b"content-length", b"connection", b"transfer-encoding"})


class _Origin:
    """scheme://host:port, parsed once, with its idle connections (most recent last)."""

    __slots__ = ("name", "host", "port", "tls", "host_header", "idle", "received")

    def __init__(self, name: str, host: str, port: int, tls: bool, host_header: bytes) -> None:
        self.name = name
        self.host = host
        self.port = port
        self.tls = tls
        self.host_header = host_header
        self.idle: deque[_Connection] = deque()
        self.received = 0  # bytes that came from it: a busy replica still sends, a dead one not


class _Connection(asyncio.Protocol):
    """One TCP connection; it feeds whatever response currently owns it."""

    __slots__ = ("pool", "origin", "transport", "resp", "closed", "idle", "idle_since", "uses")

    def __init__(self, pool: HttpClient, origin: _Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.resp: UpstreamResponse | None = None
        self.closed = False
        self.idle = False
        self.idle_since = 0.0
        self.uses = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:  # small writes (an SSE chunk, a request) must not wait for an ACK
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, AttributeError):
                pass
        self.pool._conns.add(self)

    def data_received(self, data: bytes) -> None:
        self.origin.received += len(data)
        resp = self.resp
        if resp is None:  # bytes nobody asked for: the connection's framing can't be trusted
            self.close(abort=True)
            return
        resp._feed(data)

    def eof_received(self) -> bool:
        self.closed = True  # not to be taken from the pool in the turn before connection_lost
        return False  # close; connection_lost tells the response

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._lost(self)
        resp = self.resp
        if resp is not None:
            self.resp = None
            resp._lost(exc)

    def close(self, abort: bool = False) -> None:
        self.closed = True
        t = self.transport
        if t is not None:
            t.abort() if abort else t.close()

    def reuse(self) -> None:
        self.pool._put(self)


class _Timers:
    """Deadlines rounded up to TIMER_SLOT_S: one loop timer per slot, shared by every response in it.

    A loop timer per request costs 2-4 us to make and cancel; a slot costs a set add and discard.
    Timeouts fire up to one slot late.
    """

    __slots__ = ("loop", "slots")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.slots: dict[int, tuple[asyncio.TimerHandle, set[UpstreamResponse]]] = {}

    def add(self, resp: UpstreamResponse, at: float) -> int:
        key = int(at / TIMER_SLOT_S) + 1
        slot = self.slots.get(key)
        if slot is None:
            handle = self.loop.call_at(key * TIMER_SLOT_S, self._fire, key)
            slot = self.slots[key] = (handle, set())
        slot[1].add(resp)
        return key

    def remove(self, resp: UpstreamResponse, key: int) -> None:
        slot = self.slots.get(key)
        if slot is not None:
            slot[1].discard(resp)
            if not slot[1]:  # nobody waits on this deadline any more: free its loop timer now
                slot[0].cancel()
                del self.slots[key]

    @staticmethod
    def end_of(key: int) -> float:
        return key * TIMER_SLOT_S

    def _fire(self, key: int) -> None:
        slot = self.slots.pop(key, None)
        if slot is not None:
            for resp in slot[1]:
                resp._on_timer()

    def close(self) -> None:
        for handle, _ in self.slots.values():
            handle.cancel()
        self.slots.clear()


class HttpClient:
    """Keep-alive connections to every replica, LIFO per origin; one request per connection."""

    def __init__(
        self,
        connect_timeout_s: float,
        max_idle_per_origin: int = 256,
        idle_ttl_s: float = 30.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._max_idle = max_idle_per_origin
        self._ttl = idle_ttl_s
        self._ssl_context = ssl_context  # https origins; the default context when None
        self._origins: dict[str, _Origin] = {}
        self._by_key: dict[tuple[str, str, int], _Origin] = {}
        self._conns: set[_Connection] = set()
        self._closed = False
        self._all_lost: asyncio.Future[None] | None = None
        self._timers: _Timers | None = None
        self._sweep: asyncio.TimerHandle | None = None  # closes idle connections past the TTL

    async def request(
        self,
        origin: str,
        method: bytes,
        path: bytes,
        headers: Sequence[Header],
        body: bytes = b"",
        *,
        first_byte_timeout_s: float | None = None,
        idle_timeout_s: float | None = None,
        total_timeout_s: float | None = None,
    ) -> UpstreamResponse:
        """Send one request to `origin` ("http://host:port") and return once its headers are in.

        `headers` are lowercase names; host, content-length, connection and transfer-encoding are
        the client's own and dropped from them. Raises UpstreamConnectError (nothing of the
        response arrived: retryable), TimeoutError (no headers within first_byte_timeout_s or
        total_timeout_s), ValueError for a bad origin or a CR/LF in a header.
        """
        if self._closed:
            raise RuntimeError("HttpClient is closed")
        o = self._origins.get(origin) or self._parse_origin(origin)
        payload = _encode(method, path, o.host_header, headers, body)
        loop = asyncio.get_running_loop()
        timers = self._timers
        if timers is None or timers.loop is not loop:
            timers = self._timers = _Timers(loop)
        now = loop.time()
        deadline = None if total_timeout_s is None else now + total_timeout_s
        hdr_deadline = None if first_byte_timeout_s is None else now + first_byte_timeout_s
        if deadline is not None and (hdr_deadline is None or deadline < hdr_deadline):
            hdr_deadline = deadline
        conn = self._take(o, now)
        retried = False
        while True:
            if conn is None:
                conn = await self._connect(o, loop, deadline)
            reused = conn.uses > 0
            conn.uses += 1
            resp = UpstreamResponse(
                loop, timers, conn, method == b"HEAD", hdr_deadline, deadline, idle_timeout_s
            )
            conn.resp = resp
            conn.transport.write(payload)  # type: ignore[union-attr]
            try:
                await resp._wait_headers()
            except UpstreamConnectError as exc:
                resp.abort()
                # a kept-alive connection the server closed meanwhile: once, on a fresh one
                stale = reused and not resp._received and type(exc) is UpstreamConnectError
                if stale and not retried:
                    retried, conn = True, None
                    continue
                raise
            except BaseException:  # timeout, or cancelled: hang up so the engine aborts
                resp.abort()
                raise
            return resp

    def received(self, origin: str) -> int:
        """Bytes received from `origin` (as given to `request`) so far: when it moves, the
        replica is alive, however slow it is to accept a connection or answer a probe."""
        o = self._origins.get(origin)
        return o.received if o is not None else 0

    async def __aenter__(self) -> HttpClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every connection, idle or busy (busy responses fail), and wait until they are."""
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for o in self._by_key.values():
            o.idle.clear()
        if not self._conns:
            if self._timers is not None:
                self._timers.close()
            return
        self._all_lost = asyncio.get_running_loop().create_future()
        for c in list(self._conns):
            c.close(abort=True)
        await self._all_lost
        if self._timers is not None:
            self._timers.close()

    # --- connections ----------------------------------------------------------------------------
    def _parse_origin(self, origin: str) -> _Origin:
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"upstream origin {origin!r} is not an http(s) URL")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(f"upstream origin {origin!r} has a path, query or fragment")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        key = (parts.scheme, parts.hostname, port)
        o = self._by_key.get(key)
        if o is None:
            netloc = parts.netloc.rpartition("@")[2]  # no userinfo in names, errors or Host
            name = f"{parts.scheme}://{netloc}"
            o = _Origin(name, parts.hostname, port, tls, netloc.encode("idna"))
            self._by_key[key] = o
        self._origins[origin] = o
        return o

    async def _connect(
        self, o: _Origin, loop: asyncio.AbstractEventLoop, deadline: float | None
    ) -> _Connection:
        timeout = self._connect_timeout_s
        if deadline is not None:
            timeout = min(timeout, max(0.0, deadline - loop.time()))
        conn = _Connection(self, o)
        tls: ssl.SSLContext | None = None
        if o.tls:
            if self._ssl_context is None:
                self._ssl_context = ssl.create_default_context()
            tls = self._ssl_context
        try:
            async with asyncio.timeout(timeout):
                await loop.create_connection(lambda: conn, o.host, o.port, ssl=tls)
        except TimeoutError:
            raise UpstreamConnectTimeout(
                f"connect to {o.name} timed out after {timeout:.3g} s"
            ) from None
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to {o.name}: {exc}") from exc
        if self._closed:
            conn.close(abort=True)
            raise RuntimeError("HttpClient is closed")
        return conn

    def _take(self, o: _Origin, now: float) -> _Connection | None:
        idle = o.idle
        while idle:
            conn = idle.pop()
            conn.idle = False
            if conn.closed:
                continue
            if now - conn.idle_since > self._ttl:  # the most recent is stale: all of them are
                conn.close()
                while idle:
                    old = idle.pop()
                    old.idle = False
                    old.close()
                return None
            return conn
        return None

    def _put(self, conn: _Connection) -> None:
        if self._closed or self._max_idle <= 0:
            conn.close()
            return
        idle = conn.origin.idle
        now = asyncio.get_running_loop().time()
        while idle and (len(idle) >= self._max_idle or now - idle[0].idle_since > self._ttl):
            old = idle.popleft()
            old.idle = False
            old.close()
        conn.idle = True
        conn.idle_since = now
        idle.append(conn)
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_at(now + self._ttl, self._expire)

    def _expire(self) -> None:
        """Close the connections idle for longer than the TTL, without waiting for a request to
        notice (the replica would keep their sockets); runs while any connection is idle."""
        self._sweep = None
        if self._closed:
            return
        loop = asyncio.get_running_loop()
        now = loop.time() + 1e-3  # loop timers may fire up to a millisecond early
        next_at: float | None = None
        for o in self._by_key.values():
            idle = o.idle
            while idle and now - idle[0].idle_since >= self._ttl:  # oldest first
                old = idle.popleft()
                old.idle = False
                old.close()
            if idle:
                at = idle[0].idle_since + self._ttl
                next_at = at if next_at is None else min(next_at, at)
        if next_at is not None:
            self._sweep = loop.call_at(next_at, self._expire)

    def _lost(self, conn: _Connection) -> None:
        self._conns.discard(conn)
        if conn.idle:
            conn.idle = False
            try:
                conn.origin.idle.remove(conn)
            except ValueError:
                pass
        if not self._conns and self._all_lost is not None and not self._all_lost.done():
            self._all_lost.set_result(None)


def _encode(
    method: bytes, path: bytes, host: bytes, headers: Sequence[Header], body: bytes
) -> bytes:
    """Request line, headers and body as one buffer: one write, one segment for small requests."""
    parts = [method, b" ", path, b" HTTP/1.1\r\nhost: ", host, b"\r\n"]
    lines = 5  # request line, host, content-length, connection, the empty line
    for name, value in headers:
        if name not in _FRAMING:
            parts += (name, b": ", value, b"\r\n")
            lines += 1
    parts.append(b"content-length: %d\r\nconnection: keep-alive\r\n\r\n" % len(body))
    head = b"".join(parts)
    # one count per character beats checking every value (`b"\n" in v` is slow on bytes)
    if head.count(b"\n") != lines or head.count(b"\r") != lines:
        raise ValueError("CR or LF inside the upstream request line or a header")
    return head + body
