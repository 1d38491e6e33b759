"""Scale-out: 1, 2 and 4 `gateway --config` processes in front of one simulated fleet, with the
fleet's shared load and learning on and off, and what sharing costs per request.

    .venv/bin/python -m bench.scaleout               # both workloads x5, then the cost, ~12 min
    .venv/bin/python -m bench.scaleout --workloads system --no-cost --repeat 2    # ~2 min

Part 1, routing: for each workload (`trace`: the public Mooncake trace; `system`: the shared
system-prompt workload; the exact client bodies of bench.shapes) and each setup (1 gateway; 2 and
4 with `fleet.shared_load` on; 2 and 4 with it off) a fresh `python -m simulator` fleet (4
replicas, cold caches, the profiles bench.routing_http uses) and fresh gateway processes sharing
the Redis index; the client sends request i to gateway i mod N at the workload's arrival times,
streamed. TTFT is the first content chunk (simulated seconds); hit ratio = cached / prompt tokens
from each answer's usage; gateway CPU is the gateway processes' CPU over one replay, summed over
the gateways (the mean of the runs): on 2 shared cores it is also CPU the simulated replicas
wait for. Each run gets its own model name and fleet name, so Redis holds nothing of another
run. The shared-load tick is the default `fleet.publish_interval_ms` of wall time (`--tick-ms`
sets it in simulated ms), so the gateways spend on it what they would in production; pushes
carry the load between ticks, 2 ms of wall time (6 simulated) after a change. Speedup 3: on 2
shared cores, the time a process waits for a core counts 3x in simulated seconds.

Part 2, cost: one gateway before bench.zero_upstream, closed loop, shared load on vs off: its CPU
per request, and idle, its CPU per tick and the round trips per second (one per tick).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from bench.harness import free_port, stop_processes
from bench.routing_http import RUNS, Record, build, kv_tokens, send, simulator_args
from bench.shapes import ShapedRequest
from gateway.config.sections import FleetConfig
from simulator.fleet import simulated_fleet
from simulator.stats import percentile

ROOT = Path(__file__).resolve().parent.parent
REDIS = "redis://127.0.0.1:6379/0"
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
SETUPS = [(1, True), (2, True), (4, True), (2, False), (4, False)]  # (gateways, sharing)
REPLICAS = 4
SPEEDUP = 3.0  # lower than bench.routing_http: every ms a process waits for a core counts 3x


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


# --- gateway processes -----------------------------------------------------------------------
def default_tick_ms(speedup: float) -> float:
    """The config's default tick of wall time, in simulated ms."""
    return FleetConfig().publish_interval_ms * speedup


