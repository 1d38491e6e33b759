"""`gateway demo`: 4 simulated replicas, the gateway on embedded defaults, one shared-prefix workload
replayed through it with round robin and with the default policy, and the comparison printed.

The one gateway module that imports the simulator: the demo composes the two, and `gateway demo`
imports it only when it runs (its load client is aiohttp, the `demo` extra). Times are simulated
seconds (wall time × the simulator's speedup), what the same run would take on the GPUs the
simulator models.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass

import aiohttp
import orjson
import uvicorn

from gateway import Config, create_app, parse_config
from gateway.http.app import GatewayApp
from policies.registry import DEFAULT_POLICY
from simulator.fleet import simulated_fleet
from simulator.replica import serve
from simulator.workloads import WorkItem, shared_prompts

SIM_ARGS = [
    "--model",
    "qwen2.5-14b",
    "--gpu",
    "a100-80g",
    "--tensor-parallel-size",
    "1",
    "--gpu-memory-utilization",
    "0.52",
]  # ~60K tokens of KV per replica (`gateway plan`): the working set below exceeds one, fits four


@dataclass
class DemoRun:
    """One policy's run of the demo workload: first-token times, errors, the replicas' hits."""

    policy: str
    ttft_s: list[float]
    errors: int
    wall_s: float
    prompt_tokens: int
    hit_tokens: int
    speedup: float

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def pct(self, q: float) -> float:
        xs = sorted(self.ttft_s)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    @property
    def throughput(self) -> float:
        """Completed requests per simulated second."""
        return len(self.ttft_s) / (self.wall_s * self.speedup)


def _demo_config(urls: Sequence[str], policy: str) -> Config:
    return parse_config(
        {
            "server": {"host": "127.0.0.1", "port": 0},
            "pools": {
                "demo": {
                    "replicas": list(urls),
                    "policy": policy,
                    "health": {"interval_s": 1},
                    "scrape": {"interval_s": 0.25},
                }
            },
        }
    )


@contextlib.asynccontextmanager
async def _serving(app: GatewayApp, port: int) -> AsyncIterator[str]:
    """The gateway served on 127.0.0.1:`port` (0: a free one) in this event loop, its lifespan on;
    yields its URL once it listens (within 15 s). Signals stay with `asyncio.run`; no logging
    config, no access log, two seconds of graceful shutdown on the way out."""
    server, task = await serve(uvicorn.Config(
        app, host="127.0.0.1", port=port, lifespan="on", log_config=None, access_log=False,
        loop="none", http="httptools", timeout_graceful_shutdown=2,
    ))  # fmt: skip
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.exit()
        await task


async def stream_chat(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: Mapping[str, str] | None = None,
    on_first: Callable[[], None] | None = None,
) -> int:
    """POST a streamed chat request (`body`, JSON) to `url`/v1/chat/completions and read the answer
    to its end; `on_first()` runs when the first chunk with content arrives. Returns the status
    (the body of a non-200 answer is read and dropped). aiohttp's errors reach the caller. The
    demo's load client; bench/admission.py's too."""
    async with session.post(
        url + "/v1/chat/completions",
        data=body,
        headers={"content-type": "application/json", **(headers or {})},
    ) as res:
        if res.status != 200:
            await res.read()
            return res.status
        async for chunk in res.content.iter_any():
            if on_first is not None and b'"content"' in chunk:
                on_first()
                on_first = None
        return 200


async def _one(h: aiohttp.ClientSession, url: str, item: WorkItem, model: str) -> float | None:
    """Wall seconds to the first content chunk of a streamed answer; None for an error."""
    body = {
        "model": model,
        "messages": list(item.messages),
        "max_tokens": item.max_tokens,
        "stream": True,
    }
    t0 = time.perf_counter()
    ttft: list[float] = []
    try:
        status = await stream_chat(
            h, url, orjson.dumps(body), on_first=lambda: ttft.append(time.perf_counter() - t0)
        )
    except aiohttp.ClientError:
        return None
    return ttft[0] if status == 200 and ttft else None


async def run_policy(
    policy: str,
    items: Sequence[WorkItem],
    speedup: float,
    replicas: int,
    show: bool,
    port: int = 0,
    replica_port: int = 0,
) -> DemoRun:
    ttfts: list[float] = []
    errors = 0
    tty = sys.stdout.isatty()
    step = 10 if tty else max(1, len(items) // 4)  # a pipe gets a few lines, a terminal one
    sim_args = ("--speedup", str(speedup), *SIM_ARGS)
    async with (
        simulated_fleet(replicas, *sim_args, port=replica_port) as urls,
        _serving(create_app(_demo_config(urls, policy)), port) as gw_url,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as h,
    ):
        if show:
            print(f"  {policy}: gateway {gw_url}, replicas {' '.join(urls)}", flush=True)
        t_start = time.perf_counter()

        async def fire(item: WorkItem) -> None:
            nonlocal errors
            delay = item.arrival_s / speedup - (time.perf_counter() - t_start)
            if delay > 0:
                await asyncio.sleep(delay)
            ttft = await _one(h, gw_url, item, "qwen2.5-14b")
            if ttft is None:
                errors += 1
            else:
                ttfts.append(ttft * speedup)
            done = len(ttfts) + errors
            if show and (done % step == 0 or done == len(items)):
                xs = sorted(ttfts)
                p50 = xs[len(xs) // 2] if xs else 0.0
                line = f"  {policy:<14} {done:>4}/{len(items)} requests   TTFT p50 {p50 * 1000:7.0f} ms"
                print("\r" + line if tty else line, end="" if tty else "\n", flush=True)

        await asyncio.gather(*(fire(w) for w in items))
        wall = time.perf_counter() - t_start
        prompt = hits = 0
        for u in urls:
            async with h.get(u + "/sim/stats") as res:
                st = await res.json()
            prompt += int(st["prompt_tokens"])
            hits += int(st["prefix_hit_tokens"])
    if show and tty:
        print()
    return DemoRun(policy, ttfts, errors, wall, prompt, hits, speedup)


def workload(n: int, seed: int) -> list[WorkItem]:
    # 24 system prompts of 3-5K tokens (~96K tokens of shared prefix) with short user turns
    return shared_prompts(
        n,
        k=24,
        rate=3.0,
        prompt_tokens=(3000, 5000),
        user_tokens=(20, 80),
        max_tokens=32,
        seed=seed,
    )


def format_table(results: Sequence[DemoRun]) -> str:
    lines = [
        f"{'policy':<14} {'hit ratio':>9} {'TTFT p50':>10} {'TTFT p99':>10} {'req/s':>7} {'errors':>6}"
    ]
    for r in results:
        lines.append(
            f"{r.policy:<14} {r.hit_ratio:>9.2f} {r.pct(0.5) * 1000:>8.0f}ms {r.pct(0.99) * 1000:>8.0f}ms "
            f"{r.throughput:>7.2f} {r.errors:>6}"
        )
    if len(results) == 2 and results[1].pct(0.5) > 0:
        a, b = results
        lines.append(
            f"\n{b.policy} vs {a.policy}: hit ratio {b.hit_ratio:.2f} vs {a.hit_ratio:.2f}, "
            f"TTFT p50 {a.pct(0.5) / b.pct(0.5):.1f}x lower, p99 {a.pct(0.99) / b.pct(0.99):.1f}x lower"
        )
    return "\n".join(lines)


async def demo(
    requests: int = 300,
    speedup: float = 5.0,
    replicas: int = 4,
    seed: int = 0,
    policies: Sequence[str] = ("round_robin", DEFAULT_POLICY),
    port: int = 0,
    replica_port: int = 0,
) -> list[DemoRun]:
    """`port`: the gateway's (0: any free one); `replica_port`: replica i's is this + i."""
    items = workload(requests, seed)
    show = True
    print(
        f"demo: {replicas} simulated replicas (qwen2.5-14b on A100-80G, ~64K tokens of KV each), "
        f"{requests} chat requests sharing 24 system prompts of 3-5K tokens, simulator speedup {speedup:g}x"
    )
    results = [
        await run_policy(p, items, speedup, replicas, show, port, replica_port) for p in policies
    ]
    print()
    print(format_table(results))
    print("\n(times are simulated seconds: what these requests would see on the modelled GPUs)")
    return results


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="gateway demo")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--speedup", type=float, default=8.0)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=0, help="the gateway's port (0: any free one)")
    p.add_argument("--replica-port", type=int, default=0,
                   help="replica i listens on this + i (0: any free ports)")  # fmt: skip
    args = p.parse_args(argv)
    os.environ.setdefault("OTEL_TRACES_EXPORTER", "none")
    asyncio.run(demo(args.requests, args.speedup, args.replicas, args.seed,
                     port=args.port, replica_port=args.replica_port))  # fmt: skip
    return 0
