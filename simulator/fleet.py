"""Many replicas in the current event loop, each on its own port; kill and restart one.

`async with Fleet(n=4, model="qwen2.5-14b", gpu="a100-80g", speedup=100.0) as fleet: ...`
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any

from simulator.config import EngineConfig, build_config
from simulator.profiles import GpuProfile, ModelProfile
from simulator.replica import Replica


class Fleet:
    """`n` identical replicas. Replica i gets seed `seed + i`, and port `base_port + i`
    (ephemeral when `base_port` is None or 0). A restarted replica keeps its port and starts
    empty: cold cache, zeroed stats, no fault."""

    def __init__(self, n: int = 4, model: str | ModelProfile = "qwen2.5-14b",
                 gpu: str | GpuProfile = "a100-80g", speedup: float = 100.0, seed: int = 0, *,
                 base_port: int | None = None, host: str = "127.0.0.1",
                 served_model_name: str | None = None, **engine_overrides: Any) -> None:
        if n < 1:
            raise ValueError("a fleet needs at least one replica")
        self.n = n
        self.config: EngineConfig = build_config(model, gpu, **engine_overrides)
        self.speedup = speedup
        self.seed = seed
        self.base_port = base_port
        self.host = host
        self.served_model_name = served_model_name
        self.replicas: list[Replica] = []

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def _replica(self, i: int, port: int) -> Replica:
        return Replica(self.config, seed=self.seed + i, speedup=self.speedup,
                       served_model_name=self.served_model_name, host=self.host, port=port)

    async def __aenter__(self) -> Fleet:
        try:
            for i in range(self.n):
                port = self.base_port + i if self.base_port else 0
                replica = self._replica(i, port)
                self.replicas.append(replica)
                await replica.start()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await asyncio.gather(*(r.stop() for r in self.replicas))

    async def stop(self, i: int) -> None:
        """Kill replica i: connections reset, port closed, engine state lost."""
        await self.replicas[i].stop()

    async def start(self, i: int) -> None:
        """Start a fresh replica i on the port it had."""
        old = self.replicas[i]
        if old.running:
            await old.stop()
        self.replicas[i] = self._replica(i, old.port)
        await self.replicas[i].start()
