"""The named policy presets, as plain specs that `build_policy` turns into Policy objects.

Each preset uses the default filters (healthy, serves_model, not_saturated) unless it says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

_GUARD: Mapping[str, Any] = MappingProxyType({"max_load_gap": 8, "max_load_ratio": 2.0})


def _spec(**spec: Any) -> Mapping[str, Any]:
    return MappingProxyType(spec)


# llm-d's long-standing blend (prefix 3 / queue 2 / kv 2) plus the hot-spot guard.
PREFIX_AWARE = _spec(
    scorers=MappingProxyType({"prefix": 3, "queue": 2, "kv_pressure": 2}),
    picker="max_score",
    guard=_GUARD,
)
# Predicted time to first token, learned per replica from outcomes; near ties (the picker's slack)
# go to the replica holding more of the prompt, then to fewer requests, then to fewer placed
# blocks. No request-count scorer: counting requests that only decode sends repeats away from
# their prefix (a burst on a new prompt would be prefilled everywhere). No guard.
TTFT = _spec(scorers=MappingProxyType({"ttft": 1}), picker="max_score", guard=False)
# Dynamo-like: lowest (uncached prefill blocks + held blocks) wins; the cost already has load.
COST_BLOCKS = _spec(scorers=MappingProxyType({"cost_blocks": 1}), picker="max_score", guard=False)
# llm-d's "sticky until saturated".
STICKY = _spec(picker="sticky")
# SGLang's cache_aware: imbalance switch, then longest prefix or least loaded.
SGLANG_CACHE_AWARE = _spec(picker="sglang_cache_aware")
# Baselines.
ROUND_ROBIN = _spec(picker="round_robin")
LEAST_LOADED = _spec(picker="least_loaded")
RANDOM = _spec(picker="random")
