"""Cost-in-blocks scorer (Dynamo-like): prefill work still to do plus work already held.

Formula:

    prefill = inflight_prompt_tokens / tpb + prompt_tokens / tpb - hit_blocks   (>= 0)
    decode  = load * blocks_per_request     (blocks_per_request defaults to this request's size:
                                             the gateway sees counts, not per-sequence blocks)
    cost    = prefill_load_scale * prefill + decode
    score   = (1 + min_cost) / (1 + cost)   (1.0 for the cheapest; lowest cost wins)

Config:

    scorers:
      cost_blocks: {weight: 1, prefill_load_scale: 1.0, blocks_per_request: null}
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import Scorer
from policies.types import ReplicaView, RoutedRequest


class CostBlocksScorer(Scorer):
    name = "cost_blocks"
    needs_prefix = True  # the prefill still to do is the prompt less the blocks held
    reason = "cost"

    def __init__(
        self, *, prefill_load_scale: float = 1.0, blocks_per_request: float | None = None
    ) -> None:
        if not prefill_load_scale >= 0:
            raise ValueError(f"prefill_load_scale must be >= 0, got {prefill_load_scale!r}")
        if blocks_per_request is not None and not blocks_per_request >= 0:
            raise ValueError(f"blocks_per_request must be >= 0, got {blocks_per_request!r}")
        self.prefill_load_scale = float(prefill_load_scale)
        self.blocks_per_request = blocks_per_request

    def cost(self, req: RoutedRequest, view: ReplicaView) -> float:
        """The cost in blocks of sending `req` to `view` (lower is better)."""
        tpb = req.tokens_per_block if req.tokens_per_block > 0 else 1.0
        incoming = req.prompt_tokens / tpb
        per_request = incoming if self.blocks_per_request is None else self.blocks_per_request
        prefill = max(0.0, view.inflight_prompt_tokens / tpb + incoming - view.hit_blocks)
        return self.prefill_load_scale * prefill + view.load * per_request

    def score(self, req: RoutedRequest, views: Sequence[ReplicaView]) -> dict[str, float]:
        costs = {v.name: self.cost(req, v) for v in views}
        floor = 1.0 + min(costs.values(), default=0.0)
        return {name: floor / (1.0 + c) for name, c in costs.items()}
