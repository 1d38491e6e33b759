"""Managed LoRA placement (`pools.<p>.lora.manage: true`, off by default; docs/lora.md).

Before a request for a managed adapter is chosen for, `offer` says which replicas may take it
(a `LoraOffer`, an input of `Router.choose`): those that serve it, and, while it is on fewer
replicas than its demand calls for, every other replica that allows runtime updates. Demand: its requests in flight in the pool (this one included) per
`requests_per_replica`, at least one replica and at most `max_replicas_per_adapter`; one more
when every replica holding it has all its GPU adapter slots busy with other adapters. The policy
then picks among them as usual (a load is priced in seconds like any other). When the pick does
not serve the adapter yet, `place` loads it there first, a forwarding step on the control client
(`POST /v1/load_lora_adapter` `{lora_name, lora_path}`; vLLM needs
`VLLM_ALLOW_RUNTIME_LORA_UPDATING`). A load that fails moves the request to the next replica of
the policy's ranking, up to the pool's `retries` more (the decision itself is never edited:
`place` says which replicas failed, and failover passes them over); when
every placement failed the request gets one error of the gateway's, never a replica's answer to
a request it could not serve (`placement_error`: 404 `model_not_found` when no replica tried
could find the adapter, 503 when they did not answer, else 502). A replica that answers 404 or
405 without vLLM's `NotFoundError` has no runtime routes and is not offered loads again. An
adapter the gateway loaded that has had no request for `idle_unload_s` is unloaded (`POST
/v1/unload_lora_adapter`), checked on traffic at most every quarter of that. The decisions are
synchronous and take a clock, so the benchmark drives the same code in simulated time.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from gateway.errors import GatewayError, NoReplicaAvailable, NotFound, UpstreamError
from gateway.fleet.pools import Pool
from gateway.fleet.replicas import ReplicaState
from gateway.routing.router import Dispatch, LoraOffer, Router, Routing
from gateway.transport.control import CONTROL_ERRORS, ControlClient, fetch

log = logging.getLogger("gateway.lora")
LOAD_PATH, UNLOAD_PATH = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
_NONE: frozenset[str] = frozenset()
NOT_FOUND, NO_RUNTIME, UNAVAILABLE, FAILED = "not_found", "no_runtime", "unavailable", "failed"


@dataclass(frozen=True, slots=True)
class LoadFailure:
    """A managed load a replica did not do: its status (0: no answer) and body (or error)."""

    replica: str
    status: int
    text: str

    @property
    def kind(self) -> str:
        """not_found: the replica cannot find the adapter (vLLM's 404 `NotFoundError`, "No
        adapter found"); no_runtime: no load route (404/405 of the server itself); unavailable:
        no answer, or a 502/503/504; failed: any other answer (a 400: a bad adapter, a 500)."""
        status, text = self.status, self.text
        if status in (0, 502, 503, 504):
            return UNAVAILABLE
        if status == 404 and ("No adapter found" in text or "NotFoundError" in text):
            return NOT_FOUND
        return NO_RUNTIME if status in (404, 405) else FAILED

    def why(self) -> str:
        return f"{self.replica}: {self.status or 'no answer'} {self.text[:200]}".strip()


def placement_error(
    model: str, failures: list[LoadFailure], expose: bool, retry_after: float
) -> GatewayError:
    """The one answer for a request whose adapter no placement could load: 404
    `model_not_found` when no replica tried could find the adapter, 503 (Retry-After) when none
    that could have answered did, else 502, saying why. The replicas' own words (which name the
    adapter's path) only with `expose` (server.expose_upstream_errors)."""
    n = len(failures)
    tried = f"the {n} replica{'s' if n != 1 else ''} tried"
    name = model[:64]
    detail = (" (" + "; ".join(f.why() for f in failures) + ")") if expose else ""
    kinds = {f.kind for f in failures}
    if kinds == {NOT_FOUND}:
        return NotFound(
            f"The model `{name}` does not exist: its LoRA adapter could not be loaded, "
            f"{tried} found no such adapter{detail}.", param="model", code="model_not_found",
        )  # fmt: skip
    if kinds <= {NOT_FOUND, UNAVAILABLE}:
        return NoReplicaAvailable(
            f"The LoRA adapter `{name}` could not be loaded: {tried} did not answer the load; "
            f"retry later{detail}.", retry_after=retry_after,
        )  # fmt: skip
    why = (
        "they do not allow runtime LoRA loading (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING)"
        if kinds == {NO_RUNTIME}
        else "the replicas refused or failed the load"
    )
    return UpstreamError(f"The LoRA adapter `{name}` could not be loaded on {tried}: {why}{detail}.")


class LoraPlacement:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.loaded: dict[tuple[str, str], float] = {}  # (replica, adapter) it loaded -> last use
        self.no_runtime: set[str] = set()  # replicas without the runtime routes
        self.loads = self.unloads = self.load_failures = 0
        self._loading: dict[tuple[str, str], asyncio.Task[LoadFailure | None]] = {}
        self._swept = 0.0
        self._tasks: set[asyncio.Task[None]] = set()

    def register(self, registry: CollectorRegistry) -> None:
        """`gateway_lora_managed_loads_total` / `_unloads_total` on /metrics (docs/lora.md)."""
        registry.register(_PlacementCollector(self))

    # --- decisions (synchronous) ----------------------------------------------------------
    def offer(self, pool: Pool, model: str) -> LoraOffer | None:
        """The adapters each replica may load for a request of `model` (None: the pool's
        placement is not managed). Reads the replicas' state, changes nothing."""
        cfg = pool.config.lora
        if not cfg.manage:
            return None
        managed = frozenset(cfg.adapters)
        if model not in managed:
            return LoraOffer(managed, {})
        serving = [r for r in pool.replicas if model in r.lora.served]
        demand = 1 + sum(r.lora.own.get(model, 0) for r in pool.replicas)
        wanted = min(cfg.max_replicas_per_adapter, max(1, math.ceil(demand / cfg.requests_per_replica)))
        # every replica holding it has all its GPU slots busy with other adapters: one more
        stuck = bool(serving) and all(r.lora.state(model) == "busy" for r in serving)
        more = frozenset({model}) if len(serving) < wanted or stuck else _NONE
        loadable = {
            r.name: more if r.name not in self.no_runtime and model not in r.lora.served else _NONE
            for r in pool.replicas
        }
        return LoraOffer(managed, loadable)

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
    async def place(
        self, client: ControlClient, router: Router, pool: Pool, routing: Routing, first: Dispatch,
        expose: bool = False, released: Callable[[], None] | None = None,
    ) -> tuple[Dispatch, frozenset[str]]:  # fmt: skip
        """Where the request goes: `first` once its adapter is loaded there (or needs no load);
        after a failed load the next replica of the policy's ranking that may take it, up to
        `retries` more. Raises `placement_error` when every placement failed (each failed
        dispatch given up: counted nowhere, its slot freed, `released` told). Returns the
        placement's dispatch and the replicas whose load failed, which failover passes over;
        the decision stays as the policy made it."""
        model = routing.routed.model
        decision = routing.decision
        assert decision is not None
        failures: list[LoadFailure] = []
        current = first
        while True:
            failure = await self.ensure(client, pool, current.replica, model)
            if failure is None:
                break
            failures.append(failure)
            await current.abandoned()
            current.done()
            if released is not None:
                released()
            nxt = None
            if len(failures) <= pool.config.retries:
                failed = {f.replica for f in failures}
                nxt = next((n for n in decision.ranked if n not in failed and self._may_load(
                    pool.by_name[n], model)), None)  # fmt: skip
            if nxt is None:
                raise placement_error(model, failures, expose, pool.config.health.interval_s)
            current = await router.dispatch(pool, routing, nxt)
        return current, frozenset(f.replica for f in failures)

    def _may_load(self, replica: ReplicaState, model: str) -> bool:
        return model in replica.lora.served or replica.name not in self.no_runtime

    async def ensure(
        self, client: ControlClient, pool: Pool, replica: ReplicaState, model: str
    ) -> LoadFailure | None:
        """Load `model` on `replica` when it must be (one call per replica and adapter at a
        time); the failure when the load failed, else None."""
        self._maybe_sweep(client, pool)
        path = self.needs_load(pool, replica, model)
        if path is None:
            return None
        key = (replica.name, model)
        task = self._loading.get(key)
        if task is None:
            task = asyncio.create_task(self._load(client, pool, replica, model, path))
            self._loading[key] = task
            task.add_done_callback(lambda _t: self._loading.pop(key, None))
        return await asyncio.shield(task)

    async def _load(
        self, client: ControlClient, pool: Pool, replica: ReplicaState, model: str, path: str
    ) -> LoadFailure | None:
        status, text = await post_adapter(
            client, replica.url, LOAD_PATH, {"lora_name": model, "lora_path": path},
            pool.config.lora.load_timeout_s,
        )  # fmt: skip
        if status == 200 or (status == 400 and "already been loaded" in text):
            self.did_load(replica, model)
            log.info("replica %s: loaded LoRA adapter %s", replica.name, model)
            return None
        failure = LoadFailure(replica.name, status, text)
        if failure.kind == NO_RUNTIME:
            self.no_runtime.add(replica.name)
        self.load_failures += 1
        log.warning("replica %s: loading LoRA adapter %s failed (%s %s)", replica.name, model,
                    status or "no answer", text[:200])  # fmt: skip
        return failure

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


async def post_adapter(
    client: ControlClient, url: str, path: str, body: Mapping[str, Any], timeout_s: float
) -> tuple[int, str]:
    """POST one runtime adapter call (`/v1/load_lora_adapter`, ...): (status, body text); status
    0 when the replica did not answer."""
    try:
        reply = await fetch(client, "POST", url + path, json=dict(body), timeout_s=timeout_s)
    except CONTROL_ERRORS as exc:
        return 0, type(exc).__name__
    return reply.status, reply.body[:512].decode("utf-8", "replace")


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
        yield CounterMetricFamily(
            "gateway_lora_managed_load_failures",
            "Managed adapter loads a replica did not do (the request moved to the next placement).",
            value=self._p.load_failures,
        )
