"""uvicorn's httptools protocol with the limits it lacks: a deadline for request headers and caps
on their count and size, so slowloris clients and header floods cannot hold memory or sockets.

It also tells the app when the server's graceful shutdown begins (uvicorn tells connections, not
apps): the app's `begin_shutdown(grace_s)` ends its streams before the grace runs out; and it
gives each request's task a `BodyWriter` (`body_writer()`), with which the stream relay writes a
chunk of a streamed body straight to the client's socket when it can go at once, instead of an
ASGI message, two coroutine calls and a copy per chunk.

And it never resets a connection under a request the client sent: every close it makes (the
keep-alive timeout, a refusal, the end of a `Connection: close` answer, an idle connection at
shutdown) is a lingering close, FIN first and whatever the client still sends read and dropped
until it closes too (at most `LINGER_S`), so the client reads a clean end, never a reset that
can also destroy the answer it was reading; and the idle timeout never closes a connection whose
next request already waits in the socket (a loop that stalled past the deadline serves it).

What the server layer answers itself, before (or instead of) the app, is an OpenAI-shaped JSON
error like every other answer (gateway/errors.py): 400 `invalid_http_request` for what the HTTP
parser refuses (a bad request line, header or chunked encoding), 408 for headers not in within
HEADER_TIMEOUT_S, 431 past the header caps, 500 when the app failed before answering, 503 past
uvicorn's `limit_concurrency` (unset by `gateway serve`); each refusal ends with that lingering
close, so a client still sending (a 200 KB header) reads the answer."""

from __future__ import annotations

import asyncio
import select
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from gateway.errors import (
    BadRequest,
    GatewayError,
    HeadersTooLarge,
    RequestTimeout,
    ServerBusy,
    error_body,
)
from gateway.transport import delays
from gateway.types import Receive, Scope, Send

MAX_HEADER_BYTES = 64 * 1024
MAX_HEADERS = 256
HEADER_TIMEOUT_S = 10.0
DEADLINE_TICK_S = 0.25  # the header and keep-alive deadlines fire up to this much late
LINGER_S = 2.0  # a closing connection reads and drops the client's bytes this long at most


def error_head(exc: GatewayError, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """The whole answer for `exc` on a connection about to close: status line, the server's
    default headers, JSON framed by its length."""
    body = error_body(exc)
    parts = [STATUS_LINE[exc.status]]
    for name, value in (*default_headers, (b"content-type", b"application/json"),
                        (b"content-length", b"%d" % len(body)), (b"connection", b"close")):  # fmt: skip
        parts += (name, b": ", value, b"\r\n")
    parts += (b"\r\n", body)
    return b"".join(parts)


class _Cycle(RequestResponseCycle):
    """uvicorn's request cycle whose own 500 (the app failed, or returned without answering)
    is an OpenAI-shaped error."""

    async def send_500_response(self) -> None:
        await _send_error(GatewayError("Internal gateway error"), self.send)  # type: ignore[arg-type]


async def _send_error(exc: GatewayError, send: Send) -> None:
    body = error_body(exc)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
               (b"connection", b"close"), *((k.encode(), v.encode()) for k, v in exc.headers().items())]  # fmt: skip
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _over_concurrency(scope: Scope, receive: Receive, send: Send) -> None:
    """What answers past uvicorn's `limit_concurrency` instead of its plain-text 503."""
    await _send_error(ServerBusy("The server is at its connection limit; retry shortly",
                                 code="limit_concurrency", retry_after=1), send)  # fmt: skip


