"""HTTP semantic-convention attributes of a request's trace (the stable HTTP span conventions).

The root (SERVER) span gets server.address / server.port from the Host header and
user_agent.original; each upstream attempt becomes an `upstream.attempt` CLIENT span with the
replica, server.address / server.port, url.full (no credentials), the method, the status, the
resend count and error.type. It all runs when the spans are built, off the event loop for OTLP.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from gateway.telemetry.trace import Attempt, Child

__all__ = ["ATTEMPT_ATTRIBUTES", "ATTEMPT_SPAN", "attempt_spans", "http_server"]

ATTEMPT_SPAN = "upstream.attempt"
# keyword → attribute name on each upstream.attempt span (HTTP client span conventions)
ATTEMPT_ATTRIBUTES: dict[str, str] = {
    "replica": "gateway.replica",
    "method": "http.request.method",
    "server_address": "server.address",
    "server_port": "server.port",
    "url_full": "url.full",
    "status_code": "http.response.status_code",
    "resend_count": "http.request.resend_count",
    "error_type": "error.type",
}
# the root's names this module reads or writes (trace_record.ATTRIBUTES holds them too)
_METHOD, _PATH, _OUTCOME = "http.request.method", "url.path", "gateway.outcome"
_ADDRESS, _PORT, _AGENT = "server.address", "server.port", "user_agent.original"
_CACHE_MAX = 4096  # attempt attribute sets and parsed hosts kept; cleared when full
_getrandbits = random.getrandbits


def attempt_spans(
    children: list[Child],
    attempts: Sequence[Attempt],
    root: Mapping[str, Any],
    offset: int,
    start: int,
    answered: int,
    end: int,
) -> None:
    """An `upstream.attempt` child per attempt, within the root; one still open at the end (the
    one that answered) ends with the last segment (`answered`), or the root when none came."""
    method = root.get(_METHOD, "POST")
    path = root.get(_PATH, "")
    outcome = root.get(_OUTCOME)
    aborted = outcome if outcome in ("broken_mid_stream", "client_disconnected") else None
    cache = _attempt_cache
    for i, (replica, url, t0, t1, status, failed) in enumerate(attempts):
        s = min(max(t0 + offset, start), end)
        e = min(max(t1 + offset if t1 else answered if answered > s else end, s), end)
        if failed is not None:  # the failover's outcome: status_503 -> "503", timeout, ...
            error: str | None = failed[7:] if failed.startswith("status_") else failed
        elif status >= 400:  # CLIENT span conventions: a 4xx is an error too
            error = str(status)
        else:
            error = aborted
        key = (replica, url, method, path, status, i, error)
        attrs = cache.get(key) or _attempt_attributes(key)
        children.append((ATTEMPT_SPAN, _getrandbits(64) or 1, s, e, attrs, error))


_attempt_cache: dict[tuple[Any, ...], Mapping[str, Any]] = {}


def _attempt_attributes(key: tuple[Any, ...]) -> Mapping[str, Any]:
    """One attempt's attributes, kept: attempts of the same shape share one read-only mapping."""
    replica, url, method, path, status, resend, error = key
    parts = urlsplit(url)
    a = ATTEMPT_ATTRIBUTES
    out: dict[str, Any] = {
        a["replica"]: replica,
        a["method"]: method,
        a["server_address"]: parts.hostname or "",
        a["server_port"]: parts.port or (443 if parts.scheme == "https" else 80),
        # no credentials in a span (semantic conventions: userinfo is never recorded)
        a["url_full"]: f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{path}",
    }
    if status:
        out[a["status_code"]] = status
    if resend:
        out[a["resend_count"]] = resend
    if error is not None:
        out[a["error_type"]] = error
    if len(_attempt_cache) >= _CACHE_MAX:
        _attempt_cache.clear()
    got = _attempt_cache[key] = MappingProxyType(out)
    return got


_host_cache: dict[bytes, tuple[str, int | None]] = {}


def http_server(values: dict[str, Any], host: bytes | None, agent: bytes | None) -> None:
    """server.address / server.port from the Host header, user_agent.original."""
    if host:
        got = _host_cache.get(host)
        if got is None:
            name, port = _split_host(host.decode("latin-1"))
            if len(_host_cache) >= _CACHE_MAX:
                _host_cache.clear()
            got = _host_cache[host] = (name, port)
        values[_ADDRESS] = got[0]
        if got[1] is not None:
            values[_PORT] = got[1]
    if agent:
        values[_AGENT] = agent.decode("latin-1")


def _split_host(host: str) -> tuple[str, int | None]:
    """`name[:port]` or `[v6][:port]` of a Host header; the port None when absent or bad."""
    if host.startswith("["):
        name, _, rest = host[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif host.count(":") == 1:
        name, _, port = host.partition(":")
    else:  # no port (or a bare IPv6 address)
        name, port = host, ""
    return name, int(port) if port.isdigit() and int(port) < 65536 else None
