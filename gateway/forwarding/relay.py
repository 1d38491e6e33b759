"""Forward one request to a replica and relay the answer: failover before the first byte, never after.

Streamed events go to the client as they arrive, checked but uncopied; the upstream socket is closed
at once when the client goes away, so the engine aborts the request, and when the server's graceful
shutdown is about to run out (`LiveStreams`: the client gets an error event and a terminated body
instead of a cut connection). Under the gateway's server protocol a streamed chunk the client can
take at once goes from the upstream connection's callback straight to the client's socket
(`UpstreamResponse.pipe`, the `ResponseWriter`'s lane): no task wakes, no ASGI message per chunk;
under backpressure the writer falls back to awaiting `send`. Non-streamed answers held at once are
capped (`AnswerBudget`). The client is gateway/transport/client.py (a lean keep-alive HTTP/1.1 client:
aiohttp's cost dominated the gateway's CPU per request); error bodies: `errors.py`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from gateway.api.streams import StreamTap
from gateway.config import TimeoutsConfig
from gateway.errors import GatewayError, UpstreamError, UpstreamTimeout, sse_error_event
from gateway.limits.budgets import AnswerBudget, LiveStreams, shutting_down
from gateway.transport.client import (
    HttpClient,
    UpstreamBrokenError,
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamResponse,
    UpstreamTooLargeError,
)
from gateway.transport.errors import hide_addresses as hide_addresses
from gateway.transport.errors import normalize_error_body as normalize_error_body
from gateway.transport.writer import ResponseWriter
from gateway.types import Headers

RETRYABLE_STATUS = frozenset({502, 503, 504})
MAX_RESPONSE_BYTES = 64 * 1024 * 1024  # a non-streamed answer larger than this is a broken replica
_PASS_HEADERS = frozenset({b"content-type", b"x-request-id", b"openai-processing-ms"})


class Retryable(Exception):
    """The replica failed before anything reached the client: try the next candidate.

    `busy`: it timed out (the connect, or the first byte) rather than refused, reset or erred: a
    replica that is alive but slow looks so too (`ReplicaState.failed` tells the two apart)."""

    def __init__(self, reason: str, status: int | None = None, busy: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.busy = busy


def attempt_outcome(exc: Retryable) -> str:
    """A failed attempt's outcome label (gateway_upstream_attempts_total, the P/D legs')."""
    if exc.status is not None:
        return f"status_{exc.status}"
    if exc.reason.startswith("timeout"):
        return "timeout"
    return "connect_error" if exc.reason.startswith("connection") else "closed_early"


@dataclass(slots=True)
class Opened:
    resp: UpstreamResponse
    first: bytes  # the first body bytes (the whole body when not streaming)
    parsed: dict[str, Any] | None = None  # a non-streamed 200 answer, parsed once (usage)
    budget: AnswerBudget | None = None  # where the bytes of `first` are charged (non-streamed)
    charged: int = 0

    def free(self) -> None:
        """Give the answer's bytes back to the budget (once; again is a no-op)."""
        if self.budget is not None and self.charged:
            self.budget.release(self.charged)
            self.charged = 0

    @property
    def status(self) -> int:
        return self.resp.status


async def open_upstream(
    pool: HttpClient,
    origin: str,
    path: bytes,
    body: bytes,
    headers: Headers,
    timeouts: TimeoutsConfig,
    stream: bool,
    total_s: float,
    answers: AnswerBudget | None = None,
    answers_cap: int | None = None,
    *,
    method: bytes = b"POST",
    json_answer: bool = True,
) -> Opened:
    """Send the request and wait for its first body bytes (all of them when not streaming).

    A non-streamed 200 is parsed as a JSON object (`Opened.parsed`); with `json_answer` one that is
    not is a broken replica (retried), else it is relayed as it came (`parsed` None).

    Raises Retryable for everything that may be retried elsewhere: connect errors, a timeout
    before the first byte, 502/503/504, or a connection that broke before any byte; ServerBusy
    when a whole answer would not fit in `answers` under `answers_cap` (the caller `free()`s
    the returned answer's charge once it is sent).
    """
    resp: UpstreamResponse | None = None
    charged = 0
    try:
        resp = await pool.request(
            origin,
            method,
            path,
            headers,
            body,
            first_byte_timeout_s=min(timeouts.first_byte_s, total_s) if stream else total_s,
            idle_timeout_s=timeouts.idle_s,
            total_timeout_s=total_s,
        )
        if resp.status in RETRYABLE_STATUS:
            resp.abort()
            raise Retryable(f"upstream status {resp.status}", resp.status)
        if stream and resp.status == 200:
            # engines send stream headers at once; the first chunk comes after the prefill
            async with asyncio.timeout(min(timeouts.first_byte_s, total_s)):
                first = await resp.read_chunk()
            if not first:
                raise Retryable("upstream closed before the first byte")
        else:
            if answers is None:
                first = await resp.read_all(MAX_RESPONSE_BYTES)
            else:
                first, charged = await _read_charged(resp, answers, answers_cap)
            if resp.status == 200:
                parsed = _json_object(first)
                if parsed is None and json_answer:
                    raise Retryable("the replica's answer is not a JSON object")
                return Opened(resp, first, parsed, answers, charged)
            return Opened(resp, first, None, answers, charged)
    except Retryable:
        if charged and answers is not None:
            answers.release(charged)
        raise
    except TimeoutError:
        if resp is not None:
            resp.abort()
        raise Retryable("timeout before the first byte", busy=True) from None
    except UpstreamConnectError as exc:
        busy = isinstance(exc, UpstreamConnectTimeout)
        raise Retryable(f"connection failed ({exc})", busy=busy) from None
    except UpstreamBrokenError as exc:
        if resp is not None:
            resp.abort()
        raise Retryable(f"closed before the first byte ({exc})") from None
    except BaseException:  # cancelled (client gone): hang up so the engine aborts the request
        if resp is not None:
            resp.abort()
        if charged and answers is not None:
            answers.release(charged)
        raise
    return Opened(resp, first)


