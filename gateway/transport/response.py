"""One response of the request path's HTTP client: its HTTP/1.1 parser (httptools), body buffer,
backpressure and deadlines.

`client.py` owns the connections and the timer wheel; a response sees them through `Link` and
`Deadlines`. The connection calls the underscored methods under "the connection's side"; callers
read with `read_chunk`/`read_all` (or `pipe` to a callback) and end with `release`/`abort`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

import httptools

from gateway.transport.errors import (
    UpstreamBrokenError,
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamTooLargeError,
)

__all__ = ["HIGH_WATER_BYTES", "MAX_HEAD_BYTES", "Deadlines", "Header", "Link", "UpstreamResponse"]

Header = tuple[bytes, bytes]

HIGH_WATER_BYTES = 256 * 1024  # unread body bytes past which the socket stops being read
MAX_HEAD_BYTES = 1024 * 1024  # status line and headers (interim answers included) at most
_HEADERS, _BODY, _DONE = 0, 1, 2  # UpstreamResponse._phase


class Link(Protocol):
    """The connection a response reads from, as the response sees it (`client._Connection`)."""

    transport: asyncio.Transport | None
    resp: UpstreamResponse | None
    closed: bool

    def close(self, abort: bool = False) -> None: ...

    def reuse(self) -> None:
        """The message is complete and the connection keeps alive: back to the idle pool."""
        ...


class Deadlines(Protocol):
    """The client's timer wheel (`client._Timers`): it calls `_on_timer` once `at` passed."""

    def add(self, resp: UpstreamResponse, at: float) -> int: ...

    def remove(self, resp: UpstreamResponse, key: int) -> None: ...

    def end_of(self, key: int) -> float: ...


