"""What every discovery backend speaks: `Endpoint`, the `Discovery` protocol, its one error."""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("gateway.discovery")

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
"""`(host, port) -> addresses`; raises on failure (an `OSError` such as `socket.gaierror`)."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    url: str  # scheme://host:port
    name: str  # host:port ([v6]:port), unique within a pool's set


class DiscoveryError(Exception):
    """Discovery cannot work at all (no cluster and no api_url, no namespace); not retried."""


class Discovery(Protocol):
    def watch(self) -> AsyncGenerator[list[Endpoint], None]:
        """Yield the full current set, sorted by name, once known and then after each change.

        Runs until the consumer stops iterating (close it with `contextlib.aclosing`). A failed
        lookup never yields: the last set stands until a lookup succeeds again.
        """
        ...


def endpoint(scheme: str, host: str, port: int) -> Endpoint:
    """`Endpoint` for an address or host name; IPv6 addresses are bracketed in url and name."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        hostport = f"{host}:{port}"
    else:
        hostport = f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
    return Endpoint(f"{scheme}://{hostport}", hostport)


def settled(endpoints: Iterable[Endpoint]) -> list[Endpoint]:
    """One endpoint per name, sorted by name: the canonical form sets are compared in."""
    return sorted({e.name: e for e in endpoints}.values(), key=lambda e: e.name)


def warn_outage(what: str, why: str, last: list[Endpoint] | None) -> None:
    """The one warning of an outage (a backend logs it at its first failure, not at each)."""
    log.warning(
        "%s: %s; keeping the last %s endpoints", what, why, "no" if last is None else len(last)
    )


def describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
