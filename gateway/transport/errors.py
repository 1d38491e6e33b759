"""What can go wrong upstream: the errors of the request path's HTTP client
(`gateway/transport/client.py`; timeouts are TimeoutError), and a replica's error answers in the
gateway's vocabulary, with addresses hidden from their messages."""

from __future__ import annotations

import re
from typing import Any

import orjson

from gateway.errors import ERROR_TYPES, code_for_status, type_for_status


class UpstreamClientError(Exception):
    """Base of this client's errors (timeouts are the built-in TimeoutError).

    UpstreamClientError
    ├── UpstreamConnectError     nothing of the response arrived: safe to try another replica
    │   ├── UpstreamConnectTimeout   the connect did not complete in time (busy, or out of reach)
    │   └── UpstreamProtocolError    the bytes before the headers' end were not HTTP
    └── UpstreamBrokenError      the response started, then the connection or its framing broke
        └── UpstreamTooLargeError    read_all: the body is larger than the caller's limit
    """


class UpstreamConnectError(UpstreamClientError):
    """Connect refused or timed out, or the connection ended before the response headers."""


class UpstreamConnectTimeout(UpstreamConnectError):
    """The connect did not complete within the connect timeout: a replica too busy to accept
    (its accept queue full, its process starved of CPU), or one out of reach. Unlike a refused
    or reset connection it is no proof that the replica is down."""


class UpstreamProtocolError(UpstreamConnectError):
    """The upstream sent something that is not an HTTP/1.x status line and headers."""


class UpstreamBrokenError(UpstreamClientError):
    """The body was cut short: connection closed or reset, or malformed framing."""


class UpstreamTooLargeError(UpstreamBrokenError):
    """The body exceeded the limit given to read_all (the connection is closed)."""


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
