"""The errors of the request path's HTTP client (`http_client.py`); timeouts are TimeoutError."""

from __future__ import annotations

__all__ = [
    "UpstreamBrokenError",
    "UpstreamClientError",
    "UpstreamConnectError",
    "UpstreamProtocolError",
    "UpstreamTooLargeError",
]


class UpstreamClientError(Exception):
    """Base of this client's errors (timeouts are the built-in TimeoutError).

    UpstreamClientError
    ├── UpstreamConnectError     nothing of the response arrived: safe to try another replica
    │   └── UpstreamProtocolError    the bytes before the headers' end were not HTTP
    └── UpstreamBrokenError      the response started, then the connection or its framing broke
        └── UpstreamTooLargeError    read_all: the body is larger than the caller's limit
    """


class UpstreamConnectError(UpstreamClientError):
    """Connect refused or timed out, or the connection ended before the response headers."""


class UpstreamProtocolError(UpstreamConnectError):
    """The upstream sent something that is not an HTTP/1.x status line and headers."""


class UpstreamBrokenError(UpstreamClientError):
    """The body was cut short: connection closed or reset, or malformed framing."""


class UpstreamTooLargeError(UpstreamBrokenError):
    """The body exceeded the limit given to read_all (the connection is closed)."""