class BodyWriter:
    """The fast lane for one response's streamed body, beside (never instead of) ASGI `send`."""

    __slots__ = ("cycle",)

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self.cycle = cycle

    def write(self, body: bytes) -> bool:
        """Write `body` (non-empty) as one chunk of the started chunked response, if it can go
        now; False when it cannot (the client applies backpressure or left, the response is not
        a started chunked one, or it is complete): then nothing was written, `send` it."""
        if not self._chunk_now():
            return False
        self.cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        return True

    def end(self, last: bytes) -> bool:
        """End the started chunked response, `last` (none when empty) as its last chunk, in one
        write, and complete it as `send` would; False when it cannot go now (as for `write`):
        then nothing was written, `send` the end."""
        if not self._chunk_now():
            return False
        c = self.cycle
        c.transport.write((b"%x\r\n%b\r\n0\r\n\r\n" % (len(last), last)) if last else b"0\r\n\r\n")
        self._complete()
        return True

    def _complete(self) -> None:
        """The response is all written: what `send` does after its last body message."""
        c = self.cycle
        c.response_complete = True
        c.message_event.set()
        if not c.keep_alive:
            c.transport.close()  # the protocol's lingering close (`_CycleTransport`)
        c.on_response()

    def _chunk_now(self) -> bool:
        """A chunk of the started chunked response can go to the client at once."""
        c = self.cycle
        return not (
            c.flow.write_paused
            or c.disconnected
            or c.chunked_encoding is not True
            or c.response_complete
            or not c.response_started
        )

    @property
    def started(self) -> bool:
        """Whether the response began (through `send`, `whole` or `begin`): no error answer can
        follow."""
        return bool(self.cycle.response_started)

    def whole(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
        """Write a complete response, `body` framed by a content-length, in one write (uvicorn's
        `send` writes the head and the body apart: two system calls and two ASGI messages),
        when nothing of it went out yet and the client takes bytes at once; False when it
        cannot (then nothing was written: `send` it). `headers`: lowercase names, no framing
        headers (content-length, transfer-encoding, connection); a header with a CR or LF
        is left to uvicorn's `send`, which refuses it."""
        c = self.cycle
        head = self._head(status, headers, b"content-length: %d\r\n\r\n" % len(body))
        if head is None:
            return False
        c.chunked_encoding = False
        c.expected_content_length = 0
        c.transport.write(head + body)
        self._complete()
        return True

    def begin(self, status: int, headers: list[tuple[bytes, bytes]], first: bytes) -> bool:
        """Start a chunked response and write `first` as its first chunk (none when empty), in
        one write: a stream's head and first event leave together, where `send` makes two
        writes and two ASGI messages of them. False when it cannot (as for `whole`); then
        nothing was written: `send` the start and the chunk."""
        c = self.cycle
        head = self._head(status, headers, b"transfer-encoding: chunked\r\n\r\n")
        if head is None:
            return False
        c.chunked_encoding = True
        c.expected_content_length = 0
        c.transport.write((head + b"%x\r\n%b\r\n" % (len(first), first)) if first else head)
        return True

    def _head(
        self, status: int, headers: list[tuple[bytes, bytes]], framing: bytes
    ) -> bytes | None:
        """The response's status line and headers ending with `framing`, the response marked
        started; None (nothing changed) when the response began already, the client is gone or
        not taking bytes, the request is a HEAD, the status is unknown, or a header holds a CR
        or LF."""
        c = self.cycle
        if (
            c.response_started
            or c.disconnected
            or c.flow.write_paused
            or c.scope["method"] == "HEAD"
            or status not in STATUS_LINE
        ):
            return None
        parts = [STATUS_LINE[status]]
        lines = 2  # the status line, the blank line
        for name, value in (*c.default_headers, *headers):
            parts += (name, b": ", value, b"\r\n")
            lines += 1
        if not c.keep_alive:
            parts.append(b"connection: close\r\n")
            lines += 1
        parts.append(framing)  # one header line, then the blank line
        lines += 1
        head = b"".join(parts)
        if head.count(b"\n") != lines or head.count(b"\r") != lines:
            return None
        c.response_started = True
        c.waiting_for_100_continue = False
        return head


class _CycleTransport:
    """The connection as a request's cycle (uvicorn's, and `BodyWriter`) sees it: writes go to the
    socket as before, `close()` is the protocol's lingering close."""

    __slots__ = ("write", "is_closing", "close", "get_extra_info")
    write: Callable[[bytes], None]
    is_closing: Callable[[], bool]
    close: Callable[[], None]
    get_extra_info: Callable[..., Any]

    def __init__(self, protocol: GuardedHttpToolsProtocol) -> None:
        transport = protocol.transport
        self.write = transport.write
        self.get_extra_info = transport.get_extra_info
        self.is_closing = protocol.is_closing
        self.close = protocol.close_softly


def input_waiting(transport: asyncio.BaseTransport) -> bool:
    """Bytes (or the client's end) wait unread in the connection's socket: a request sent that
    the loop has not read yet. False when it cannot tell (no socket)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return False


_WRITER: ContextVar[BodyWriter | None] = ContextVar("kvgateway_body_writer", default=None)


def body_writer() -> BodyWriter | None:
    """The current request's BodyWriter; None under another server (use ASGI `send` only)."""
    return _WRITER.get()


def body_buffered(receive: object) -> bool:
    """Whether `receive` (uvicorn's, under this protocol) will return the whole request body at
    once: its last byte arrived (usually in the same read as the headers), so no deadline needs
    arming for it. False under another server, or while the body is still on its way."""
    cycle = getattr(receive, "__self__", None)
    return (
        isinstance(cycle, RequestResponseCycle)
        and cycle.more_body is False
        and cycle.message_event.is_set()
    )


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_bytes = 0
        self._header_count = 0
        self._refused = False
        self._lingering = False  # closing: FIN sent, the client's bytes are read and dropped
        self._cycle_transport: _CycleTransport | None = None
        # the deadlines each connection keeps, on queues the loop's connections share (no loop
        # timer per request); their callbacks made once
        self._header_deadline = delays.shared(self.loop, HEADER_TIMEOUT_S, DEADLINE_TICK_S)
        self._idle_deadline = delays.shared(self.loop, self.timeout_keep_alive, DEADLINE_TICK_S)
        self._linger_deadline = delays.shared(self.loop, LINGER_S, DEADLINE_TICK_S)
        self._on_slow = self._too_slow
        self._on_idle = self.timeout_keep_alive_handler
        self._on_lingered = self._lingered

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._cycle_transport = _CycleTransport(self)
        self._arm()  # a connection that never sends a request goes too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._unset_keepalive_if_required()
        self._linger_deadline.disarm(self)
        super().connection_lost(exc)

    # --- closing without a reset -----------------------------------------------------------------
    def is_closing(self) -> bool:
        return self._lingering or self.transport.is_closing()

    def close_softly(self) -> None:
        """End the connection so that the client reads a clean end, not a reset: what was written
        goes, then a FIN; bytes the client still sends (a request that crossed the FIN, the rest of
        a refused body) are read and dropped until it closes its side, `LINGER_S` at most. A
        socket closed with unread bytes in it, or that receives bytes once closed, answers them
        with a reset, and a reset can destroy the answer the client had not read yet."""
        t = self.transport
        if self._lingering or t.is_closing():
            return
        self._lingering = True
        self._disarm()
        self._unset_keepalive_if_required()
        try:
            if not t.can_write_eof():
                t.close()
                return
            t.write_eof()
            self.flow.resume_reading()
        except (OSError, RuntimeError):
            t.close()
            return
        self._linger_deadline.arm(self, self._on_lingered)

    def _lingered(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def timeout_keep_alive_handler(self) -> None:
        """The connection was idle for `server.keep_alive_s`: close it, softly, unless its next
        request already waits unread (the loop stalled past the deadline): that one is served."""
        if self.is_closing() or input_waiting(self.transport):
            return
        self.close_softly()

    # uvicorn arms a loop timer for the keep-alive timeout after every response; this protocol
    # arms the loop's shared queue of such deadlines instead (what uvicorn's
    # on_response_complete does, with that one change)
    def _unset_keepalive_if_required(self) -> None:
        self._idle_deadline.disarm(self)

    def on_response_complete(self) -> None:
        self.server_state.total_requests += 1
        if self.is_closing():
            return
        self._unset_keepalive_if_required()
        self.flow.resume_reading()
        if self.pipeline:  # the next pipelined request, if any; else wait for one
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        else:
            self._idle_deadline.arm(self, self._on_idle)

    def shutdown(self) -> None:
        grace = self.config.timeout_graceful_shutdown
        if grace is not None:
            app: Any = self.app
            for _ in range(8):  # through uvicorn's middleware (proxy headers, message logger)
                hook = getattr(app, "begin_shutdown", None)
                if hook is not None:
                    hook(float(grace))
                    break
                app = getattr(app, "app", None)
                if app is None:
                    break
        # uvicorn's, with a lingering close: an idle connection ends now, a busy one after the
        # answer in flight (which says `connection: close`)
        if self.cycle is None or self.cycle.response_complete:
            self.close_softly()
        else:
            self.cycle.keep_alive = False

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        cycle.__class__ = _Cycle  # the same cycle, with an OpenAI-shaped 500 of its own
        if app is service_unavailable:
            app = _over_concurrency
        # the task copies the context as it is created: its request's writer is in it
        token = _WRITER.set(BodyWriter(cycle))
        try:
            super()._start_asgi_task(cycle, app)
        finally:
            _WRITER.reset(token)

    def data_received(self, data: bytes) -> None:
        if self._refused or self._lingering:
            return  # a refused or closing connection's bytes are dropped
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = self._header_count = 0
        self._arm()

    def on_url(self, url: bytes) -> None:
        self._count(len(url), 0)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value), 1)
        if not self._refused:
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm()
        if not self._refused:
            super().on_headers_complete()
            if self._cycle_transport is not None and self.cycle is not None:
                self.cycle.transport = self._cycle_transport  # type: ignore[assignment]

    def _count(self, size: int, headers: int) -> None:
        self._header_bytes += size
        self._header_count += headers
        if self._header_bytes > MAX_HEADER_BYTES or self._header_count > MAX_HEADERS:
            self._refuse(
                HeadersTooLarge(
                    f"The request line and headers pass the server's limits ({MAX_HEADERS} "
                    f"headers, {MAX_HEADER_BYTES} bytes in all)"
                )
            )

    def _arm(self) -> None:
        self._header_deadline.arm(self, self._on_slow)

    def _disarm(self) -> None:
        self._header_deadline.disarm(self)

    def _too_slow(self) -> None:
        if self.cycle is None or self.cycle.response_complete:  # no request in progress
            if input_waiting(self.transport):  # the loop stalled: the bytes are there, unread
                self._arm()
                return
            self._refuse(
                RequestTimeout(f"The request headers did not arrive within {HEADER_TIMEOUT_S:g} s")
            )

    def send_400_response(self, msg: str) -> None:
        """What the HTTP parser refused (uvicorn calls this with its own words)."""
        self._refuse(
            BadRequest(
                "Invalid HTTP request: the request line, a header or the chunked body encoding "
                "could not be parsed",
                code="invalid_http_request",
            )
        )

    def _refuse(self, exc: GatewayError) -> None:
        """Answer `exc` and end the connection with a lingering close (`close_softly`)."""
        if self._refused or self.transport.is_closing():
            return
        self._refused = True
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:  # its app hears the client left
            cycle.disconnected = True
            cycle.message_event.set()
            if cycle.response_started:  # half an answer went out: no other can follow
                self.close_softly()
                return
        self.transport.write(error_head(exc, self.server_state.default_headers))
        self.close_softly()
