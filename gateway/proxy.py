"""Forward one request to a replica and relay the answer: failover before the first byte, never after.

Streamed bytes go to the client as they arrive, unparsed and uncopied; the upstream socket is closed
at once when the client goes away, so the engine aborts the request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from .config import TimeoutsConfig
from .errors import GatewayError, UpstreamError, UpstreamTimeout, sse_error_event
from .streams import StreamTap

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

RETRYABLE_STATUS = frozenset({502, 503, 504})
_PASS_HEADERS = frozenset({b"content-type", b"x-request-id", b"openai-processing-ms"})


class Retryable(Exception):
    """The replica failed before anything reached the client: try the next candidate."""

    def __init__(self, reason: str, status: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


@dataclass(slots=True)
class Opened:
    resp: aiohttp.ClientResponse
    first: bytes  # the first body bytes (whole body when not streaming)
    ttfb_s: float  # request sent -> first body bytes


def make_session(connect_s: float, limit: int = 0) -> aiohttp.ClientSession:
    """One pooled keep-alive client for every replica (TCP_NODELAY is aiohttp's default)."""
    connector = aiohttp.TCPConnector(
        limit=limit, limit_per_host=0, keepalive_timeout=30, ttl_dns_cache=10
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, connect=connect_s),
        auto_decompress=False,
        skip_auto_headers=("User-Agent",),
    )


async def open_upstream(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: dict[str, str],
    timeouts: TimeoutsConfig,
    stream: bool,
) -> Opened:
    """Send the request and wait for its first body bytes (all of them when not streaming).

    Raises Retryable for everything that may be retried elsewhere: connect errors, a timeout
    before the first byte, 502/503/504, or a connection that ended before any byte.
    """
    t0 = time.perf_counter()
    resp: aiohttp.ClientResponse | None = None
    try:
        async with asyncio.timeout(timeouts.first_byte_s if stream else timeouts.total_s):
            resp = await session.post(
                url,
                data=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(
                    total=timeouts.total_s, connect=timeouts.connect_s, sock_read=timeouts.idle_s
                ),
            )
            if resp.status in RETRYABLE_STATUS:
                await _drain_quietly(resp)
                raise Retryable(f"upstream status {resp.status}", resp.status)
            if stream and resp.status == 200:
                first = await resp.content.readany()
                if not first:
                    raise Retryable("upstream closed before the first byte")
            else:
                first = await resp.read()
    except Retryable:
        if resp is not None:
            resp.close()
        raise
    except TimeoutError:
        if resp is not None:
            resp.close()
        raise Retryable("timeout before the first byte") from None
    except (aiohttp.ClientError, OSError) as exc:
        if resp is not None:
            resp.close()
        raise Retryable(f"connection failed ({type(exc).__name__})") from None
    except BaseException:  # cancelled (client gone): hang up so the engine aborts the request
        if resp is not None:
            resp.close()
        raise
    return Opened(resp, first, time.perf_counter() - t0)


async def _drain_quietly(resp: aiohttp.ClientResponse) -> None:
    try:
        async with asyncio.timeout(1.0):
            await resp.read()
    except (aiohttp.ClientError, OSError, TimeoutError):
        pass


def response_headers(
    resp: aiohttp.ClientResponse, extra: list[tuple[bytes, bytes]]
) -> list[tuple[bytes, bytes]]:
    out = [(k.lower(), v) for k, v in resp.raw_headers if k.lower() in _PASS_HEADERS]
    out.extend(extra)
    return out


async def relay_stream(
    opened: Opened, send: Send, extra_headers: list[tuple[bytes, bytes]], tap: StreamTap
) -> GatewayError | None:
    """Relay an SSE stream; returns the error that broke it mid-way (already told to the client)."""
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
    content = resp.content
    try:
        while True:
            chunk = await content.readany()
            if not chunk:
                break
            out = tap.feed(chunk)
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
    except asyncio.CancelledError:  # the client went away: hang up so the engine aborts
        resp.close()
        raise
    except TimeoutError:
        broke = UpstreamTimeout("The upstream replica stopped sending mid-stream (idle timeout)")
    except (aiohttp.ClientError, OSError) as exc:
        broke = UpstreamError(f"The upstream replica failed mid-stream ({type(exc).__name__})")
    rest = tap.flush()
    if broke is not None:
        resp.close()
        await send(
            {
                "type": "http.response.body",
                "body": rest + sse_error_event(broke),
                "more_body": False,
            }
        )
    else:
        resp.release()
        await send({"type": "http.response.body", "body": rest, "more_body": False})
    return broke


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


async def send_whole(
    opened: Opened, send: Send, extra_headers: list[tuple[bytes, bytes]], body: bytes | None = None
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
    await send({"type": "http.response.body", "body": payload, "more_body": False})


def normalize_error_body(status: int, body: bytes, expose: bool) -> bytes:
    """Upstream error bodies in the nested OpenAI shape (SGLang's flat shape, plain text, HTML...)."""
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
    if err is not None:
        message = err["message"] if expose else f"The upstream replica answered {status}"
        out = {
            "message": message,
            "type": err.get("type") if isinstance(err.get("type"), str) else "upstream_error",
            "param": err.get("param") if isinstance(err.get("param"), str) else None,
            "code": err.get("code") if isinstance(err.get("code"), str | int) else status,
        }
    else:
        out = {
            "message": f"The upstream replica answered {status}",
            "type": "upstream_error",
            "param": None,
            "code": status,
        }
    return orjson.dumps({"error": out})
