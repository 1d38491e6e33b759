"""The `serves_adapter` filter: a LoRA adapter goes only to replicas that serve it (or that the
gateway may load it on, under managed placement).

A replica without LoRA (no `ReplicaView.lora`) is kept, unless the request names an adapter that
another replica of the pool serves (`RoutedRequest.adapter`: a vLLM started with `--enable-lora`
and no adapter loaded yet answers such a request 404). A request for one of the replica's base
models is kept, and any request to a replica whose model list is not known yet (unless it names
an adapter the gateway places): pools without adapters route as before. One of the default
filters.

    filters: [healthy, serves_model, serves_adapter, not_saturated]
"""

from __future__ import annotations

from policies.base import Filter
from policies.types import ReplicaView, RoutedRequest

NO_ADAPTER = "does not serve adapter"


class ServesAdapter(Filter):
    name = "serves_adapter"

    def keep(self, req: RoutedRequest, view: ReplicaView) -> str | None:
        lora = view.lora
        if lora is None:
            return f"{NO_ADAPTER} {req.model!r}" if req.adapter else None
        if req.model in lora.base or lora.can_serve(req.model):
            return None
        if req.model not in lora.managed and not lora.base and not lora.served:
            return None  # its model list is not known yet
        return f"{NO_ADAPTER} {req.model!r}"
