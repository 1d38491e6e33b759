"""`ResponseWriter`: the one way an answer leaves the gateway, whole or streamed.

Under the gateway's own server protocol (`gateway serve`: uvicorn with GuardedHttpToolsProtocol)
a response can go straight to the client's socket (`protocol.BodyWriter`, the lane: a head
and a body in one write, a chunk without two coroutine calls and a copy); under any other ASGI
server, or when the lane cannot take the bytes now (backpressure, a HEAD request, a header the
lane will not write), they go through ASGI `send`. Callers never choose: they `whole`, or
`begin`, `write` and `end`, and the writer keeps the response's state (started, ended).
"""

from __future__ import annotations

from gateway.transport.protocol import BodyWriter, body_writer
from gateway.types import Headers, Send

SEND_SLICE = 256 * 1024  # a large whole answer goes in slices, each waiting for the last to drain


class ResponseWriter:
    """One response, to one client: `whole(status, headers, body)`, or `begin`, any number of
    `write`s and `end` for a chunked stream. `started`: something of it went out (no error
    answer can follow)."""

    __slots__ = ("send", "lane", "_started", "_ended")

    def __init__(self, send: Send, lane: BodyWriter | None = None) -> None:
        self.send = send
        self.lane = lane
        self._started = False
        self._ended = False

    @classmethod
    def current(cls, send: Send) -> ResponseWriter:
        """The writer for the request whose task this is (the lane, where the server has one)."""
        return cls(send, body_writer())

    @property
    def started(self) -> bool:
        return self._started or (self.lane is not None and self.lane.started)

    async def whole(
        self, status: int, headers: Headers, body: bytes, close: bool = False
    ) -> None:
        """The complete answer, framed by a content-length: one write when it can, else the
        head and the body (in SEND_SLICE slices when large) through `send`. `close`: the
        connection closes after it (the body was not read, or the server is full)."""
        self._started = True
        lane = self.lane
        if (
            lane is not None
            and not close
            and len(body) <= SEND_SLICE
            and lane.whole(status, headers, body)
        ):
            self._ended = True
            return
        framed = [*headers, (b"content-length", str(len(body)).encode())]
        if close:
            framed.append((b"connection", b"close"))
        await self.send({"type": "http.response.start", "status": status, "headers": framed})
        n, start = len(body), 0
        while n - start > SEND_SLICE:
            await self.send({"type": "http.response.body", "body": body[start : start + SEND_SLICE],
                             "more_body": True})  # fmt: skip
            start += SEND_SLICE
        await self.send({"type": "http.response.body", "body": body[start:] if start else body,
                         "more_body": False})  # fmt: skip
        self._ended = True

    async def begin(self, status: int, headers: Headers, first: bytes = b"") -> None:
        """Start a chunked stream with `first` as its first chunk (none when empty)."""
        self._started = True
        lane = self.lane
        if lane is not None and lane.begin(status, headers, first):
            return
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        if first:
            await self.write(first)

    def write_now(self, chunk: bytes) -> bool:
        """Write `chunk` of the stream if it can go to the client at once (the lane, no
        backpressure); False when it cannot: nothing was written, `write` it."""
        return self.lane is not None and self.lane.write(chunk)

    async def write(self, chunk: bytes) -> None:
        """A chunk of the stream (non-empty), at once or when the client takes it."""
        if not self.write_now(chunk):
            await self.send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def end(self, last: bytes = b"") -> None:
        """End the stream, `last` as its last chunk (none when empty), in one write when it can."""
        if self._ended:
            return
        self._ended = True
        lane = self.lane
        if lane is None or not lane.end(last):
            await self.send({"type": "http.response.body", "body": last, "more_body": False})