class UpstreamResponse:
    """Status and headers of one response; the body is read with read_chunk or read_all.

    The connection goes back to the pool by itself once the whole message has arrived with
    keep-alive, even if the body is still unread here; release() or abort() before that closes it.
    """

    __slots__ = (
        "status",
        "headers",
        "_loop",
        "_conn",
        "_parser",
        "_head",
        "_phase",
        "_error",
        "_chunks",
        "_buffered",
        "_paused",
        "_waiter",
        "_keep_alive",
        "_extra",
        "_received",
        "_head_bytes",
        "_timers",
        "_slot",
        "_hdr_deadline",
        "_deadline",
        "_idle_s",
        "_last",
        "_sink",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        timers: Deadlines,
        conn: Link,
        head: bool,
        hdr_deadline: float | None,
        deadline: float | None,
        idle_s: float | None,
    ) -> None:
        self.status = 0
        self.headers: list[Header] = []
        self._loop = loop
        self._conn: Link | None = conn
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self._head = head
        self._phase = _HEADERS
        self._error: BaseException | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._keep_alive = False
        self._extra = False  # bytes after the message: the connection is not reusable
        self._received = False
        self._head_bytes = 0
        self._hdr_deadline = hdr_deadline
        self._deadline = deadline
        self._idle_s = idle_s
        self._last = 0.0
        self._timers = timers
        self._slot = 0  # the timer slot this response waits in; 0: none
        self._sink: Callable[[bytes], bool] | None = None  # `pipe`'s, while it runs
        if hdr_deadline is not None:
            self._slot = timers.add(self, hdr_deadline)

    # --- the caller's side ----------------------------------------------------------------------
    @property
    def buffered(self) -> int:
        """Body bytes received and not yet read (what backpressure bounds)."""
        return self._buffered

    async def read_chunk(self) -> bytes:
        """The body bytes that arrived since the last read, at least one byte; b"" at the end.

        Raises UpstreamBrokenError if the body was cut short, TimeoutError on the idle or total
        timeout; bytes that arrived before the failure are returned first.
        """
        while True:
            chunks = self._chunks
            if chunks:
                self._chunks = []
                self._buffered = 0
                if self._paused:
                    self._resume()
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
            if self._error is not None:
                raise self._error
            if self._phase == _DONE:
                return b""
            self._waiter = w = self._loop.create_future()
            await w

    async def pipe(self, sink: Callable[[bytes], bool]) -> None:
        """Hand the body bytes (those here first) to `sink` in the connection's own callback, no
        task woken per chunk, until it returns False (it must not raise), the body ends or fails;
        then `read_chunk` reads on."""
        self._sink = sink
        try:
            if self._chunks:
                self._push()
            while self._sink is not None and self._phase != _DONE and self._error is None:
                self._waiter = w = self._loop.create_future()
                await w
        finally:
            self._sink = None

    def _push(self) -> None:
        chunks, self._chunks, self._buffered = self._chunks, [], 0
        if self._paused:
            self._resume()
        if not self._sink(chunks[0] if len(chunks) == 1 else b"".join(chunks)):  # type: ignore[misc]
            self._sink = None
            self._wake()

    async def read_all(self, limit: int) -> bytes:
        """The whole body; UpstreamTooLargeError (connection closed) past `limit` bytes."""
        if self._phase == _DONE and self._error is None and self._buffered <= limit:
            chunks, self._chunks, self._buffered = self._chunks, [], 0  # all here already
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        parts: list[bytes] = []
        size = 0
        while True:
            chunk = await self.read_chunk()
            if not chunk:
                break
            size += len(chunk)
            if size > limit:
                self.abort()
                raise UpstreamTooLargeError(f"upstream body larger than {limit} bytes")
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release(self) -> None:
        """Done with this response: a complete keep-alive message is pooled already, else close."""
        self.abort()

    def abort(self) -> None:
        """Hang up now unless the message is complete, so the engine aborts the request."""
        if self._phase != _DONE and self._error is None:
            self._error = UpstreamBrokenError("response released before its end")
        self._hang_up()

    # --- the connection's side ------------------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        self._received = True
        entering = self._phase == _HEADERS
        if entering:
            self._head_bytes += len(data)
        parser = self._parser
        if parser is not None:
            try:
                parser.feed_data(data)
            except httptools.HttpParserUpgrade:
                self._bad_bytes("the upstream switched protocols")
            except httptools.HttpParserError as exc:
                self._bad_bytes(str(exc) or type(exc).__name__)
        if self._sink is not None and self._chunks and self._error is None:
            self._push()
        phase = self._phase
        if phase == _DONE:
            if self._conn is not None:
                self._finish()
        elif phase == _HEADERS and self._head_bytes > MAX_HEAD_BYTES and self._error is None:
            self._bad_bytes(f"response headers larger than {MAX_HEAD_BYTES} bytes")
        elif phase == _BODY and self._conn is not None:
            if self._idle_s is not None or self._deadline is not None:
                self._last = self._loop.time()
                if entering:
                    self._arm_body()
            elif entering:
                self._stop_timer()
            if self._buffered > HIGH_WATER_BYTES and not self._paused:
                self._paused = True
                self._conn.transport.pause_reading()  # type: ignore[union-attr]
        if self._sink is None or self._phase == _DONE:  # a pipe sleeps on through its chunks
            self._wake()

    def _lost(self, exc: Exception | None) -> None:
        self._conn = None
        if self._phase == _HEADERS:
            why = "reset" if exc is not None else "closed"
            self._fail(UpstreamConnectError(f"upstream connection {why} before response headers"))
        elif self._phase == _BODY:
            if exc is None and not self._framed():  # the body runs to EOF: this is its end
                self._phase = _DONE
                self._parser = None
                self._stop_timer()
                self._wake()
            else:
                why = f"reset ({type(exc).__name__})" if exc is not None else "closed"
                self._fail(UpstreamBrokenError(f"upstream connection {why} mid-body"))

    def _framed(self) -> bool:
        return any(k == b"content-length" or k == b"transfer-encoding" for k, _ in self.headers)

    def _bad_bytes(self, reason: str) -> None:
        if self._phase == _HEADERS:
            self._fail(UpstreamProtocolError(f"invalid response from upstream: {reason}"))
        elif self._phase == _BODY:
            self._fail(UpstreamBrokenError(f"invalid response body from upstream: {reason}"))
        else:
            self._extra = True

    def _fail(self, err: BaseException) -> None:
        if self._error is None:
            self._error = err
        self._hang_up()

    def _hang_up(self) -> None:
        """Stop reading: the connection is closed (never pooled) and the reader woken."""
        self._sink = None
        self._stop_timer()
        self._parser = None
        conn = self._conn
        if conn is not None:
            self._conn = None
            conn.resp = None
            conn.close(abort=True)
        self._wake()

    def _finish(self) -> None:
        """The whole message is here: the connection goes back to the pool (or is closed)."""
        self._stop_timer()
        self._parser = None
        conn = self._conn
        assert conn is not None
        self._conn = None
        conn.resp = None
        if self._keep_alive and not self._extra and not conn.closed:
            conn.reuse()
        else:
            conn.close()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    def _resume(self) -> None:
        self._paused = False
        conn = self._conn
        if conn is not None and not conn.closed:
            self._last = self._loop.time()  # the idle clock restarts when reading does
            conn.transport.resume_reading()  # type: ignore[union-attr]

    async def _wait_headers(self) -> None:
        while self._phase == _HEADERS:
            if self._error is not None:
                raise self._error
            self._waiter = w = self._loop.create_future()
            await w

    # --- timers: a slot of the pool's wheel, moved only when the headers arrive or it fires ------
    def _stop_timer(self) -> None:
        if self._slot:
            self._timers.remove(self, self._slot)
            self._slot = 0

    def _arm_body(self) -> None:
        """The headers are in: the deadline now is the idle or total one, whichever comes first."""
        at = self._body_deadline()
        if at is None:
            self._stop_timer()
        elif not self._slot or at < self._timers.end_of(self._slot):
            self._stop_timer()
            self._slot = self._timers.add(self, at)

    def _body_deadline(self) -> float | None:
        at = self._deadline
        if self._idle_s is not None:
            idle_at = self._last + self._idle_s
            if at is None or idle_at < at:
                at = idle_at
        return at

    def _on_timer(self) -> None:
        self._slot = 0
        if self._phase == _DONE or self._error is not None:
            return
        now = self._loop.time() + 1e-3  # loop timers may fire up to a millisecond early
        if self._phase == _HEADERS:
            hd = self._hdr_deadline
            if hd is not None and now >= hd:
                self._fail(TimeoutError("no response headers from the upstream in time"))
                return
            at = hd
        else:
            if self._deadline is not None and now >= self._deadline:
                self._fail(TimeoutError("the upstream response did not complete in time"))
                return
            if self._idle_s is not None:
                if self._paused or self._chunks:  # the reader is slow, not the upstream
                    self._last = now
                elif now >= self._last + self._idle_s:
                    self._fail(TimeoutError(f"no body bytes from upstream for {self._idle_s} s"))
                    return
            at = self._body_deadline()
        if at is not None:
            self._slot = self._timers.add(self, at)

    # --- httptools callbacks --------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self._phase == _DONE:
            self._extra = True

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._phase == _HEADERS:  # not the trailers of a chunked body
            self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        if self._phase != _HEADERS:
            return
        parser = self._parser
        assert parser is not None
        status = parser.get_status_code()
        if status < 200:
            if status == 101:
                raise httptools.HttpParserError("unexpected 101 Switching Protocols")
            self.headers = []  # an interim answer (100 Continue, 103 Early Hints): skip it
            return
        self.status = status
        self._phase = _BODY
        if self._head:  # no body follows, whatever the headers say
            self._phase = _DONE
            self._keep_alive = parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        if self._phase != _BODY:
            self._extra = True
            return
        self._chunks.append(body)
        self._buffered += len(body)

    def on_message_complete(self) -> None:
        if self._phase == _BODY:
            self._phase = _DONE
            self._keep_alive = self._parser.should_keep_alive()  # type: ignore[union-attr]
