"""`python -m bench.routing --http`: the real gateway over HTTP in front of simulated replicas.

One workload, as chat text (`simulator.workloads`), goes through `python -m simulator` (8
replicas, a subprocess) behind the gateway app (uvicorn, this process), with round robin and
with the default policy; the same requests replay in the DES through `GatewayRouter`, and both
rows print side by side. Times are simulated seconds (wall x speedup).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
import orjson

from bench.routing_routers import GatewayRouter
from gateway import Config, parse_config
from gateway.demo import serving, simulated_fleet
from simulator import workloads as text_workloads
from simulator.config import build_config
from simulator.des import Cluster, chat_requests, run
from simulator.stats import percentile
from simulator.workloads import WorkItem

MODEL = "qwen2.5-14b"
HTTP_REQUESTS = 400
SPEEDUP = 1.0  # low enough that one CPU runs 8 replicas and the other the gateway and client


def text_items(spec: Any, n: int, seed: int) -> list[WorkItem]:
    """The workload's twin in chat text, same parameters (simulator.workloads)."""
    params = dict(spec.params)
    name = spec.generate.__name__
    if name == "multi_turn":
        turns = params.pop("turns", 8)
        params.pop("systems", None)
        return text_workloads.multi_turn(
            max(1, n // turns), turns=turns, rate=spec.rate / turns, seed=seed, **params
        )
    if name == "trace":
        raise SystemExit("--http: the trace is not replayed over HTTP (60 KB of text a request)")
    gen = getattr(text_workloads, name)
    return list(gen(n, rate=spec.rate, seed=seed, **params))


def summarize(
    ttft: Sequence[float],
    tpot: Sequence[float],
    prompt: int,
    hit: int,
    out_tokens: int,
    span_s: float,
    busy: Sequence[float],
    errors: int = 0,
) -> dict[str, float]:
    mean_busy = sum(busy) / len(busy) if busy else 0.0
    return {
        "hit_ratio": hit / prompt if prompt else 0.0,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "tpot_p50": percentile(tpot, 50),
        "tpot_p99": percentile(tpot, 99),
        "throughput_tok_s": out_tokens / span_s if span_s > 0 else 0.0,
        "imbalance": max(busy) / mean_busy if mean_busy > 0 else 1.0,
        "errors": errors,
    }


async def des_row(
    items: Sequence[WorkItem], policy: str, seed: int, engine: dict[str, Any]
) -> dict[str, float]:
    cluster = Cluster(8, seed=seed, **engine)
    cfg = cluster.config
    router = GatewayRouter(policy, 8, seed=seed, kv_tokens=cfg.num_blocks * cfg.block_size)
    result = await run(chat_requests(items), cluster, router, scrape_interval_s=1.0)
    recs = result.records
    s = result.summary()
    return summarize(
        [r.ttft_s for r in recs],
        [r.tpot_s for r in recs if r.output_tokens > 1],
        sum(r.prompt_tokens for r in recs),
        sum(r.cached_tokens for r in recs),
        sum(r.output_tokens for r in recs),
        s["makespan_s"],
        result.busy_s,
    )


def simulator_args(speedup: float, seed: int, engine: dict[str, Any]) -> list[str]:
    return [
        "--speedup", str(speedup), "--seed", str(seed),
        "--model", engine["model"], "--gpu", engine["gpu"],
        "--gpu-memory-utilization", str(engine.get("gpu_memory_utilization", 0.9)),
    ]  # fmt: skip


def gateway_config(urls: Sequence[str], policy: str, speedup: float, kv_tokens: int) -> Config:
    """The gateway for the run: scrapes every simulated second, like the DES."""
    return parse_config(
        {
            "pools": {
                "bench": {
                    "replicas": list(urls),
                    "policy": policy,
                    "capacity_blocks": kv_tokens // 16,  # index blocks of 16 tokens
                    "scrape": {"interval_s": 1.0 / speedup, "stale_after_s": 5.0 / speedup},
                }
            }
        }
    )


async def _one(
    session: aiohttp.ClientSession, url: str, item: WorkItem
) -> tuple[float, float] | None:
    """(wall seconds to the first chunk, to the last chunk) of one streamed request."""
    body = {"model": MODEL, "messages": list(item.messages), "max_tokens": item.max_tokens,
            "stream": True}  # fmt: skip
    t0 = time.perf_counter()
    first = last = None
    try:
        async with session.post(
            url + "/v1/chat/completions",
            data=orjson.dumps(body),
            headers={"content-type": "application/json"},
        ) as res:
            if res.status != 200:
                await res.read()
                return None
            async for chunk in res.content.iter_any():
                now = time.perf_counter() - t0
                if first is None and b'"content"' in chunk:
                    first = now
                if b'"content"' in chunk:
                    last = now
    except aiohttp.ClientError:
        return None
    return None if first is None or last is None else (first, last)


async def http_row(
    items: Sequence[WorkItem], policy: str, speedup: float, seed: int, engine: dict[str, Any]
) -> dict[str, float]:
    kv_tokens = build_config(**engine).num_blocks * 16
    async with (
        simulated_fleet(8, *simulator_args(speedup, seed, engine)) as urls,
        serving(gateway_config(urls, policy, speedup, kv_tokens)) as gw,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session,
    ):
        times: list[tuple[float, float, int]] = []
        errors = 0
        start = time.perf_counter()

        async def fire(item: WorkItem) -> None:
            nonlocal errors
            delay = item.arrival_s / speedup - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            got = await _one(session, gw, item)
            if got is None:
                errors += 1
            else:
                times.append((got[0], got[1], item.max_tokens))

        await asyncio.gather(*(fire(w) for w in items))
        span = (time.perf_counter() - start - items[0].arrival_s / speedup) * speedup
        prompt = hit = 0
        busy: list[float] = []
        for u in urls:
            async with session.get(u + "/sim/stats") as res:
                st = await res.json()
            prompt += int(st["prompt_tokens"])
            hit += int(st["prefix_hit_tokens"])
            busy.append(float(st["busy_time_s"]))
    return summarize(
        [f * speedup for f, _, _ in times],
        [(last - f) / (n - 1) * speedup for f, last, n in times if n > 1],
        prompt,
        hit,
        sum(n for _, _, n in times),
        span,
        busy,
        errors,
    )


def table(rows: Sequence[tuple[str, str, dict[str, float]]]) -> str:
    lines = [
        "| policy | mode | hit | TTFT p50 (s) | TTFT p99 (s) | TPOT p50 (ms) | TPOT p99 (ms) | "
        "out tok/s | imbalance | errors |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for policy, mode, s in rows:
        lines.append(
            f"| {policy} | {mode} | {s['hit_ratio']:.3f} | {s['ttft_p50']:.3f} | "
            f"{s['ttft_p99']:.3f} | {s['tpot_p50'] * 1e3:.0f} | {s['tpot_p99'] * 1e3:.0f} | "
            f"{s['throughput_tok_s']:.0f} | {s['imbalance']:.2f} | {int(s['errors'])} |"
        )
    return "\n".join(lines)


async def http_main(spec: Any, args: argparse.Namespace) -> int:
    os.environ.setdefault("OTEL_TRACES_EXPORTER", "none")
    n = args.requests or (150 if args.quick else HTTP_REQUESTS)
    items = text_items(spec, n, args.seed)
    policies = ["round_robin", args.default]
    rows: list[tuple[str, str, dict[str, float]]] = []
    for policy in policies:
        t = time.perf_counter()
        rows.append((policy, "DES", await des_row(items, policy, args.seed, spec.engine)))
        rows.append((policy, "HTTP", await http_row(items, policy, SPEEDUP, args.seed,
                                                     spec.engine)))  # fmt: skip
        print(f"{policy}: {time.perf_counter() - t:.0f}s", file=sys.stderr, flush=True)
    print(
        f"{spec.name} over HTTP: {len(items)} chat requests, python -m simulator (8 replicas, "
        f"speedup {SPEEDUP:g}) behind the gateway app, vs the same requests in the DES; "
        f"simulated seconds.\n"
    )
    print(table(rows))
    des = {p: s for p, m, s in rows if m == "DES"}
    web = {p: s for p, m, s in rows if m == "HTTP"}
    a, b = policies
    for mode, got in (("DES", des), ("HTTP", web)):
        print(
            f"{mode}: {b} vs {a}: TTFT P99 {got[b]['ttft_p99'] / got[a]['ttft_p99']:.2f}x, "
            f"hit ratio {got[b]['hit_ratio']:.3f} vs {got[a]['hit_ratio']:.3f}"
        )
    return 0
