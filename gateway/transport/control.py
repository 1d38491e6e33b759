"""The control plane's HTTP client: health probes, metric scrapes, parity checks, model lists.

They run on the request path's lean keep-alive client (`client.HttpClient`), one instance of
their own: a probe or a scrape costs ~40 µs of CPU on it, ~10x less than on httpx, and a gateway
in front of a hundred replicas makes ~150 of them a second. Nothing is taken from the environment
(no HTTP(S)_PROXY: a probe through a proxy would judge the proxy, not the replica). Redirects are
not followed: a replica's probe answers for itself. The Kubernetes API (HTTPS with the cluster's
CA, watch streams) is the one control-plane peer on httpx (`open_api_client`).

Every helper bounds its request as a whole: `timeout_s` covers connecting, sending, the headers
and the whole body together, and a body is read up to a size limit only. Failures the helpers
raise are `CONTROL_ERRORS`: refused or reset connections, timeouts, malformed HTTP,
`BodyTooLarge`. `get_json` and `post_json` turn all of them, a non-200 status and a body that is
not JSON into None.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from gateway.transport.client import HttpClient
from gateway.transport.errors import UpstreamClientError, UpstreamTooLargeError

__all__ = [
    "CONTROL_ERRORS",
    "MAX_BODY_BYTES",
    "BodyTooLarge",
    "ControlClient",
    "Reply",
    "fetch",
    "get_json",
    "open_api_client",
    "open_control_client",
    "post_json",
    "status_of",
]

MAX_BODY_BYTES = 16 * 1024 * 1024  # a /metrics page, a model list, a /tokenize answer: far less
MAX_DRAINED_BYTES = 64 * 1024  # of a health answer (only its status counts); past it, hang up

ControlClient = HttpClient


class BodyTooLarge(Exception):
    """The answer's body is larger than the limit the caller gave (the connection is closed)."""


CONTROL_ERRORS: tuple[type[BaseException], ...] = (
    UpstreamClientError,  # connect refused/reset, malformed HTTP, a body cut short
    httpx.HTTPError,  # the Kubernetes API client's
    OSError,
    TimeoutError,  # the whole-request bound
    BodyTooLarge,
    ValueError,  # a URL that is not http(s)
)


def open_control_client(connect_s: float) -> ControlClient:
    """The one client for a gateway's probes, scrapes and model lists (close it with `aclose`)."""
    return HttpClient(connect_s)


def open_api_client(connect_s: float, *, verify: ssl.SSLContext | None = None) -> httpx.AsyncClient:
    """An httpx client for the Kubernetes API (close it with `aclose`).

    `trust_env=False`: nothing from the environment (no proxy, no ~/.netrc, no SSL_CERT_FILE). TLS
    is checked against `verify`, else the system's trust store. No cap on connections: httpcore
    loses a pool slot for good when a request waiting for a connection is cancelled.
    """
    return httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=connect_s),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=16, keepalive_expiry=15.0),
        trust_env=False,
        verify=verify if verify is not None else ssl.create_default_context(),
        follow_redirects=True,
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


def _split(url: str) -> tuple[str, bytes]:
    parts = urlsplit(url)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return f"{parts.scheme}://{parts.netloc}", path.encode("latin-1")


def _charset(headers: list[tuple[bytes, bytes]]) -> str | None:
    for k, v in headers:
        if k == b"content-type":
            for param in v.decode("latin-1").split(";")[1:]:
                name, _, value = param.strip().partition("=")
                if name.lower() == "charset" and value:
                    return value.strip('"')
    return None


async def fetch(
    client: ControlClient,
    method: str,
    url: str,
    *,
    timeout_s: float,
    max_bytes: int = MAX_BODY_BYTES,
    json: Any = None,
) -> Reply:
    """One request and its whole body, within `timeout_s` in all; any status is returned.

    Raises one of CONTROL_ERRORS: BodyTooLarge past `max_bytes` body bytes.
    """
    origin, path = _split(url)
    headers = [(b"accept", b"*/*")]
    body = b""
    if json is not None:
        body = orjson.dumps(json)
        headers.append((b"content-type", b"application/json"))
    async with asyncio.timeout(timeout_s):
        resp = await client.request(
            origin, method.encode(), path, headers, body, total_timeout_s=timeout_s
        )
        try:
            data = await resp.read_all(max_bytes)
        except UpstreamTooLargeError:
            raise BodyTooLarge(f"{method} {url}: body larger than {max_bytes} bytes") from None
        except BaseException:
            resp.abort()
            raise
        resp.release()
        return Reply(resp.status, data, _charset(resp.headers))


async def status_of(client: ControlClient, url: str, *, timeout_s: float) -> int:
    """GET `url` for its status only, within `timeout_s` in all. The body is read and dropped (so
    the connection is reused), or, past MAX_DRAINED_BYTES, the connection is closed.
    Raises one of CONTROL_ERRORS."""
    origin, path = _split(url)
    async with asyncio.timeout(timeout_s):
        resp = await client.request(origin, b"GET", path, (), total_timeout_s=timeout_s)
        size = 0
        try:
            while chunk := await resp.read_chunk():
                size += len(chunk)
                if size > MAX_DRAINED_BYTES:
                    resp.abort()  # the status is all a probe reads; a huge body is not read
                    return resp.status
        except BaseException:
            resp.abort()
            raise
        resp.release()
        return resp.status


async def get_json(client: ControlClient, url: str, *, timeout_s: float) -> Any:
    """The JSON body of a 200 answer to GET `url`; None for any other status or any failure."""
    return await _json(client, "GET", url, None, timeout_s)


async def post_json(client: ControlClient, url: str, body: Any, *, timeout_s: float) -> Any:
    """The JSON body of a 200 answer to POSTing `body` as JSON; None otherwise."""
    return await _json(client, "POST", url, body, timeout_s)


async def _json(client: ControlClient, method: str, url: str, body: Any, timeout_s: float) -> Any:
    try:
        reply = await fetch(client, method, url, json=body, timeout_s=timeout_s)
        return orjson.loads(reply.body) if reply.status == 200 else None
    except CONTROL_ERRORS:  # orjson.JSONDecodeError is a ValueError
        return None


async def model_cards(
    client: ControlClient, url: str, *, timeout_s: float
) -> list[dict[str, Any]] | None:
    """A replica's `/v1/models` cards (the dicts with a string `id`, in its order); None when it
    did not answer with a list (down, an error, another shape)."""
    data = await get_json(client, url + "/v1/models", timeout_s=timeout_s)
    cards = data.get("data") if isinstance(data, dict) else None
    if not isinstance(cards, list):
        return None
    return [c for c in cards if isinstance(c, dict) and isinstance(c.get("id"), str)]