def gateway_config(port: int, urls: Sequence[str], model: str, sharing: bool, fleet: str,
                   speedup: float, kv: int, tick_ms: float | None = None) -> dict[str, Any]:  # fmt: skip
    tick_ms = default_tick_ms(speedup) if tick_ms is None else tick_ms
    return {
        "server": {"host": "127.0.0.1", "port": port, "log_level": "warning",
                   "expose_upstream_errors": True},  # fmt: skip
        "pools": {
            "bench": {
                "replicas": [{"url": u, "name": f"r{i}"} for i, u in enumerate(urls)],
                "policy": "ttft",
                "capacity_blocks": max(1, kv // 16),
                "max_inflight_per_replica": 4096,
                "scrape": {"interval_s": 1.0 / speedup, "stale_after_s": 5.0 / speedup},
            }
        },
        "routes": [{"match": {"model": model}, "pool": "bench"}],
        "index": {"backend": "redis", "redis_url": REDIS},
        # tick_ms of simulated time between ticks, as the scrape interval is 1 simulated second
        "fleet": {"shared_load": sharing, "name": fleet,
                  "publish_interval_ms": max(1.0, tick_ms / speedup)},  # fmt: skip
    }


def start_gateway(tmp: Path, **cfg: Any) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    path = tmp / f"gw-{port}.yaml"
    path.write_text(yaml.safe_dump(gateway_config(port, **cfg)))
    with open(tmp / f"gw-{port}.log", "wb") as out:
        p = subprocess.Popen([sys.executable, "-m", "gateway", "--config", str(path)],
                             stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)  # fmt: skip
    return p, f"http://127.0.0.1:{port}"


def start_upstream() -> tuple[subprocess.Popen[bytes], list[str]]:
    up = subprocess.Popen([sys.executable, "-m", "bench.zero_upstream", "--ports", "4"],
                          stdout=subprocess.PIPE, cwd=ROOT)  # fmt: skip
    assert up.stdout is not None
    return up, [f"http://127.0.0.1:{p}" for p in orjson.loads(up.stdout.readline())["ports"]]


@contextlib.asynccontextmanager
async def gateways(n: int, tmp: Path, **cfg: Any) -> Any:
    """`n` gateway processes with this config; yields [(process, url)] once all are ready."""
    procs = []
    try:
        for _ in range(n):
            procs.append(start_gateway(tmp, **cfg))
        await wait_ready(procs)
        yield procs
    finally:
        stop_processes([p for p, _ in procs])


async def wait_ready(gws: Sequence[tuple[Any, str]], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as h:
        for p, url in gws:
            while True:
                if p.poll() is not None:
                    raise RuntimeError(f"gateway {url} exited with {p.returncode}")
                with contextlib.suppress(aiohttp.ClientError):
                    async with h.get(url + "/ready") as r:
                        if r.status == 200:
                            break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"gateway {url} not ready")
                await asyncio.sleep(0.1)


# --- part 1: routing -------------------------------------------------------------------------
@dataclasses.dataclass
class Row:
    workload: str
    gateways: int
    sharing: bool
    records: list[Record]
    errors: list[str]
    cpu_s: list[float] = dataclasses.field(default_factory=list)  # the gateways' CPU, per run

    def fig(self) -> dict[str, float]:
        ttft = [r.ttft_s for r in self.records]
        prompt = sum(r.prompt_tokens for r in self.records)
        return {
            "ttft_mean": statistics.fmean(ttft) if ttft else math.nan,
            "ttft_p99": percentile(ttft, 99),
            "hit": sum(r.cached_tokens for r in self.records) / prompt if prompt else 0.0,
            "errors": float(len(self.errors)),
            "cpu_s": statistics.fmean(self.cpu_s) if self.cpu_s else math.nan,
        }


async def replay(gws: Sequence[str], shaped: Sequence[ShapedRequest], model: str,
                 speedup: float) -> tuple[list[Record], list[str]]:  # fmt: skip
    tpb = 64 / 4  # bytes mode: 64-byte blocks of ~4 bytes a token
    records: list[Record] = []
    errors: list[str] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as session:
        start = time.perf_counter()

        async def fire(i: int, req: ShapedRequest) -> None:
            delay = req.arrival_s / speedup - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            mine = dataclasses.replace(req, body={**req.body, "model": model})
            got = await send(session, gws[i % len(gws)], mine, speedup, tpb)
            (records if isinstance(got, Record) else errors).append(got)  # type: ignore[arg-type]

        await asyncio.gather(*(fire(i, r) for i, r in enumerate(shaped)))
    return records, errors


async def routing(args: argparse.Namespace, tmp: Path) -> list[Row]:
    """Every setup of every workload, `--repeat` times in turn (so a busy spell of the machine
    falls on all setups alike); a setup's figures pool the records of its repeats."""
    rows: dict[tuple[str, int, bool], Row] = {}
    for workload in args.workloads:
        run = RUNS[workload]
        shaped, _, skipped = build(workload, args.requests, args.seed)
        for rep in range(args.repeat):
            for n, sharing in args.setups:
                model = f"scaleout-{uuid.uuid4().hex[:8]}"
                sim = [*simulator_args(args.speedup, args.seed, run.engine),
                       "--served-model-name", model]  # fmt: skip
                async with simulated_fleet(REPLICAS, *sim) as urls, gateways(
                    n, tmp, urls=urls, model=model, sharing=sharing, fleet=model,
                    speedup=args.speedup, kv=kv_tokens(run.engine), tick_ms=args.tick_ms,
                ) as gws:  # fmt: skip
                    t0 = time.perf_counter()
                    cpu0 = sum(proc_cpu_s(p.pid) for p, _ in gws)
                    recs, errs = await replay([u for _, u in gws], shaped, model, args.speedup)
                    cpu = sum(proc_cpu_s(p.pid) for p, _ in gws) - cpu0
                one = Row(workload, n, sharing, recs, errs, [cpu])
                f = one.fig()
                log(f"{workload:<7} #{rep + 1} {n} gw sharing {label(one):<3} "
                    f"{time.perf_counter() - t0:5.1f}s  TTFT mean {f['ttft_mean']:.3f} "
                    f"p99 {f['ttft_p99']:.3f}  hit {f['hit']:.3f}  gateway CPU {cpu:.2f}s  "
                    f"errors {len(errs)}"
                    + (f"  ({skipped} over max_model_len skipped)" if skipped else ""))  # fmt: skip
                for e in errs[:3]:
                    log(f"    error: {e}")
                row = rows.setdefault((workload, n, sharing), Row(workload, n, sharing, [], []))
                row.records += recs
                row.errors += errs
                row.cpu_s.append(cpu)
    return list(rows.values())


def label(r: Row) -> str:
    return "-" if r.gateways == 1 else "on" if r.sharing else "off"


def routing_table(rows: Sequence[Row]) -> str:
    lines = [
        "| workload | gateways | sharing | TTFT mean (s) | TTFT p99 (s) | hit | mean vs 1 | "
        "p99 vs 1 | hit vs 1 | errors | gateway CPU (s) | goal (<= 1.10x, >= 0.90) |",
        "| --- | ---: | --- |" + " ---: |" * 8 + " --- |",
    ]
    for r in rows:
        one = next(x for x in rows if x.workload == r.workload and x.gateways == 1).fig()
        f = r.fig()
        vs = [f["ttft_mean"] / one["ttft_mean"], f["ttft_p99"] / one["ttft_p99"],
              f["hit"] / one["hit"] if one["hit"] else math.nan]  # fmt: skip
        goal = "" if r.gateways == 1 else (
            "PASS" if vs[0] <= 1.10 and vs[1] <= 1.10 and vs[2] >= 0.90 else "FAIL")  # fmt: skip
        lines.append(
            f"| {r.workload} | {r.gateways} | {label(r)} | "
            f"{f['ttft_mean']:.3f} | {f['ttft_p99']:.3f} | {f['hit']:.3f} | {vs[0]:.2f}x | "
            f"{vs[1]:.2f}x | {vs[2]:.2f} | {int(f['errors'])} | {f['cpu_s']:.2f} | {goal} |"
        )
    return "\n".join(lines)


# --- part 2: what sharing costs ----------------------------------------------------------------
async def metric(h: aiohttp.ClientSession, url: str, name: str) -> float:
    async with h.get(url + "/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


async def cost_one(urls: list[str], sharing: bool, tmp: Path,
                   args: argparse.Namespace) -> dict[str, float]:  # fmt: skip
    model = f"cost-{uuid.uuid4().hex[:8]}"
    body = orjson.dumps({"model": model, "max_tokens": 16, "messages": [
        {"role": "system", "content": "You are a careful assistant. " * 30},
        {"role": "user", "content": "Say something."}]})  # fmt: skip
    async with gateways(1, tmp, urls=urls, model=model, sharing=sharing, fleet=model,
                        speedup=1.0, kv=1 << 20) as gws, aiohttp.ClientSession() as h:  # fmt: skip
        (proc, url), = gws
        ticks0, c0, t0 = await metric(h, url, "gateway_fleet_ticks_total"), proc_cpu_s(proc.pid), time.perf_counter()
        await asyncio.sleep(args.idle_s)
        idle_s = time.perf_counter() - t0
        idle_cpu = proc_cpu_s(proc.pid) - c0
        ticks = await metric(h, url, "gateway_fleet_ticks_total") - ticks0
        done = 0
        stop = time.perf_counter() + args.load_s
        headers = {"content-type": "application/json"}

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < stop:
                async with h.post(url + "/v1/chat/completions", data=body, headers=headers) as r:
                    await r.read()
                    done += r.status == 200

        ticks1 = await metric(h, url, "gateway_fleet_ticks_total")
        pushes1 = await metric(h, url, "gateway_fleet_pushes_sent_total")
        c1, t1 = proc_cpu_s(proc.pid), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(16)))
        busy_cpu, busy_s = proc_cpu_s(proc.pid) - c1, time.perf_counter() - t1
        busy_ticks = await metric(h, url, "gateway_fleet_ticks_total") - ticks1
        pushes = await metric(h, url, "gateway_fleet_pushes_sent_total") - pushes1
    return {"idle_cpu_per_s": idle_cpu / idle_s, "ticks_per_s": ticks / idle_s,
            "busy_ticks_per_s": busy_ticks / busy_s, "rps": done / busy_s,
            "pushes_per_s": pushes / busy_s,
            "cpu_us_per_req": busy_cpu / max(done, 1) * 1e6}  # fmt: skip


