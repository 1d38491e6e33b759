"""LoRA-aware routing benchmark: 8 simulated replicas serving 50 adapters of one base model.

Adapters are picked with Zipf popularity; each replica has `max_loras` 4 GPU adapter slots and
pays `load_s` of stalled step time for every adapter it loads (simulator/lora.py). Every router
is the gateway's own routing unit (`bench.routing_routers.DesRouter`: parse the OpenAI body the
client sends, scope and hash, index, views, the pool's policy, dispatch accounting); the DES
only plays the clock and the scrapes, and each scrape hands the gateway the replica's
`vllm:lora_requests_info` text and `/v1/models` cards, read by gateway/fleet/lora.py as in production.

    python -m bench.lora                 # the table in docs/benchmarks.md (about a minute)
    python -m bench.lora --requests 400  # quicker

Printed per router: TTFT P50/P99, adapter loads per 1,000 requests, prefix hit ratio, and the
ratios against round robin (the goal: LoRA-aware cuts loads >= 5x and TTFT P99 >= 2x).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from bench.routing_routers import DesRouter
from bench.routing_workloads import ENGINE, segment
from gateway.config.sections import LoraConfig as GatewayLora
from gateway.fleet.lora import adapters_of, parse_lora_info
from gateway.forwarding.lora_placement import LoraPlacement
from simulator.des import Cluster, ReplicaLoad, SimRequest, run
from simulator.lora import LoraConfig, adapter_path
from simulator.lora_api import adapter_cards
from simulator.stats import percentile
from simulator.workloads import arrivals

N_REPLICAS = 8
N_ADAPTERS = 50
MAX_LORAS = 4
LOAD_S = 0.25
BASE = "bench-base"
SCRAPE_S = 1.0
# prefix-only: the prefix scorer and the filters the LoRA-aware default also has; it never
# looks at adapters (a router that knows prefixes but not LoRA)
POLICIES: dict[str, str | dict[str, Any]] = {
    "round_robin": "round_robin",
    "prefix_only": {"scorers": {"prefix": 1}, "picker": "max_score", "guard": False},
    "lora_aware": "ttft",  # the default policy: LoRA-aware when the replicas serve adapters
    "lora_managed": "ttft",  # the same, with managed placement (lora: {manage: true})
}
MANAGED = frozenset({"lora_managed"})


def adapter_names(n: int = N_ADAPTERS) -> list[str]:
    return [f"lora-{i:02d}" for i in range(n)]


def workload(n: int, *, rate: float, seed: int, zipf_s: float = 1.1) -> list[SimRequest]:
    """`n` completions, Poisson at `rate`/s: adapter by Zipf rank, a 512-token instruction per
    adapter (its requests share it), 64-256 fresh user tokens, 32-128 tokens out."""
    rng = random.Random(seed)
    names = adapter_names()
    weights = [1.0 / (k + 1) ** zipf_s for k in range(len(names))]
    out = []
    for i, t in enumerate(arrivals(rng, n, rate)):
        name = rng.choices(names, weights)[0]
        prompt = segment(f"sys:{name}", 512) + segment(f"user:{seed}:{i}", rng.randint(64, 256))
        max_tokens = rng.randint(32, 128)
        body = {"model": name, "prompt": list(prompt), "max_tokens": max_tokens, "stream": True}
        out.append(SimRequest(f"req-{i}", t, prompt, max_tokens,
                              meta={"lora": name, "kind": "completions",
                                    "raw": orjson.dumps(body)}))  # fmt: skip
    return out


class LoraDesRouter(DesRouter):
    """`DesRouter` whose scrapes also carry each engine's LoRA surface to the gateway; with
    `managed`, the pool runs managed placement (gateway/forwarding/lora_placement.py, on the DES clock):
    the engines start with no adapter and the gateway's loads and unloads register them."""

    def __init__(self, policy: str | dict[str, Any], cluster: Cluster, seed: int, label: str,
                 managed: bool = False) -> None:
        super().__init__(policy, len(cluster.engines), seed=seed, label=label,
                         kv_tokens=cluster.config.num_blocks * cluster.config.block_size)
        self.cluster = cluster
        self.placement: LoraPlacement | None = None
        self.swept = 0.0
        if managed:
            lora = GatewayLora(manage=True, adapters={a: adapter_path(a) for a in adapter_names()})
            self.pool.config = self.pool.config.model_copy(update={"lora": lora})
            self.placement = LoraPlacement(clock=lambda: self.now)
        for r, e in zip(self.replicas, cluster.engines, strict=True):
            r.lora.set_models(*adapters_of([{"id": BASE, "parent": None},
                                            *adapter_cards(e.lora, BASE, 0)]))

    async def route(self, req: SimRequest, view: Sequence[ReplicaLoad]) -> int:
        placement, model = self.placement, req.meta["lora"]
        if placement is None:
            return await super().route(req, view)
        self.now = req.arrival_s
        self._sweep(placement)
        self.offer = placement.offer(self.pool, model)
        i = await super().route(req, view)
        replica, engine = self.replicas[i], self.cluster.engines[i]
        path = placement.needs_load(self.pool, replica, model)
        if path is not None and engine.lora is not None:  # POST /v1/load_lora_adapter
            engine.lora.register(model, path)
            placement.did_load(replica, model)
        return i

    def _sweep(self, placement: LoraPlacement) -> None:
        cfg = self.pool.config.lora
        if self.now - self.swept < cfg.idle_unload_s / 4:
            return
        self.swept = self.now
        for replica, model in placement.cold(self.pool):  # POST /v1/unload_lora_adapter
            engine = self.cluster.engines[self.slot[replica.name]]
            if engine.lora is not None:
                engine.lora.unregister(model)
            placement.did_unload(replica, model)

    def _scraped(self, view: Sequence[ReplicaLoad]) -> None:
        fresh = [load for load in view if self.replicas[load.index].scraped_at != load.scraped_at_s]
        super()._scraped(view)
        for load in fresh:
            lora = self.cluster.engines[load.index].lora
            if lora is None or not lora.series:
                continue
            info = parse_lora_info(_metric_text(lora.metric_samples()))
            if info is not None:
                r = self.replicas[load.index]
                r.lora.set_metric(info[0], info[1], r.lora_max)


