"""Many replicas in the current event loop, each on its own port; kill and restart one. Or the
same fleet in a child process (`simulated_fleet`: `python -m simulator`, as `gateway demo` runs it).

`async with Fleet(n=4, model="qwen2.5-14b", gpu="a100-80g", speedup=100.0) as fleet: ...`
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from types import TracebackType
from typing import Any

from simulator.config import (
    DEFAULT_KV_EVENTS_BUFFER,
    EngineConfig,
    KvEventsEncoding,
    KvEventsOptions,
    build_config,
)
from simulator.pd import PdOptions
from simulator.profiles import GpuProfile, ModelProfile
from simulator.replica import Replica
from simulator.tiers import SHARED_GBPS, SharedStore, StoreOutbox, attach_shared, shared_store
from simulator.tokenizer import Tokenizer, TokenizerJson


class Fleet:
    """`n` identical replicas. Replica i gets seed `seed + i`, and port `base_port + i`
    (ephemeral when `base_port` is None or 0). A restarted replica keeps its port and starts
    empty: cold cache, zeroed stats, no fault.

    `tokenizer`: a path to a local tokenizer.json (or a Tokenizer) shared by all replicas.
    `kv_events_port`: publish KV events; replica i on `port + 2i`, replay on `port + 2i + 1`
    (0: ephemeral ports, kept across a restart). A restarted replica's sequence starts at 0.
    `shared_kv_gb`: one KV store of that size shared by all replicas (simulator/tiers.py,
    LMCache / Mooncake style), loaded at `shared_kv_gbps` GB/s; it outlives a replica's
    restart. With KV events, each replica publishes the store's `EXTERNAL` events about the
    blocks it wrote first (their removal too).
    """

    def __init__(self, n: int = 4, model: str | ModelProfile = "qwen2.5-14b",
                 gpu: str | GpuProfile = "a100-80g", speedup: float = 100.0, seed: int = 0, *,
                 base_port: int | None = None, host: str = "127.0.0.1",
                 served_model_name: str | None = None,
                 tokenizer: str | os.PathLike[str] | Tokenizer | None = None,
                 kv_events_port: int | None = None,
                 kv_events_encoding: KvEventsEncoding = "map",
                 kv_events_buffer_steps: int = DEFAULT_KV_EVENTS_BUFFER,
                 pd: PdOptions | None = None, shared_kv_gb: float | None = None,
                 shared_kv_gbps: float = SHARED_GBPS, **engine_overrides: Any) -> None:
        if n < 1:
            raise ValueError("a fleet needs at least one replica")
        self.n = n
        self.tokenizer: Tokenizer | None = (
            TokenizerJson(tokenizer) if isinstance(tokenizer, str | os.PathLike) else tokenizer)
        self.kv_events: list[KvEventsOptions] | None = None
        if kv_events_port is not None:
            if kv_events_port and not 0 < kv_events_port + 2 * n <= 65536:
                raise ValueError(f"kv events ports {kv_events_port}.. do not fit {n} replicas")
            self.kv_events = [
                KvEventsOptions(kv_events_port + 2 * i if kv_events_port else 0,
                                kv_events_port + 2 * i + 1 if kv_events_port else 0,
                                kv_events_encoding, buffer_steps=kv_events_buffer_steps)
                for i in range(n)
            ]
        self.config: EngineConfig = build_config(model, gpu, **engine_overrides)
        self.shared: SharedStore | None = None
        self._outboxes: list[StoreOutbox] | None = None
        if shared_kv_gb:
            if shared_kv_gb < 0 or shared_kv_gbps <= 0:
                raise ValueError("shared_kv_gb must be >= 0 and shared_kv_gbps > 0")
            self.shared = shared_store(
                shared_kv_gb, bytes_per_token=self.config.perf.kv_bytes_per_token,
                block_size=self.config.block_size, gbps=shared_kv_gbps)
            if self.kv_events is not None:  # one per replica slot: a restart keeps its blocks'
                self._outboxes = [StoreOutbox() for _ in range(n)]
        self.speedup = speedup
        self.seed = seed
        self.base_port = base_port
        self.host = host
        self.served_model_name = served_model_name
        self.replicas: list[Replica] = []
        self.pd = pd  # P/D role; replica i's side channel on pd.side_channel_port + i (0: any)

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    @property
    def kv_event_endpoints(self) -> list[tuple[str, str]]:
        """(PUB endpoint, replay endpoint) per replica; empty without KV events."""
        return [(p.endpoint, p.replay_endpoint) for r in self.replicas
                if (p := r.kv_events) is not None]

    def _replica(self, i: int, port: int) -> Replica:
        replica = Replica(self.config, seed=self.seed + i, speedup=self.speedup,
                          served_model_name=self.served_model_name, host=self.host, port=port,
                          tokenizer=self.tokenizer,
                          kv_events=self.kv_events[i] if self.kv_events else None,
                          pd=self._pd(i))
        if self.shared is not None:
            boxes = self._outboxes
            attach_shared([replica.engine], self.shared, None if boxes is None else [boxes[i]])
        return replica

    def _pd(self, i: int) -> PdOptions | None:
        pd = self.pd
        if pd is None or not pd.side_channel_port:
            return pd
        return replace(pd, side_channel_port=pd.side_channel_port + i)

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
        if self.kv_events is not None and old.kv_events_options is not None:
            self.kv_events[i] = old.kv_events_options  # the ports it bound
        self.replicas[i] = self._replica(i, old.port)
        await self.replicas[i].start()


@contextlib.asynccontextmanager
async def simulated_fleet(n: int, *sim_args: str, port: int = 0) -> AsyncIterator[list[str]]:
    """`python -m simulator --replicas n --port PORT *sim_args` in a subprocess (replica i on
    PORT + i; 0: ephemeral ports); yields its URLs."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "simulator", "--replicas", str(n), "--port", str(port), *sim_args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    urls: list[str] = []
    assert proc.stdout is not None
    try:
        while len(urls) < n:
            line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
            if not line:
                raise RuntimeError("the simulator exited before it was ready")
            urls += [w for w in line.split() if w.startswith("http://")]
        yield urls
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        await proc.wait()