async def cost(args: argparse.Namespace, tmp: Path) -> str:
    up, urls = start_upstream()
    try:
        off = await cost_one(urls, False, tmp, args)
        on = await cost_one(urls, True, tmp, args)
    finally:
        stop_processes([up])
    tick_us = (on["idle_cpu_per_s"] - off["idle_cpu_per_s"]) / max(on["ticks_per_s"], 1e-9) * 1e6
    lines = [
        "| shared load | idle CPU (% core) | round trips/s idle | loaded | pushes/s loaded | "
        "req/s | CPU per request (µs) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, c in (("off", off), ("on", on)):
        lines.append(f"| {name} | {c['idle_cpu_per_s'] * 100:.1f} | {c['ticks_per_s']:.0f} | "
                     f"{c['busy_ticks_per_s']:.0f} | {c['pushes_per_s']:.0f} | {c['rps']:.0f} | "
                     f"{c['cpu_us_per_req']:.0f} |")  # fmt: skip
    per_req = tick_us * on["busy_ticks_per_s"] / max(on["rps"], 1)
    lines.append(
        f"\nper tick: {tick_us:.0f} µs of CPU (idle difference / idle ticks, wake-up included); "
        f"at {on['rps']:.0f} req/s and {on['busy_ticks_per_s']:.0f} ticks/s that is "
        f"{per_req:.1f} µs per request; "
        f"measured under load: {on['cpu_us_per_req'] - off['cpu_us_per_req']:+.0f} µs per request "
        "(noisy on a shared machine). One Redis round trip per tick and one PUBLISH per push "
        "(at most one per push_interval_ms, only when the figures changed), none on the "
        "request path."
    )
    return "\n".join(lines)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def amain(args: argparse.Namespace) -> int:
    os.environ.setdefault("OTEL_TRACES_EXPORTER", "none")
    t = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-scaleout-") as d:
        rows = await routing(args, Path(d)) if args.workloads else []
        costs = await cost(args, Path(d)) if not args.no_cost else ""
    print(f"$ .venv/bin/python -m bench.scaleout {' '.join(sys.argv[1:])}".rstrip())
    print(f"{os.cpu_count()} CPUs; python -m simulator, {REPLICAS} replicas, speedup "
          f"{args.speedup:g}, seed {args.seed}; {args.requests} requests per workload run, "
          f"{args.repeat} run(s) per setup pooled; shared-load tick {args.tick_ms:g} simulated "
          f"ms; policy "
          f"ttft, Redis index; simulated seconds; took {time.perf_counter() - t:.0f} s\n")  # fmt: skip
    if rows:
        print(routing_table(rows))
    if costs:
        print(f"\nShared-load cost (one gateway, 4 zero-latency upstream ports, 16 clients, "
              f"{args.load_s:g} s loaded, {args.idle_s:g} s idle):\n")  # fmt: skip
        print(costs)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scaleout", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--workloads", nargs="*", default=["trace", "system"], choices=list(RUNS))
    p.add_argument("--requests", type=int, default=140, help="requests per workload run")
    p.add_argument("--repeat", type=int, default=5,
                   help="runs of every setup, pooled (one run's mean moves by ~10 %%, its trace "
                   "P99, the 2nd-largest of 140 TTFTs, by ~8 %%: 3 runs left a verdict near 1.10x "
                   "to chance)")
    p.add_argument("--speedup", type=float, default=SPEEDUP)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tick-ms", type=float, default=None,
                   help="simulated ms between shared-load ticks (default: the default "
                   "fleet.publish_interval_ms of wall time)")
    p.add_argument("--setups", nargs="*", default=None, metavar="N:on|off",
                   help="gateway setups of part 1 (default: 1:on 2:on 4:on 2:off 4:off)")
    p.add_argument("--no-cost", action="store_true", help="skip part 2")
    p.add_argument("--idle-s", type=float, default=8.0)
    p.add_argument("--load-s", type=float, default=5.0)
    args = p.parse_args(argv)
    if args.tick_ms is None:
        args.tick_ms = default_tick_ms(args.speedup)
    args.setups = SETUPS if args.setups is None else [
        (int(n), on == "on") for n, on in (s.split(":") for s in args.setups)]  # fmt: skip
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