async def _read_charged(
    resp: UpstreamResponse, answers: AnswerBudget, cap: int | None
) -> tuple[bytes, int]:
    """The whole body, its bytes charged to `answers`: (body, bytes charged). On any failure the
    charge is given back and the connection closed; ServerBusy when it does not fit."""
    declared = _content_length(resp)
    charged = 0
    try:
        if declared is not None and declared <= MAX_RESPONSE_BYTES:
            answers.take(declared, cap)  # before reading: no bytes are spent on a refused answer
            charged = declared
            return await resp.read_all(MAX_RESPONSE_BYTES), charged
        parts: list[bytes] = []
        size = 0
        while chunk := await resp.read_chunk():
            size += len(chunk)
            if size > MAX_RESPONSE_BYTES:
                raise UpstreamTooLargeError(f"upstream body larger than {MAX_RESPONSE_BYTES} bytes")
            answers.take(len(chunk), cap)
            charged += len(chunk)
            parts.append(chunk)
        return (parts[0] if len(parts) == 1 else b"".join(parts)), charged
    except BaseException:
        resp.abort()
        answers.release(charged)
        raise


def _content_length(resp: UpstreamResponse) -> int | None:
    for k, v in resp.headers:
        if k == b"content-length":
            try:
                return int(v)
            except ValueError:
                return None
    return None


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def response_headers(resp: UpstreamResponse, extra: Headers) -> Headers:
    """The replica's headers worth passing on, less any the gateway sets itself (x-request-id)."""
    own = {k for k, _ in extra}
    out = [(k, v) for k, v in resp.headers if k in _PASS_HEADERS and k not in own]
    out.extend(extra)
    return out


async def relay_stream(
    opened: Opened,
    writer: ResponseWriter,
    extra_headers: Headers,
    tap: StreamTap,
    after_first: Callable[[], Awaitable[None]] | None = None,
    live: LiveStreams | None = None,
    keep_open: bool = False,
) -> GatewayError | None:
    """Relay an SSE stream; returns the error that broke it mid-way (already told to the client,
    unless `keep_open`: then the client's stream is left open for a resume to go on with).

    The client gets the replica's complete, valid events (through `tap`), then, if the stream
    broke, one error event of its own and nothing more: no `[DONE]`, so no client takes a broken
    stream for a finished one (the `openai` SDK raises APIError on the error event itself).
    A failure after `[DONE]` is no failure: the client had the whole stream.
    `after_first` runs once the first chunk is on its way to the client (off the TTFT path).
    A stream in `live` that a shutdown ends gets the `server_shutting_down` error event.
    """
    resp = opened.resp
    headers = response_headers(resp, extra_headers)
    # what can go at once goes straight to the client's socket (a chunk per read: whatever
    # arrived since the last one, never waited for), the head with the first; else, or under
    # backpressure, through `send` (the writer decides)
    await writer.begin(resp.status, headers, tap.feed(opened.first))
    if after_first is not None:
        try:
            await after_first()
        except asyncio.CancelledError:  # the client went away: hang up so the engine aborts
            resp.abort()
            raise
    broke = await read_stream(resp, tap, writer.write, live=live, direct=writer)
    if broke is not None and keep_open:
        return broke
    await writer.end(sse_error_event(broke) if broke is not None else b"")
    return broke


class Tap(Protocol):
    """What reads a stream's events as they come (`StreamTap`, a resume's `Reshaper`): `feed`
    returns what goes on (b"": nothing now); `broken` says why the stream is unusable from
    there on, `done` that its end (`[DONE]`) went by."""

    @property
    def broken(self) -> str | None: ...

    @property
    def done(self) -> bool: ...

    def feed(self, chunk: bytes) -> bytes: ...

    def discard(self) -> bool: ...


