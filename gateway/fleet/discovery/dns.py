"""Replicas behind a DNS name (`{kind: dns, name: ..., port: ...}`): one per address it has."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from gateway.fleet.discovery.base import (
    Endpoint,
    Resolver,
    describe,
    endpoint,
    log,
    settled,
    warn_outage,
)


async def getaddrinfo_resolver(host: str, port: int) -> list[str]:
    """A and AAAA answers through the system resolver (the loop's thread pool)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


@dataclass(eq=False)  # one watcher is one object
class DnsDiscovery:
    """Resolve `name` every `interval_s`; each address becomes `scheme://address:port`.

    Fits a headless Service or any name with one record per replica. A failed resolution keeps the
    last set and is logged once per outage.
    """

    name: str
    port: int
    scheme: str = "http"
    interval_s: float = 5.0
    resolver: Resolver = getaddrinfo_resolver
    timeout_s: float = 5.0

    async def watch(self) -> AsyncGenerator[list[Endpoint], None]:
        last: list[Endpoint] | None = None
        failing = False
        while True:
            try:
                async with asyncio.timeout(self.timeout_s):
                    addresses = await self.resolver(self.name, self.port)
            except Exception as exc:  # any resolver failure: keep serving the last set
                if not failing:
                    why = f"resolution failed ({describe(exc)})"
                    warn_outage(f"dns discovery {self.name}", why, last)
                    failing = True
            else:
                if failing:
                    log.info("dns discovery %s: resolving again", self.name)
                    failing = False
                current = settled(endpoint(self.scheme, a, self.port) for a in addresses)
                if current != last:
                    last = current
                    yield current
            await asyncio.sleep(self.interval_s)
