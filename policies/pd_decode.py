"""The decode-side picker of a disaggregated (P/D) pool: which decode replica takes the KV.

A decode replica receives a prompt it never prefilled; what matters is whether it can hold the
sequence and how busy its decode batch is. So it is ranked by, in order:

1. filters: circuit open, draining, no free slot (`max_inflight`), a model it does not serve,
   and **KV headroom**: when its engine's KV capacity is known (`cache_config_info`) and its
   usage was scraped, a replica whose free KV cannot hold prompt + max_tokens is removed;
2. the score: `decode_load = 1 - batch / max_inflight` (decode batch: scraped running +
   waiting, or the gateway's in-flight count, whichever is larger) times
   `0.5 + 0.5 * kv_headroom` (the KV left free after this sequence, as a share of the
   replica's KV; 0.5 when unknown), minus the transfer cost of the pair in seconds when the
   caller knows it (`transfer_s`).

Ties go to the replica with the most free KV, then by name (stable). Pure: no I/O, no state.
The gateway calls `rank_decode` from gateway/routing/router.py (`Router.choose` of a P/D pool);
docs/pd.md describes it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .types import Decision, ReplicaView, RoutedRequest

NAME = "pd_decode"


def free_kv_tokens(view: ReplicaView, kv_tokens: int | None) -> int | None:
    """Tokens of KV the replica has free, from its engine's capacity and scraped usage."""
    if kv_tokens is None or view.kv_usage is None:
        return None
    return int(kv_tokens * max(0.0, 1.0 - view.kv_usage))


def rank_decode(
    req: RoutedRequest,
    views: Sequence[ReplicaView],
    kv_tokens: Mapping[str, int | None],
    transfer_s: Mapping[str, float] | None = None,
    default_max_tokens: int = 256,
) -> Decision:
    """Decode replicas for `req`, best first. `kv_tokens`: each replica's KV capacity in tokens
    (None: unknown); `transfer_s`: the KV transfer time to each, where known."""
    need = req.prompt_tokens + (
        req.max_tokens if req.max_tokens is not None else default_max_tokens
    )
    filtered: dict[str, str] = {}
    scores: dict[str, dict[str, float]] = {}
    totals: dict[str, float] = {}
    free_of: dict[str, int] = {}
    for v in views:
        why = _unfit(v, req.model)
        free = free_kv_tokens(v, kv_tokens.get(v.name))
        if why is None and free is not None and free < need:
            why = f"kv headroom: {free} tokens free, needs {need}"
        if why is not None:
            filtered[v.name] = why
            continue
        batch = max(v.inflight, (v.running or 0) + (v.waiting or 0))
        load = max(0.0, 1.0 - batch / max(1, v.max_inflight))
        s = {"decode_load": load}
        cap = kv_tokens.get(v.name)
        # free KV after this sequence, as a share of the replica's KV; unknown counts as half
        # (an unscraped replica is not the emptiest one)
        s["kv_headroom"] = max(0.0, (free - need) / cap) if free is not None and cap else 0.5
        total = load * (0.5 + 0.5 * s["kv_headroom"])
        cost = (transfer_s or {}).get(v.name)
        if cost is not None:
            s["transfer_s"] = cost
            total -= cost
        scores[v.name], totals[v.name] = s, total
        free_of[v.name] = free if free is not None else -1
    ranked = sorted(totals, key=lambda n: (-totals[n], -free_of[n], n))
    reason = "decode_load" if ranked else "no_decode_replica"
    return Decision(ranked, reason, NAME, scores, totals, filtered)


def _unfit(v: ReplicaView, model: str) -> str | None:
    if not v.healthy or v.circuit == "open":
        return "circuit open"
    if v.draining:
        return "draining"
    if v.inflight >= v.max_inflight:
        return "at max_inflight"
    if v.models and model and model not in v.models:
        return "does not serve the model"
    return None