def _metric_text(samples: list[tuple[dict[str, str], float]]) -> str:
    lines = ["# TYPE vllm:lora_requests_info gauge"]
    for labels, value in samples:
        inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
        lines.append(f"vllm:lora_requests_info{{{inner}}} {value!r}")
    return "\n".join(lines) + "\n"


@dataclass(slots=True)
class Row:
    router: str
    p50: float
    p99: float
    loads_per_k: float
    hit_ratio: float
    cpu_s: float


def engine_config(load_s: float = LOAD_S, managed: bool = False) -> dict[str, Any]:
    """Every adapter registered at start (`--lora-modules`), or, managed, none and the runtime
    load/unload routes on."""
    lora = LoraConfig(() if managed else tuple(adapter_names()), max_loras=MAX_LORAS,
                      max_cpu_loras=MAX_LORAS, load_s=load_s, runtime_updating=managed)
    return {**ENGINE, "lora": lora}


async def run_one(name: str, requests: list[SimRequest], seed: int, load_s: float) -> Row:
    managed = name in MANAGED
    cluster = Cluster(N_REPLICAS, seed=seed, **engine_config(load_s, managed))
    router = LoraDesRouter(POLICIES[name], cluster, seed, name, managed=managed)
    cpu = time.process_time()
    result = await run(requests, cluster, router, scrape_interval_s=SCRAPE_S)
    cpu = time.process_time() - cpu
    ttfts = [r.ttft_s for r in result.records]
    loads = sum(e.lora.loads for e in cluster.engines if e.lora is not None)
    prompt = sum(r.prompt_tokens for r in result.records)
    cached = sum(r.cached_tokens for r in result.records)
    return Row(name, percentile(ttfts, 50), percentile(ttfts, 99),
               1000.0 * loads / max(1, len(requests)), cached / max(1, prompt), cpu)


def table(rows: list[Row]) -> str:
    base = next((r for r in rows if r.router == "round_robin"), rows[0])
    out = [f"{'router':<14}{'TTFT p50':>10}{'TTFT p99':>10}{'loads/1k':>10}{'hit ratio':>11}"
           f"{'loads vs rr':>13}{'p99 vs rr':>11}"]
    for r in rows:
        fewer = base.loads_per_k / r.loads_per_k if r.loads_per_k else float("inf")
        faster = base.p99 / r.p99 if r.p99 else float("inf")
        out.append(f"{r.router:<14}{r.p50 * 1000:>8.0f}ms{r.p99 * 1000:>8.0f}ms"
                   f"{r.loads_per_k:>10.1f}{r.hit_ratio:>11.2f}{fewer:>12.1f}x{faster:>10.1f}x")
    return "\n".join(out)


def goals(rows: list[Row]) -> list[str]:
    by = {r.router: r for r in rows}
    rr, aware = by.get("round_robin"), by.get("lora_aware")
    if rr is None or aware is None:
        return []
    loads = rr.loads_per_k / aware.loads_per_k if aware.loads_per_k else float("inf")
    p99 = rr.p99 / aware.p99 if aware.p99 else float("inf")
    return [f"adapter loads {loads:.1f}x fewer than round robin (goal >= 5x): "
            f"{'met' if loads >= 5 else 'NOT met'}",
            f"TTFT p99 {p99:.1f}x lower than round robin (goal >= 2x): "
            f"{'met' if p99 >= 2 else 'NOT met'}"]


async def bench(n: int, rate: float, seed: int, routers: Sequence[str], load_s: float) -> list[Row]:
    requests = workload(n, rate=rate, seed=seed)
    rows = []
    for name in routers:
        rows.append(await run_one(name, requests, seed, load_s))
        print(f"  {name}: done in {rows[-1].cpu_s:.1f} s CPU", file=sys.stderr, flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--rate", type=float, default=15.0, help="requests per second (Poisson)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--load-ms", type=float, default=LOAD_S * 1000, help="adapter load time")
    p.add_argument("--routers", nargs="*", default=list(POLICIES), choices=list(POLICIES))
    args = p.parse_args(argv)
    print(f"{N_REPLICAS} replicas ({ENGINE['model']} on {ENGINE['gpu']}), {N_ADAPTERS} adapters "
          f"(Zipf), max_loras {MAX_LORAS}, adapter load {args.load_ms:g} ms; "
          f"{args.requests} requests at {args.rate:g}/s", flush=True)
    rows = asyncio.run(bench(args.requests, args.rate, args.seed, args.routers,
                             args.load_ms / 1000.0))
    print(table(rows))
    for line in goals(rows):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["adapter_path", "main", "workload"]
