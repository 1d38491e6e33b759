"""What the gateway holds at once, each against one cap: request bodies, non-streamed answers,
and the streams a graceful shutdown must end in time.

The caps are read per request (from the request's snapshot), so a reload applies at once.
"""

from __future__ import annotations

import asyncio

from gateway.errors import ServerBusy
from gateway.transport.client import UpstreamResponse

BUSY_RETRY_S = 1.0  # Retry-After of a 503 for full request slots or body bytes
ANSWER_RETRY_S = 1.0  # Retry-After of the 503 for a full answer budget
SHUTDOWN_MARGIN_S = (
    1.0  # streams are ended this long (at most a quarter of the grace) before it ends
)


class ByteBudget:
    """Bytes held right now, all requests together, against one cap (None: no cap). A take
    past the cap raises a 503 (`code`; the message says it is `what` the gateway holds)."""

    __slots__ = ("held", "peak")
    what = "bytes"
    code = "bytes_in_flight"
    retry_after_s = BUSY_RETRY_S

    def __init__(self) -> None:
        self.held = 0
        self.peak = 0  # the most ever held at once (tests, debugging)

    def check(self, n: int, cap: int | None) -> None:
        """503 unless `n` more bytes fit under `cap` now."""
        if cap is not None and self.held + n > cap:
            raise ServerBusy(
                f"The gateway holds its limit of {cap} bytes of {self.what}; retry shortly",
                code=self.code,
                retry_after=self.retry_after_s,
            )

    def take(self, n: int, cap: int | None) -> None:
        self.check(n, cap)
        self.held += n
        if self.held > self.peak:
            self.peak = self.held

    def release(self, n: int) -> None:
        self.held -= n


class BodyBudget(ByteBudget):
    """Bytes of request bodies held right now, all requests together, against one cap
    (`server.max_body_bytes_in_flight`, read per request so a reload applies at once).

    A body's bytes are charged as they arrive and stay charged until its request ends (the
    pipeline keeps the body for retries); `release` gives them back.
    """

    __slots__ = ()
    what = "request bodies"
    code = "body_bytes_in_flight"


class AnswerBudget(ByteBudget):
    """Bytes of non-streamed answers held right now, all requests together, against one cap
    (`server.max_answer_bytes_in_flight`, read per request so a reload applies at once).

    An answer with a Content-Length is charged whole before its body is read; a chunked one as its
    bytes arrive. Past the cap the request gets a 503 and the replica's connection is closed. The
    bytes stay charged until the answer has been handed to the client (`release`).
    """

    __slots__ = ()
    what = "answers"
    code = "answer_bytes_in_flight"
    retry_after_s = ANSWER_RETRY_S


class LiveStreams:
    """The upstream responses of the streams being relayed now, so that a shutdown can end them.

    `close_in(s)` (the server's graceful shutdown began, s seconds to run) arranges for every live
    stream, and any starting later, to be ended at the grace's end less a margin: its upstream
    connection is closed (the engine aborts) and the client gets the complete events so far, one
    `server_shutting_down` error event and the end of the body, before the server cancels tasks.
    """

    __slots__ = ("live", "closing", "_timer")

    def __init__(self) -> None:
        self.live: set[UpstreamResponse] = set()
        self.closing = False
        self._timer: asyncio.TimerHandle | None = None

    def close_in(self, grace_s: float) -> None:
        if self.closing or self._timer is not None:
            return
        delay = max(0.0, grace_s - min(SHUTDOWN_MARGIN_S, grace_s / 4))
        self._timer = asyncio.get_running_loop().call_later(delay, self.close_all)

    def close_all(self) -> None:
        self._timer = None
        self.closing = True
        for resp in list(self.live):
            resp.abort()  # wakes the relay with UpstreamBrokenError

    def add(self, resp: UpstreamResponse) -> None:
        self.live.add(resp)
        if self.closing:
            resp.abort()

    def discard(self, resp: UpstreamResponse) -> None:
        self.live.discard(resp)


def shutting_down() -> ServerBusy:
    return ServerBusy("The gateway is shutting down; retry on another instance", code="server_shutting_down",
                      retry_after=ANSWER_RETRY_S)  # fmt: skip
