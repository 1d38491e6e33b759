"""Admission control under overload: interactive TTFT and batch throughput, with and without it.

A simulated fleet (2 replicas of qwen2.5-14b on A100-80G) gets a Poisson mix of an interactive
tenant (20%: short prompts, streaming) and a batch tenant (80%: long prompts, long outputs) at
1.5x the fleet's measured capacity, through the real gateway, twice:

  on   priority classes (interactive rank 0, batch rank 1) and a small `max_inflight_per_replica`,
       so excess requests wait in the gateway's queue, interactive first;
  off  the same tenants and classes, but `max_inflight_per_replica` huge: every request goes
       straight to the engines, which queue FCFS.

`max_inflight_per_replica` 32 is about what the KV cache holds of this batch mix per replica
(~63K tokens / ~2.6K per request ~ 24-32): at 16 the engines run under-full and batch throughput
drops to ~0.83 of off.

Capacity is measured first with a closed loop (the same mix, 64 requests in flight per replica,
straight at the simulator). Tenants are identified by API key (`auth: required`).
Times and rates are simulated seconds (wall x speedup).

    .venv/bin/python -m bench.admission          # ~90 s
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp
import orjson

from bench.harness import serving
from gateway import create_app, parse_config
from gateway.demo import stream_chat
from simulator.fleet import simulated_fleet
from simulator.workloads import text

MODEL = "qwen2.5-14b"
SIM_ARGS = [
    "--model", MODEL,
    "--gpu", "a100-80g",
    "--tensor-parallel-size", "1",
    "--gpu-memory-utilization", "0.6",
]  # fmt: skip
KEYS = {"interactive": "sk-bench-interactive", "batch": "sk-bench-batch"}


@dataclass(frozen=True, slots=True)
class Req:
    arrival_s: float  # simulated
    tenant: str  # "interactive" | "batch"
    prompt: str
    max_tokens: int


def make_req(rng: random.Random, i: int, arrival_s: float, interactive_share: float) -> Req:
    if rng.random() < interactive_share:
        return Req(arrival_s, "interactive", text(f"ia-{i}", rng.randint(100, 400)), 64)
    return Req(arrival_s, "batch", text(f"ba-{i}", rng.randint(1500, 3000)), rng.randint(256, 512))


@dataclass
class Result:
    name: str
    sim_s: float
    ttft: list[float] = field(default_factory=list)  # interactive, simulated s
    censored: int = 0  # interactive still without a first token at the end (counted at elapsed)
    batch_done: int = 0
    batch_tokens: int = 0
    shed: dict[str, int] = field(default_factory=lambda: {"interactive": 0, "batch": 0})
    errors: int = 0
    sent: dict[str, int] = field(default_factory=lambda: {"interactive": 0, "batch": 0})

    def pct(self, q: float) -> float:
        xs = sorted(self.ttft)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    @property
    def batch_rps(self) -> float:
        return self.batch_done / self.sim_s

    @property
    def batch_tps(self) -> float:
        return self.batch_tokens / self.sim_s


def gateway_config(urls: Sequence[str], max_inflight: int) -> dict:
    return {
        "server": {"host": "127.0.0.1", "port": 0},
        "auth": "required",
        # queue waits are gateway wall seconds (x speedup in simulated time)
        "priority_classes": {
            "interactive": {"rank": 0, "max_queue_wait_s": 30, "max_queue_len": 10000},
            "batch": {"rank": 1, "max_queue_wait_s": 3600, "max_queue_len": 100000},
        },
        "tenants": [
            {"name": "chat", "api_keys": [KEYS["interactive"]], "priority": "interactive"},
            {"name": "etl", "api_keys": [KEYS["batch"]], "priority": "batch"},
        ],
        "pools": {
            "bench": {
                "replicas": list(urls),
                "max_inflight_per_replica": max_inflight,
                "health": {"interval_s": 1},
                "scrape": {"interval_s": 0.25},
                "timeouts": {"first_byte_s": 600, "total_s": 3600},
            }
        },
    }


async def send(h: aiohttp.ClientSession, base: str, r: Req, res: Result, speedup: float) -> None:
    stream = r.tenant == "interactive"
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": r.prompt}],
        "max_tokens": r.max_tokens,
        "stream": stream,
    }
    headers = {"authorization": f"Bearer {KEYS[r.tenant]}"}
    res.sent[r.tenant] += 1
    t0 = time.perf_counter()
    got_first = False

    def first() -> None:
        nonlocal got_first
        res.ttft.append((time.perf_counter() - t0) * speedup)
        got_first = True

    try:
        if stream:
            status = await stream_chat(h, base, orjson.dumps(body), headers, on_first=first)
        else:
            async with h.post(
                base + "/v1/chat/completions",
                data=orjson.dumps(body),
                headers={"content-type": "application/json", **headers},
            ) as resp:
                status, data = resp.status, await resp.read()
            if status == 200:
                res.batch_done += 1
                res.batch_tokens += int(orjson.loads(data)["usage"]["completion_tokens"])
        if status in (429, 503):
            res.shed[r.tenant] += 1
        elif status != 200:
            res.errors += 1
    except asyncio.CancelledError:
        if stream and not got_first:  # still waiting at the end: count its wait so far
            res.ttft.append((time.perf_counter() - t0) * speedup)
            res.censored += 1
        raise
    except aiohttp.ClientError:
        res.errors += 1


async def open_loop(
    name: str, base: str, reqs: Sequence[Req], duration_s: float, speedup: float
) -> Result:
    """Fire `reqs` at their arrival times for `duration_s` simulated seconds, then cut off."""
    res = Result(name, duration_s)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
    ) as h:
        t0 = time.perf_counter()
        tasks: list[asyncio.Task[None]] = []
        for r in reqs:
            if r.arrival_s >= duration_s:
                break
            delay = r.arrival_s / speedup - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(h, base, r, res, speedup)))
        rest = duration_s / speedup - (time.perf_counter() - t0)
        if rest > 0:
            await asyncio.sleep(rest)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return res


async def capacity(urls: Sequence[str], speedup: float, wall_s: float, share: float) -> float:
    """Closed loop straight at the replicas: completed requests per simulated second."""
    rng = random.Random(1)
    done = 0
    stop = time.perf_counter() + wall_s
    warm = time.perf_counter() + wall_s / 4
    counted = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as h:

        async def worker(url: str, wid: int) -> None:
            nonlocal done, counted
            i = 0
            while time.perf_counter() < stop:
                r = make_req(rng, 10_000_000 + wid * 100_000 + i, 0.0, share)
                i += 1
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": r.prompt}],
                    "max_tokens": r.max_tokens,
                }
                async with h.post(url + "/v1/chat/completions", json=body) as resp:
                    await resp.read()
                if warm <= time.perf_counter() < stop:
                    counted += 1
                done += 1

        tasks = [
            asyncio.create_task(worker(u, w)) for w in range(64) for u in urls
        ]  # 64 per replica
        await asyncio.sleep(wall_s)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return counted / ((wall_s - wall_s / 4) * speedup)


def workload(rate: float, duration_s: float, share: float, seed: int) -> list[Req]:
    rng = random.Random(seed)
    out, t, i = [], 0.0, 0
    while t < duration_s:
        t += rng.expovariate(rate)
        out.append(make_req(rng, i, t, share))
        i += 1
    return out


def table(on: Result, off: Result) -> str:
    rows = [
        f"{'run':<16} {'ia sent':>7} {'ia TTFT p50':>11} {'ia TTFT p99':>11} {'censored':>8} "
        f"{'batch sent':>10} {'batch done/s':>12} {'batch tok/s':>11} {'shed ia/batch':>13} {'errors':>6}"
    ]
    for r in (on, off):
        rows.append(
            f"{r.name:<16} {r.sent['interactive']:>7} {r.pct(0.5):>10.2f}s {r.pct(0.99):>10.2f}s "
            f"{r.censored:>8} {r.sent['batch']:>10} {r.batch_rps:>12.3f} {r.batch_tps:>11.1f} "
            f"{r.shed['interactive']:>6}/{r.shed['batch']:<6} {r.errors:>6}"
        )
    p99 = on.pct(0.99) / off.pct(0.99)
    tput = on.batch_tps / off.batch_tps if off.batch_tps else float("nan")
    rows.append("")
    rows.append(
        f"interactive TTFT p99 on/off: {p99:.3f}  (goal <= 0.3)  {'PASS' if p99 <= 0.3 else 'FAIL'}"
    )
    rows.append(
        f"batch throughput on/off:     {tput:.3f}  (goal >= 0.9)  "
        f"{'PASS' if tput >= 0.9 else 'FAIL'}   (output tokens/s; requests/s: "
        f"{on.batch_rps / off.batch_rps if off.batch_rps else float('nan'):.3f})"
    )
    return "\n".join(rows)


async def main_async(args: argparse.Namespace) -> int:
    sp = args.speedup
    print(
        f"admission bench: {args.replicas} simulated replicas of {MODEL} on A100-80G, "
        f"speedup {sp:g}x, {args.interactive_share:.0%} interactive"
    )
    async with simulated_fleet(args.replicas, "--speedup", str(sp), *SIM_ARGS) as urls:
        cap = await capacity(urls, sp, args.capacity_wall_s, args.interactive_share)
    rate = args.load * cap
    print(
        f"capacity (closed loop, 64/replica): {cap:.3f} req/s simulated -> offered {rate:.3f} req/s"
    )
    duration = args.run_wall_s * sp
    reqs = workload(rate, duration, args.interactive_share, args.seed)
    results = []
    for name, inflight in ((f"on (inflight {args.inflight})", args.inflight), ("off", 100_000)):
        async with (
            simulated_fleet(args.replicas, "--speedup", str(sp), *SIM_ARGS) as urls,
            serving(create_app(parse_config(gateway_config(urls, inflight))), lifespan="on") as gw,
        ):
            r = await open_loop(name, gw.url, reqs, duration, sp)
        print(f"  {name}: done")
        results.append(r)
    print()
    print(table(*results))
    print(
        f"\n(simulated seconds; {duration:.0f} s simulated per run; censored = interactive "
        "requests still without a first token at the cut-off, counted at their wait so far)"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.admission")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--speedup", type=float, default=10.0)
    p.add_argument("--inflight", type=int, default=32, help="max_inflight_per_replica when on")
    p.add_argument("--load", type=float, default=1.5, help="offered load / capacity")
    p.add_argument("--interactive-share", type=float, default=0.2)
    p.add_argument("--capacity-wall-s", type=float, default=12.0)
    p.add_argument("--run-wall-s", type=float, default=35.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    os.environ.setdefault("OTEL_TRACES_EXPORTER", "none")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
