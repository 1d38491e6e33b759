"""A fixed list of replicas (`{kind: static, endpoints: [...]}`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterable

from gateway.fleet.discovery.base import Endpoint, settled


class StaticDiscovery:
    def __init__(self, endpoints: Iterable[Endpoint]) -> None:
        self.endpoints = settled(endpoints)

    async def watch(self) -> AsyncGenerator[list[Endpoint], None]:
        yield list(self.endpoints)
        await asyncio.Event().wait()  # a fixed list never changes; wait to be closed
