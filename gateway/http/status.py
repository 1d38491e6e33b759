"""`snapshot(gateway, window)`: the gateway's state as one JSON-ready dict, for `/admin/status`.

Replicas appear by name only: no URL or other internal address is copied out of the config.
"""

from __future__ import annotations

import math
import time
from typing import Any

from gateway.fleet.replicas import OPEN, ReplicaState
from gateway.runtime.gateway import Gateway
from gateway.telemetry.window import RollingWindow

DECISIONS = 50  # routing decisions included, newest last


def status_of(gateway: Gateway, window: RollingWindow | None) -> dict[str, Any]:
    now = time.monotonic()
    series = window.series() if window is not None else None
    recent: dict[str, dict[str, Any]] = series["replicas"] if series is not None else {}
    pools = []
    for name, pool in gateway.pools.items():
        replicas = [_replica(r, now, recent.get(name, {}).get(r.name)) for r in pool.replicas]
        pools.append(
            {
                "name": name,
                "policy": pool.policy.name,
                "available": sum(1 for r in pool.replicas if r.available(now)),
                "replicas": replicas,
            }
        )
    return {
        "t": time.time(),
        "pools": pools,
        "admission": _admission(gateway),
        "decisions": _decisions(gateway),
        "series": series,
    }


def _replica(r: ReplicaState, now: float, recent: dict[str, Any] | None) -> dict[str, Any]:
    state = r.circuit.current(now)
    fresh = r.scraped is not None and now - r.scraped_at <= r.stale_after_s
    load = r.scraped if fresh else None
    hits = load.prefix_hits if load is not None else None
    queries = load.prefix_queries if load is not None else None
    return {
        "name": r.name,
        "healthy": state != OPEN,
        "circuit": state,
        "draining": r.draining,
        "available": r.available(now),
        "inflight": r.inflight,
        "max_inflight": r.max_inflight,
        "inflight_prompt_tokens": r.inflight_prompt_tokens,
        # scraped from the replica; null when never scraped or the scrape is stale (unknown, not 0)
        "waiting": _num(load.waiting) if load is not None else None,
        "running": _num(load.running) if load is not None else None,
        "kv_usage": load.kv_usage if load is not None else None,
        "preemptions": _num(load.preemptions) if load is not None else None,
        "replica_prefix_hit_rate": hits / queries if hits is not None and queries else None,
        "scrape_age_s": now - r.scraped_at if r.scraped is not None else None,
        "ttft_ewma_s": r.ttft_ewma_s,
        "recent": recent or _IDLE,
    }


_IDLE: dict[str, Any] = {
    "requests": 0,
    "request_rate": 0.0,
    "error_rate": None,
    "predicted_hit_rate": None,
    "observed_hit_rate": None,
    "ttft_p50": None,
    "ttft_p99": None,
    "tpot_p50": None,
    "tpot_p99": None,
    "e2e_p50": None,
    "e2e_p99": None,
}


def _admission(gateway: Gateway) -> dict[str, Any]:
    st = gateway.admission.stats()
    out: dict[str, Any] = {}
    for pool, per in st.queues.items():
        out[pool] = {
            klass: {"queued": q.queued, "oldest_wait_s": q.oldest_wait_s, "admitted": 0, "shed": 0}
            for klass, q in per.items()
        }
    for (pool, klass, _tenant), n in st.admitted.items():
        out.setdefault(pool, {}).setdefault(klass, _empty_queue())["admitted"] += n
    for (pool, klass, _tenant, _reason), n in st.shed.items():
        out.setdefault(pool, {}).setdefault(klass, _empty_queue())["shed"] += n
    return out


def _empty_queue() -> dict[str, Any]:
    return {"queued": 0, "oldest_wait_s": 0.0, "admitted": 0, "shed": 0}


def _decisions(gateway: Gateway) -> list[dict[str, Any]]:
    return gateway.decisions(DECISIONS)


def _num(v: float | None) -> float | None:
    if v is None or not math.isfinite(v):
        return None
    return int(v) if v == int(v) else v
