"""Forward one request to a replica and relay the answer: failover before the first byte, never after.

Streamed events go to the client as they arrive, checked but uncopied; the upstream socket is closed
at once when the client goes away, so the engine aborts the request, and when the server's graceful
shutdown is about to run out (`LiveStreams`: the client gets an error event and a terminated body
instead of a cut connection). Non-streamed answers held at once are capped (`AnswerBudget`). The
client is gateway.http_client
(a lean keep-alive HTTP/1.1 client: aiohttp's cost dominated the gateway's CPU per request).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from .budgets import AnswerBudget, LiveStreams, shutting_down
from .config import TimeoutsConfig
from .errors import (
    ERROR_TYPES,
    GatewayError,
    UpstreamError,
    UpstreamTimeout,
    code_for_status,
    sse_error_event,
    type_for_status,
)
from .http_client import (
    HttpClient,
    UpstreamBrokenError,
    UpstreamConnectError,
    UpstreamResponse,
    UpstreamTooLargeError,
)
from .streams import StreamTap
from .types import Headers, Send

RETRYABLE_STATUS = frozenset({502, 503, 504})
MAX_RESPONSE_BYTES = 64 * 1024 * 1024  # a non-streamed answer larger than this is a broken replica
_PASS_HEADERS = frozenset({b"content-type", b"x-request-id", b"openai-processing-ms"})
SEND_SLICE = (
    256 * 1024
)  # a large whole answer goes to the client in slices, each after the last drained


class Retryable(Exception):
    """The replica failed before anything reached the client: try the next candidate."""

    def __init__(self, reason: str, status: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


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
        raise Retryable("timeout before the first byte") from None
    except UpstreamConnectError as exc:
        raise Retryable(f"connection failed ({exc})") from None
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
    send: Send,
    extra_headers: Headers,
    tap: StreamTap,
    after_first: Callable[[], Awaitable[None]] | None = None,
    live: LiveStreams | None = None,
) -> GatewayError | None:
    """Relay an SSE stream; returns the error that broke it mid-way (already told to the client).

    The client gets the replica's complete, valid events (through `tap`), then, if the stream
    broke, one error event of its own and nothing more: no `[DONE]`, so no client takes a broken
    stream for a finished one (the `openai` SDK raises APIError on the error event itself).
    A failure after `[DONE]` is no failure: the client had the whole stream.
    `after_first` runs once the first chunk is on its way to the client (off the TTFT path).
    A stream in `live` that a shutdown ends gets the `server_shutting_down` error event.
    """
    resp = opened.resp
    if live is not None:
        live.add(resp)
    try:
        return await _relay(opened, send, extra_headers, tap, after_first, live)
    finally:
        if live is not None:
            live.discard(resp)


async def _relay(
    opened: Opened,
    send: Send,
    extra_headers: Headers,
    tap: StreamTap,
    after_first: Callable[[], Awaitable[None]] | None,
    live: LiveStreams | None,
) -> GatewayError | None:
    resp = opened.resp
    await send(
        {
            "type": "http.response.start",
            "status": resp.status,
            "headers": response_headers(resp, extra_headers),
        }
    )
    out = tap.feed(opened.first)
    if out:
        await send({"type": "http.response.body", "body": out, "more_body": True})
    broke: GatewayError | None = None
    ended = False  # the replica's body came to its end
    try:
        if after_first is not None:
            await after_first()
        while tap.broken is None:
            chunk = await resp.read_chunk()
            if not chunk:
                ended = True
                break
            out = tap.feed(chunk)
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
    except asyncio.CancelledError:  # the client went away: hang up so the engine aborts
        resp.abort()
        raise
    except TimeoutError:
        if not tap.done:
            broke = UpstreamTimeout("The upstream replica stopped sending mid-stream (timeout)")
    except UpstreamBrokenError as exc:
        if not tap.done:
            if live is not None and live.closing:
                broke = shutting_down()
            else:
                broke = UpstreamError(f"The upstream replica failed mid-stream ({exc})")
    else:
        if tap.broken is not None:
            broke = UpstreamError(f"The upstream replica sent {tap.broken}")
        elif not tap.done:  # ended cleanly at the HTTP level, but not as an SSE stream ends
            broke = UpstreamError("The upstream replica ended the stream without [DONE]")
    tap.discard()  # an unfinished event is never relayed
    if ended:
        resp.release()
    else:
        resp.abort()
    tail = sse_error_event(broke) if broke is not None else b""
    await send({"type": "http.response.body", "body": tail, "more_body": False})
    return broke


async def send_whole(
    opened: Opened, send: Send, extra_headers: Headers, body: bytes | None = None
) -> None:
    resp = opened.resp
    resp.release()
    payload = opened.first if body is None else body
    headers = response_headers(resp, extra_headers)
    if body is not None:
        headers = [(k, v) for k, v in headers if k != b"content-type"]
        headers.append((b"content-type", b"application/json"))
    headers.append((b"content-length", str(len(payload)).encode()))
    await send({"type": "http.response.start", "status": resp.status, "headers": headers})
    # a large answer goes in slices: each send waits until the client has drained the last, so a
    # slow reader holds the answer here (charged) instead of a copy in the transport's buffer
    n = len(payload)
    start = 0
    while n - start > SEND_SLICE:
        end = start + SEND_SLICE
        await send({"type": "http.response.body", "body": payload[start:end], "more_body": True})
        start = end
    await send({"type": "http.response.body", "body": payload[start:] if start else payload,
                "more_body": False})  # fmt: skip


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


def normalize_error_body(status: int, body: bytes, expose: bool) -> tuple[bytes, str]:
    """A replica's error answer in the gateway's vocabulary: (the body to send, its error type).

    The nested OpenAI shape whatever the replica sent (vLLM's nested shape with its own `type`
    and an integer code, SGLang's flat one, plain text, HTML): `type` from ERROR_TYPES (the
    replica's when it is one, else its status's), a string `code`, the replica's `message`
    (unless there is none in a JSON body: then a generic one). `expose` false: addresses and URLs
    in the message are replaced by `<hidden>` and a `param` that is no field name is dropped.
    """
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        data = None
    err: dict[str, Any] | None = None
    if isinstance(data, dict):
        inner = data.get("error")
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            err = inner
        elif isinstance(data.get("message"), str):
            err = data
    if err is None:
        err = {}
    message = err.get("message") or f"The upstream replica answered {status}"
    param = err.get("param") if isinstance(err.get("param"), str) else None
    if not expose:
        message = hide_addresses(message)
        if param is not None and not _FIELD.fullmatch(param):
            param = None
    kind = err.get("type")
    if not (isinstance(kind, str) and kind in ERROR_TYPES):
        kind = type_for_status(status)
    code = err.get("code")
    if not (isinstance(code, str) and _CODE.fullmatch(code)):
        code = "model_not_found" if status == 404 and param == "model" else code_for_status(status)
    out = {
        "message": message,
        "type": kind,
        "param": param,
        "code": code,
    }
    return orjson.dumps({"error": out}), kind


_FIELD = re.compile(r"[A-Za-z_][\w.\[\]-]{0,63}")  # a request field's name (`messages[0].content`)
_CODE = re.compile(r"[a-z][a-z0-9_]{0,63}")
_ADDRESS = re.compile(
    r"[a-z][a-z0-9+.-]*://[^\s'\"<>]+"  # a URL
    r"|\[[0-9a-f:.]+\](?::\d+)?"  # [IPv6]:port
    r"|\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b"  # IPv4[:port]
    r"|\b(?:[0-9a-f]{1,4}:){7}[0-9a-f]{1,4}\b"  # IPv6, full
    r"|\b(?:[0-9a-f]{1,4}:){1,6}(?::[0-9a-f]{1,4}){1,6}\b|(?<![\w:])::1\b"  # IPv6, with ::
    r"|\b(?:localhost|[a-z0-9-]+(?:\.[a-z0-9-]+)+):\d{2,5}\b",  # host:port
    re.IGNORECASE,
)


def hide_addresses(text: str) -> str:
    """`text` with every URL, IP address and host:port replaced by `<hidden>`."""
    return _ADDRESS.sub("<hidden>", text) if ("." in text or ":" in text) else text
