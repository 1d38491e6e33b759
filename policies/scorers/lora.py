"""LoRA adapters: where a request's adapter stands on each replica, what that costs in seconds,
and the `lora_affinity` scorer.

States, best first (`adapter_state`): `active` (requests of the adapter in flight there),
`resident` (on its GPU as far as the gateway knows, idle), `free` (a GPU adapter slot is free:
one load), `evict` (every slot is held, one by an idle adapter: one load, and that adapter is
gone), `busy` (every slot held by an adapter with requests in flight: the request waits for one
to drain, then loads). A model that is no adapter of the replica has no state (None).

`LoraCost` prices them in seconds, for the `ttft` scorer to add to its prediction:

    active, resident: 0      free: load_s      busy: load_s + busy_s
    evict: load_s * (1 + evict_penalty * min(1, demand_scale * demand of the victim))

The victim is the least recently used idle adapter (the one the engine evicts); its demand is
its share of the replica's recent requests (`LoraView.demand`), so the least harmful eviction
is the cheapest.

`load_s` is learned: the residual of each observed TTFT that needed a load against the TTFT
model's prediction without one (an exponentially weighted mean), starting from `load_s` as the
prior worth `prior_weight` observations.

`lora_affinity` (for hand-made policies) scores the states on a fixed ladder, as llm-d's
lora-affinity scorer does: 1.0 active, 0.9 resident, 0.6 free, 0.3 evict, 0.0 busy; a replica
without LoRA, or a model that is no adapter, scores 1.0 (nothing to load).

    scorers: {ttft: {weight: 1, lora_load_s: 0.3}}      # the default policy, priced in seconds
    scorers: {prefix: 3, queue: 2, lora_affinity: 3}    # a ladder
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import Scorer
from policies.types import LoraView, ReplicaView, RoutedRequest

ACTIVE, RESIDENT, FREE, EVICT, BUSY = "active", "resident", "free", "evict", "busy"
LOADS = frozenset({FREE, EVICT, BUSY})
_LADDER = {ACTIVE: 1.0, RESIDENT: 0.9, FREE: 0.6, EVICT: 0.3, BUSY: 0.0}


def adapter_state(adapter: str, lora: LoraView) -> str | None:
    """Where `adapter` stands on the replica `lora` describes (None: not one of its adapters)."""
    if not lora.can_serve(adapter):
        return None
    if lora.inflight.get(adapter, 0) > 0:
        return ACTIVE
    if adapter in lora.resident:
        return RESIDENT
    held = len(lora.resident)
    if held < lora.max_loras:
        return FREE
    if any(lora.inflight.get(a, 0) <= 0 for a in lora.resident):
        return EVICT
    return BUSY


class LoraCost:
    """Seconds an adapter's state adds to a request's TTFT, with the load time learned."""

    __slots__ = ("load_s", "evict_penalty", "busy_s", "demand_scale", "_weight", "_n")

    def __init__(
        self,
        load_s: float = 0.3,
        *,
        evict_penalty: float = 1.0,
        demand_scale: float = 4.0,
        busy_s: float = 2.0,
        prior_weight: float = 4.0,
    ) -> None:
        if not load_s >= 0 or not evict_penalty >= 0 or not busy_s >= 0:
            raise ValueError("lora load_s, evict_penalty and busy_s must be >= 0")
        if not prior_weight > 0:
            raise ValueError(f"prior_weight must be > 0, got {prior_weight!r}")
        self.load_s = float(load_s)
        self.evict_penalty = float(evict_penalty)
        self.busy_s = float(busy_s)
        self.demand_scale = float(demand_scale)  # a victim with 1/scale of the requests: full harm
        self._weight = float(prior_weight)
        self._n = 0

    def extra_s(self, adapter: str, lora: LoraView | None) -> float:
        if lora is None:
            return 0.0
        state = adapter_state(adapter, lora)
        if state is None or state in (ACTIVE, RESIDENT):
            return 0.0
        if state == FREE:
            return self.load_s
        if state == EVICT:  # the engine evicts its least recently used idle adapter
            victim = next(a for a in lora.resident if lora.inflight.get(a, 0) <= 0)
            harm = min(1.0, lora.demand.get(victim, 0.0) * self.demand_scale)
            return self.load_s * (1.0 + self.evict_penalty * harm)
        return self.load_s + self.busy_s

    def learn(self, residual_s: float) -> None:
        """One observed TTFT less its prediction without the load it needed."""
        if residual_s != residual_s:  # NaN
            return
        residual_s = min(max(residual_s, 0.0), 3600.0)
        self._n += 1
        w = 1.0 / (self._weight + self._n) if self._n < 64 else 1.0 / 64.0
        self.load_s += w * (residual_s - self.load_s)


class LoraAffinityScorer(Scorer):
    name = "lora_affinity"
    reason = "lora"

    def score(self, req: RoutedRequest, views: Sequence[ReplicaView]) -> dict[str, float]:
        out: dict[str, float] = {}
        for v in views:
            state = adapter_state(req.model, v.lora) if v.lora is not None else None
            out[v.name] = 1.0 if state is None else _LADDER[state]
        return out
