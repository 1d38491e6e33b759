"""The control plane's HTTP client (httpx): health probes, metric scrapes, parity checks, models.

The request path has its own lean client (`http_client.py`). Everything else the gateway asks a
replica goes through one `httpx.AsyncClient` made by `open_control_client` (connections reused), and
through the helpers below, which bound each request as a whole: `timeout_s` covers connecting,
sending, the headers and the whole body together, and a body is read up to a size limit only.

Failures the helpers raise are `CONTROL_ERRORS`: refused or reset connections, timeouts, protocol
errors, `BodyTooLarge`. `get_json` and `post_json` turn all of them, a non-200 status and a body
that is not JSON into None.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

__all__ = [
    "CONTROL_ERRORS",
    "MAX_BODY_BYTES",
    "BodyTooLarge",
    "Reply",
    "fetch",
    "get_json",
    "open_control_client",
    "post_json",
    "status_of",
]

MAX_BODY_BYTES = 16 * 1024 * 1024  # a /metrics page, a model list, a /tokenize answer: far less
MAX_DRAINED_BYTES = 64 * 1024  # of a health answer (only its status counts); past it, hang up


class BodyTooLarge(Exception):
    """The answer's body is larger than the limit the caller gave (the connection is closed)."""


CONTROL_ERRORS: tuple[type[BaseException], ...] = (
    httpx.HTTPError,  # connect refused/reset, timeouts, malformed HTTP, too many redirects
    OSError,
    TimeoutError,  # the whole-request bound
    BodyTooLarge,
)


_NO_JSON: tuple[type[BaseException], ...] = (*CONTROL_ERRORS, orjson.JSONDecodeError)


def open_control_client(
    connect_s: float, *, verify: ssl.SSLContext | None = None
) -> httpx.AsyncClient:
    """The one client for a gateway's control plane (close it with `aclose`).

    `trust_env=False`: nothing is taken from the environment. A gateway must not send its replica
    probes through an HTTP(S)_PROXY/ALL_PROXY set for something else in its pod (the probes would
    judge the proxy, not the replica), nor pick up credentials from ~/.netrc or a CA bundle from
    SSL_CERT_FILE. TLS is checked against the system's trust store (`ssl.create_default_context`,
    as the request path's client does) unless `verify` is given.
    """
    return httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=connect_s),
        # No cap on connections: a few per replica at most (a probe, a scrape, a parity check or
        # model list), so the fleet bounds them. A cap would make requests wait for a free one,
        # and httpcore 1.0 loses a connection slot for good whenever a request waiting for one is
        # cancelled (our whole-request timeout): enough of those and every probe fails.
        limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=None, keepalive_expiry=15.0
        ),
        trust_env=False,
        verify=verify if verify is not None else ssl.create_default_context(),
        follow_redirects=True,  # as aiohttp did: a redirected probe is judged by the final answer
        max_redirects=10,
    )


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes
    charset: str | None  # from the Content-Type header

    def text(self) -> str:
        """The body decoded strictly (UnicodeDecodeError, or LookupError for an unknown charset)."""
        return self.body.decode(self.charset or "utf-8")


async def fetch(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    timeout_s: float,
    max_bytes: int = MAX_BODY_BYTES,
    json: Any = None,
) -> Reply:
    """One request and its whole body, within `timeout_s` in all; any status is returned.

    Raises one of CONTROL_ERRORS: BodyTooLarge past `max_bytes` (decoded) body bytes.
    """
    async with asyncio.timeout(timeout_s):
        async with client.stream(method, url, json=json, timeout=timeout_s) as resp:
            parts: list[bytes] = []
            size = 0
            async for chunk in resp.aiter_bytes():
                size += len(chunk)
                if size > max_bytes:
                    raise BodyTooLarge(f"{method} {url}: body larger than {max_bytes} bytes")
                parts.append(chunk)
            return Reply(resp.status_code, b"".join(parts), resp.charset_encoding)


async def status_of(client: httpx.AsyncClient, url: str, *, timeout_s: float) -> int:
    """GET `url` for its status only, within `timeout_s` in all. The body is read and dropped
    (so the connection is reused), or, past MAX_DRAINED_BYTES, the connection is closed.
    Raises one of CONTROL_ERRORS."""
    async with asyncio.timeout(timeout_s):
        async with client.stream("GET", url, timeout=timeout_s) as resp:
            size = 0
            async for chunk in resp.aiter_raw():
                size += len(chunk)
                if size > MAX_DRAINED_BYTES:
                    break  # leaving the block unread closes the connection
            return resp.status_code


async def get_json(client: httpx.AsyncClient, url: str, *, timeout_s: float) -> Any:
    """The JSON body of a 200 answer to GET `url`; None for any other status or any failure."""
    return await _json(client, "GET", url, None, timeout_s)


async def post_json(client: httpx.AsyncClient, url: str, body: Any, *, timeout_s: float) -> Any:
    """The JSON body of a 200 answer to POSTing `body` as JSON; None otherwise."""
    return await _json(client, "POST", url, body, timeout_s)


async def _json(
    client: httpx.AsyncClient, method: str, url: str, body: Any, timeout_s: float
) -> Any:
    try:
        reply = await fetch(client, method, url, json=body, timeout_s=timeout_s)
        return orjson.loads(reply.body) if reply.status == 200 else None
    except _NO_JSON:
        return None
