"""`python -m bench.sim_report`: the tables docs/simulator.md shows, computed by the simulator.

(1) TTFT with the prefix cache on and off (discrete-event mode, one replica); (2) KV per token
and concurrency per shipped model and GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence

from simulator.config import build_config
from simulator.des import Cluster, ReplicaLoad, RoundRobin, SimRequest, chat_requests, run
from simulator.profiles import load_gpus, load_models
from simulator.workloads import shared_prompts

USER_TOKENS = (20, 200)
MAX_TOKENS = 128


class _OnlyReplica:
    def route(self, req: SimRequest, view: Sequence[ReplicaLoad]) -> int:
        return 0


async def cache_rows(model: str, gpu: str, rates: Sequence[float], n_requests: int,
                     seed: int) -> list[dict[str, float | str]]:
    rows: list[dict[str, float | str]] = []
    for rate in rates:
        trace = chat_requests(shared_prompts(n_requests, k=4, rate=rate, prompt_tokens=(2000, 2000),
                                             user_tokens=USER_TOKENS, max_tokens=MAX_TOKENS,
                                             seed=seed))
        for caching in (True, False):
            cluster = Cluster(1, model, gpu, seed=seed, enable_prefix_caching=caching)
            s = (await run(trace, cluster, _OnlyReplica())).summary()
            rows.append({"rate": rate, "cache": "on" if caching else "off", **s})
    return rows


async def speed_row(n_requests: int, rate: float, replicas: int, seed: int) -> str:
    """How fast the discrete-event mode replays a trace (CPU seconds of this process)."""
    trace = chat_requests(shared_prompts(n_requests, k=16, rate=rate, prompt_tokens=(1000, 3000),
                                         user_tokens=USER_TOKENS, max_tokens=200, seed=seed))
    cluster = Cluster(replicas, "qwen2.5-14b", "a100-80g", seed=seed)
    cpu = time.process_time()
    result = await run(trace, cluster, RoundRobin())
    cpu = time.process_time() - cpu
    s = result.summary()
    steps = sum(e.counters.steps for e in cluster.engines)
    return (f"| {n_requests:,} | {replicas} | {rate:g} | {s['makespan_s']:.0f} | {steps:,} | "
            f"{cpu:.1f} |")


def cache_table(rows: list[dict[str, float | str]]) -> str:
    lines = ["| arrivals (req/s) | prefix cache | hit ratio | TTFT P50 (s) | TTFT P99 (s) | "
             "TPOT P50 (ms) | output tok/s |",
             "| ---: | :---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(
            f"| {r['rate']:g} | {r['cache']} | {float(r['hit_ratio']):.1%} | "
            f"{float(r['ttft_p50']):.3f} | {float(r['ttft_p99']):.3f} | "
            f"{float(r['tpot_p50']) * 1000:.1f} | {float(r['throughput_tok_s']):.0f} |")
    return "\n".join(lines)


def capacity_table(seq_len: int = 4096) -> str:
    lines = [f"| model | GPU | TP | weights/GPU (GB) | KV bytes/token | KV cache (GB) | "
             f"KV blocks (16 tok) | max concurrent {seq_len // 1024}K seqs | "
             "prefill (ms/1K tok) | decode step, batch 1 (ms) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for m in load_models():
        for g in load_gpus():
            try:
                cfg = build_config(m, g)
            except ValueError:
                lines.append(f"| {m} | {g} | > 8 | | | | | | | |")  # not even on 8 GPUs
                continue
            p = cfg.perf
            lines.append(
                f"| {m} | {g} | {cfg.tensor_parallel_size} | {p.weight_bytes_per_gpu / 1e9:.1f} | "
                f"{p.kv_bytes_per_token:,.0f} | {p.kv_capacity_bytes / 1e9:.1f} | "
                f"{cfg.num_blocks:,} | {p.max_concurrency(seq_len):.1f} | "
                f"{p.prefill_time(1000) * 1000:.0f} | "
                f"{(p.step_time(0, 1, 1000)) * 1000:.1f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sim_report")
    ap.add_argument("--model", default="qwen2.5-14b")
    ap.add_argument("--gpu", default="a100-80g")
    ap.add_argument("--rates", default="0.5,1,2", help="arrival rates, req/s, comma-separated")
    ap.add_argument("--requests", type=int, default=1000, help="requests per run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--table", choices=("all", "cache", "capacity", "speed"), default="all")
    args = ap.parse_args(argv)
    if args.table in ("all", "cache"):
        rates = [float(x) for x in args.rates.split(",")]
        rows = asyncio.run(cache_rows(args.model, args.gpu, rates, args.requests, args.seed))
        print(f"TTFT with the prefix cache on and off: one {args.model} replica on {args.gpu}; "
              f"{args.requests} requests per run (simulator.workloads.shared_prompts): 4 system "
              f"prompts of 2,000 tokens, user turns of {USER_TOKENS[0]}-{USER_TOKENS[1]} tokens, "
              f"{MAX_TOKENS} output tokens, Poisson arrivals, seed {args.seed}.\n")
        print(cache_table(rows))
        print()
    if args.table in ("all", "capacity"):
        print("KV per token and concurrency per model and GPU (gpu_memory_utilization 0.9, "
              "TP = fewest GPUs whose KV cache holds one max_model_len sequence).\n")
        print(capacity_table())
    if args.table == "speed":
        print("Discrete-event replay speed: qwen2.5-14b on a100-80g, round robin, 16 system "
              "prompts of 1-3K tokens, 200 output tokens per request.\n")
        print("| requests | replicas | arrivals (req/s) | simulated (s) | engine steps | "
              "CPU (s) |\n| ---: | ---: | ---: | ---: | ---: | ---: |")
        for rate in (10.0, 40.0):
            print(asyncio.run(speed_row(args.requests, rate, 8, args.seed)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