async def read_stream(
    resp: UpstreamResponse,
    tap: Tap,
    write: Callable[[bytes], Awaitable[None]] | None,
    first: bytes = b"",
    *,
    live: LiveStreams | None = None,
    direct: ResponseWriter | None = None,
    what: str = "stream",
) -> GatewayError | None:
    """Read an upstream SSE body to its end through `tap` (`first`: its bytes already read),
    `write` each chunk's output; the error that broke it mid-way (None: it ended properly).

    The one reader of an upstream stream (the relay's, a whole answer's, a resume's): the idle
    and total deadlines fire in `resp`'s reads (TimeoutError), a broken upstream is told from a
    shutdown (`live` closing) and from a stream that ended without `[DONE]` or sent an unusable
    event, and `resp` is released at the end, or closed (the engine aborts) when it did not
    end; a cancelled read closes it too. After `[DONE]` the body is read to its end (the
    connection goes back to the pool), and a failure there is none. `direct`: the writer whose
    lane takes what it can at once from the upstream's own callback (`UpstreamResponse.pipe`),
    no task woken per chunk; the rest goes through `write`.
    """
    if live is not None:
        live.add(resp)
    broke: GatewayError | None = None
    ended = False  # the replica's body came to its end
    try:
        if first:
            out = tap.feed(first)
            if out and write is not None:
                await write(out)
        held: list[BaseException | bytes] = []
        sink = _sink(tap, direct, held) if direct is not None and direct.lane is not None else None
        while tap.broken is None:
            if sink is not None and not tap.done:
                # the chunks the client can take at once are relayed from the upstream's own
                # callback; pipe returns when one cannot (backpressure), at the end, or on error
                await resp.pipe(sink)
                if held:
                    stuck = held.pop()
                    if isinstance(stuck, BaseException):
                        raise stuck
                    if write is not None:
                        await write(stuck)
            chunk = await resp.read_chunk()
            if not chunk:
                ended = True
                break
            out = tap.feed(chunk)
            if out and write is not None:
                await write(out)
    except asyncio.CancelledError:  # the client went away: hang up so the engine aborts
        resp.abort()
        raise
    except TimeoutError:
        if not tap.done:
            broke = UpstreamTimeout(f"The upstream replica stopped sending mid-{what} (timeout)")
    except UpstreamBrokenError as exc:
        if not tap.done:
            if live is not None and live.closing:
                broke = shutting_down()
            else:
                broke = UpstreamError(f"The upstream replica failed mid-{what} ({exc})")
    else:
        if tap.broken is not None:
            broke = UpstreamError(f"The upstream replica sent {tap.broken}")
        elif not tap.done:  # ended cleanly at the HTTP level, but not as an SSE stream ends
            broke = UpstreamError(f"The upstream replica ended the {what} without [DONE]")
    finally:
        if live is not None:
            live.discard(resp)
    tap.discard()  # an unfinished event is never relayed
    if ended:
        resp.release()
    else:
        resp.abort()
    return broke


def _sink(
    tap: Tap, writer: ResponseWriter, held: list[BaseException | bytes]
) -> Callable[[bytes], bool]:
    """What `pipe` hands the body bytes to: through the tap, written to the client at once; False
    (stop piping) when they cannot go now (then in `held`, for `send`), at `[DONE]` or a broken
    event. Never raises: an exception goes to `held`, for the relay to raise."""

    def sink(data: bytes) -> bool:
        try:
            out = tap.feed(data)
            if out and not writer.write_now(out):
                held.append(out)
                return False
        except Exception as exc:  # noqa: BLE001 - raised in the relay's task instead
            held.append(exc)
            return False
        return tap.broken is None and not tap.done

    return sink


async def send_whole(
    opened: Opened, writer: ResponseWriter, extra_headers: Headers, body: bytes | None = None
) -> None:
    """The replica's whole answer (or `body` in its place: a JSON error of the gateway's)."""
    resp = opened.resp
    resp.release()
    payload = opened.first if body is None else body
    headers = response_headers(resp, extra_headers)
    if body is not None:
        headers = [(k, v) for k, v in headers if k != b"content-type"]
        headers.append((b"content-type", b"application/json"))
    await writer.whole(resp.status, headers, payload)


def with_stream_usage(raw: bytes, body: dict[str, Any]) -> bytes:
    """The body asking the replica for a final usage chunk (spliced in, not re-encoded, when absent)."""
    if "stream_options" not in body:
        end = raw.rstrip()
        if end.endswith(b"}"):
            head = end[:-1].rstrip()
            sep = b"" if head.endswith(b"{") else b","
            return head + sep + b'"stream_options":{"include_usage":true}}'
    opts = body.get("stream_options") or {}
    return orjson.dumps({**body, "stream_options": {**opts, "include_usage": True}})
