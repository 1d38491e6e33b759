"""Managed LoRA placement (`pools.<p>.lora.manage: true`, off by default; docs/lora.md).

Before a request for a managed adapter is routed, `offer` says which replicas may take it: those
that serve it, and, while it is on fewer replicas than its demand calls for, every other replica
that allows runtime updates. Demand: its requests in flight in the pool (this one included) per
`requests_per_replica`, at least one replica and at most `max_replicas_per_adapter`; one more
when every replica holding it has all its GPU adapter slots busy with other adapters. The policy
then picks among them as usual (a load is priced in seconds like any other). When the pick does
not serve the adapter yet, `ensure` loads it there first (`POST /v1/load_lora_adapter`
`{lora_name, lora_path}`; vLLM needs `VLLM_ALLOW_RUNTIME_LORA_UPDATING`). A replica that answers
404 or 405 has no runtime routes and is not offered loads again. An adapter the gateway loaded
that has had no request for `idle_unload_s` is unloaded (`POST /v1/unload_lora_adapter`),
checked on traffic at most every quarter of that. The decisions are synchronous and take a
clock, so the benchmark drives the same code in simulated time.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from .control_client import ControlClient
from .lora import post_adapter
from .pools import Pool
from .replicas import ReplicaState

log = logging.getLogger("gateway.lora")
LOAD_PATH, UNLOAD_PATH = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
_NONE: frozenset[str] = frozenset()


class LoraPlacement:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.loaded: dict[tuple[str, str], float] = {}  # (replica, adapter) it loaded -> last use
        self.no_runtime: set[str] = set()  # replicas without the runtime routes
        self.loads = self.unloads = 0
        self._loading: dict[tuple[str, str], asyncio.Task[bool]] = {}
        self._swept = 0.0
        self._tasks: set[asyncio.Task[None]] = set()

    def register(self, registry: CollectorRegistry) -> None:
        """`gateway_lora_managed_loads_total` / `_unloads_total` on /metrics (docs/lora.md)."""
        registry.register(_PlacementCollector(self))

    # --- decisions (synchronous) ----------------------------------------------------------
    def offer(self, pool: Pool, model: str) -> None:
        """Set each replica's loadable adapters for a request of `model` (managed pools only)."""
        cfg = pool.config.lora
        if not cfg.manage:
            return
        managed = frozenset(cfg.adapters)
        if model not in managed:
            for r in pool.replicas:
                r.lora.set_loadable(_NONE, managed)
            return
        serving = [r for r in pool.replicas if model in r.lora.served]
        demand = 1 + sum(r.lora.own.get(model, 0) for r in pool.replicas)
        wanted = min(cfg.max_replicas_per_adapter, max(1, math.ceil(demand / cfg.requests_per_replica)))
        # every replica holding it has all its GPU slots busy with other adapters: one more
        stuck = bool(serving) and all(r.lora.state(model) == "busy" for r in serving)
        more = frozenset({model}) if len(serving) < wanted or stuck else _NONE
        for r in pool.replicas:
            may = more if r.name not in self.no_runtime and model not in r.lora.served else _NONE
            r.lora.set_loadable(may, managed)

    def needs_load(self, pool: Pool, replica: ReplicaState, model: str) -> str | None:
        """The path `replica` must load `model` from before it gets the request, or None."""
        cfg = pool.config.lora
        if not cfg.manage or model not in cfg.adapters:
            return None
        key = (replica.name, model)
        if key in self.loaded:
            self.loaded[key] = self.clock()
        if model in replica.lora.served:
            return None
        return cfg.adapters[model]

    def did_load(self, replica: ReplicaState, model: str) -> None:
        self.loaded[(replica.name, model)] = self.clock()
        lora = replica.lora
        lora.set_models(lora.served | {model}, lora.base)
        self.loads += 1

    def cold(self, pool: Pool) -> list[tuple[ReplicaState, str]]:
        """Adapters the gateway loaded that are idle past `idle_unload_s`, nothing in flight."""
        cfg = pool.config.lora
        now = self.clock()
        out = []
        for r in pool.replicas:
            for (name, model), used in self.loaded.items():
                if name == r.name and now - used >= cfg.idle_unload_s and not r.lora.own.get(model):
                    out.append((r, model))
        return out

    def did_unload(self, replica: ReplicaState, model: str) -> None:
        self.loaded.pop((replica.name, model), None)
        lora = replica.lora
        lora.set_models(lora.served - {model}, lora.base)
        self.unloads += 1

    # --- the calls ------------------------------------------------------------------------
    async def ensure(self, client: ControlClient, pool: Pool, replica: ReplicaState, model: str) -> bool:
        """Load `model` on `replica` when it must be (one call per replica and adapter at a
        time); False when the load failed (the request goes on, and the replica's answer says)."""
        self._maybe_sweep(client, pool)
        path = self.needs_load(pool, replica, model)
        if path is None:
            return True
        key = (replica.name, model)
        task = self._loading.get(key)
        if task is None:
            task = asyncio.create_task(self._load(client, pool, replica, model, path))
            self._loading[key] = task
            task.add_done_callback(lambda _t: self._loading.pop(key, None))
        return await asyncio.shield(task)

    async def _load(
        self, client: ControlClient, pool: Pool, replica: ReplicaState, model: str, path: str
    ) -> bool:
        status, text = await post_adapter(
            client, replica.url, LOAD_PATH, {"lora_name": model, "lora_path": path},
            pool.config.lora.load_timeout_s,
        )  # fmt: skip
        if status == 200 or (status == 400 and "already been loaded" in text):
            self.did_load(replica, model)
            log.info("replica %s: loaded LoRA adapter %s", replica.name, model)
            return True
        if status in (404, 405):
            self.no_runtime.add(replica.name)
        log.warning("replica %s: loading LoRA adapter %s failed (%s %s)", replica.name, model,
                    status or "no answer", text[:200])  # fmt: skip
        return False

    def _maybe_sweep(self, client: ControlClient, pool: Pool) -> None:
        now = self.clock()
        if not pool.config.lora.manage or now - self._swept < pool.config.lora.idle_unload_s / 4:
            return
        self._swept = now
        cold = self.cold(pool)
        if cold:
            task = asyncio.create_task(self._unload(client, pool, cold))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _unload(
        self, client: ControlClient, pool: Pool, cold: list[tuple[ReplicaState, str]]
    ) -> None:
        for replica, model in cold:
            status, text = await post_adapter(
                client, replica.url, UNLOAD_PATH, {"lora_name": model},
                pool.config.lora.load_timeout_s,
            )  # fmt: skip
            if status in (200, 404):  # 404: it was gone already
                self.did_unload(replica, model)
                log.info("replica %s: unloaded idle LoRA adapter %s", replica.name, model)
            else:
                log.warning("replica %s: unloading LoRA adapter %s failed (%s %s)", replica.name,
                            model, status or "no answer", text[:200])  # fmt: skip


class _PlacementCollector(Collector):
    def __init__(self, placement: LoraPlacement) -> None:
        self._p = placement

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "gateway_lora_managed_loads",
            "Adapters the gateway loaded on a replica before forwarding (lora.manage).",
            value=self._p.loads,
        )
        yield CounterMetricFamily(
            "gateway_lora_managed_unloads",
            "Adapters the gateway unloaded after lora.idle_unload_s without a request.",
            value=self._p.unloads,
        )
