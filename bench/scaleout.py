"""Scale-out: one vs two gateway processes sharing one Redis prefix index, same upstream fleet.

    .venv/bin/python -m bench.scaleout [--seconds 5] [--concurrency 64] [--requests 160]

Part 1, throughput: bench.zero_upstream replicas, an aiohttp closed-loop generator (fixed
concurrency, non-streaming ~2 KB chat bodies over a few shared system prompts). "2 procs" is two
separate `gateway --config` processes on two ports (not `--workers`, so each pid's CPU can be read
from /proc/<pid>/stat); the generator's connections alternate between them.

Part 2, prefix-hit ratio: `python -m simulator --replicas 4 --speedup 20`, restarted before each run
(cold caches), replaying simulator.workloads.shared_prompts at its arrival times; the 2-process run
alternates requests between the two gateways. Hit ratio = sum(prefix_hit_tokens) /
sum(prompt_tokens) over the replicas' GET /sim/stats.

Every run uses a fresh model name, so its Redis index scope does not collide with other runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from simulator.harness import free_port, stop_processes
from simulator.workloads import shared_prompts

ROOT = Path(__file__).resolve().parent.parent
REDIS = "redis://127.0.0.1:6379/0"
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


# --- processes ---------------------------------------------------------------------------------
def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


def machine_busy_s() -> float:
    with open("/proc/stat", "rb") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) * TICK_S


def redis_pid() -> int | None:
    """The local redis-server's pid (read only, for its CPU use), if one is visible."""
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{d}/comm") as f:
                if f.read().strip() == "redis-server":
                    return int(d)
    return None


def gateway_config(port: int, urls: list[str], model: str) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "port": port, "log_level": "warning"},
        "pools": {
            "chat": {
                "replicas": urls,
                "policy": "prefix_aware",
                "max_inflight_per_replica": 4096,
                "health": {"interval_s": 2},
                "scrape": {"interval_s": 1},
            }
        },
        "index": {"backend": "redis", "redis_url": REDIS},
        "routes": [{"match": {"model": model}, "pool": "chat"}],
    }


def start_gateways(n: int, urls: list[str], model: str, tmp: Path) -> list[tuple[Any, str]]:
    out = []
    for _ in range(n):
        port = free_port()
        path = tmp / f"gw-{port}.yaml"
        path.write_text(yaml.safe_dump(gateway_config(port, urls, model)))
        log = open(tmp / f"gw-{port}.log", "wb")  # noqa: SIM115 - lives with the process
        p = subprocess.Popen(
            [sys.executable, "-m", "gateway", "--config", str(path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        out.append((p, f"http://127.0.0.1:{port}"))
    return out


async def wait_ready(gws: list[tuple[Any, str]], timeout_s: float = 30.0) -> None:
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


# --- part 1: throughput ------------------------------------------------------------------------
def bodies(n: int, model: str, prompts: int = 4, size: int = 2048) -> list[bytes]:
    """n ~2 KB chat bodies over `prompts` shared system prompts, a different user turn each."""
    rng = random.Random(1234)
    words = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(8000)).split()
    systems = [
        f"You are assistant #{k}. " + " ".join(rng.choices(words, k=60))[:1000]
        for k in range(prompts)
    ]
    out = []
    for i in range(n):
        body: dict[str, Any] = {
            "model": model,
            "messages": [
                {"role": "system", "content": systems[i % prompts]},
                {"role": "user", "content": f"Question {i}: "},
            ],
            "max_tokens": 64,
            "stream": False,
        }
        room = max(0, size - len(orjson.dumps(body)))
        body["messages"][1]["content"] += " ".join(rng.choices(words, k=80))[:room]
        out.append(orjson.dumps(body))
    return out


@dataclass
class Tput:
    label: str
    rps: float
    errors: int
    p50_ms: float
    cpu: dict[str, float]  # % of one core, per process
    machine: float  # % of all cores

    @property
    def other(self) -> float:
        """Busy CPU (in % of one core) that none of the measured processes used."""
        return self.machine * (os.cpu_count() or 1) - sum(self.cpu.values())


async def throughput(
    label: str, urls: list[str], reqs: list[bytes], pids: dict[str, int], args: argparse.Namespace
) -> Tput:
    done: list[float] = []
    errors = 0
    measuring = False
    stop_at = 0.0
    hdrs = {"content-type": "application/json"}

    async def worker(i: int, h: aiohttp.ClientSession) -> None:
        nonlocal errors
        url = urls[i % len(urls)] + "/v1/chat/completions"  # connections alternate gateways
        k = i
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            try:
                async with h.post(url, data=reqs[k % len(reqs)], headers=hdrs) as r:
                    await r.read()
                    ok = r.status == 200
            except aiohttp.ClientError:
                ok = False
            k += args.concurrency
            if measuring:
                if ok:
                    done.append(time.perf_counter() - t0)
                else:
                    errors += 1

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as h:
        stop_at = time.perf_counter() + 1.0 + args.seconds
        tasks = [asyncio.create_task(worker(i, h)) for i in range(args.concurrency)]
        await asyncio.sleep(1.0)  # warm-up: connections, index
        measuring = True
        c0 = {k: proc_cpu_s(p) for k, p in pids.items()}
        m0, t0 = machine_busy_s(), time.perf_counter()
        await asyncio.sleep(args.seconds)
        measuring = False
        c1 = {k: proc_cpu_s(p) for k, p in pids.items()}
        m1, t1 = machine_busy_s(), time.perf_counter()
        await asyncio.gather(*tasks)
    dt = t1 - t0
    lat = sorted(done)
    return Tput(
        label,
        len(done) / dt,
        errors,
        lat[len(lat) // 2] * 1e3 if lat else float("nan"),
        {k: (c1[k] - c0[k]) / dt * 100 for k in pids},
        (m1 - m0) / dt * 100 / (os.cpu_count() or 1),
    )


def start_upstream(n: int) -> tuple[Any, list[int]]:
    cmd = [sys.executable, "-m", "bench.zero_upstream", "--ports", str(n)]
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, cwd=ROOT)
    assert up.stdout is not None
    return up, orjson.loads(up.stdout.readline())["ports"]


async def part1(args: argparse.Namespace, tmp: Path) -> list[Tput]:
    up, ports = start_upstream(args.replicas)
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        out = []
        for n in (1, 2):
            model = f"scaleout-{uuid.uuid4().hex[:8]}"
            gws = start_gateways(n, urls, model, tmp)
            try:
                await wait_ready(gws)
                pids = {f"gw{i + 1}": p.pid for i, (p, _) in enumerate(gws)}
                pids |= {"upstream": up.pid, "generator": os.getpid()}
                if (rp := redis_pid()) is not None:
                    pids["redis"] = rp
                reqs = bodies(256, model)
                label = "1 proc" if n == 1 else "2 procs"
                t = await throughput(label, [u for _, u in gws], reqs, pids, args)
                out.append(t)
                print(f"  throughput {label}: {t.rps:.0f} req/s", file=sys.stderr)
            finally:
                stop_processes([p for p, _ in gws])
        return out
    finally:
        stop_processes([up])


# --- part 2: prefix-hit ratio ------------------------------------------------------------------
@dataclass
class Hits:
    label: str
    prompt: int
    hit: int
    errors: int
    per_replica: list[float]

    @property
    def ratio(self) -> float:
        return self.hit / self.prompt if self.prompt else float("nan")


def sim_cmd(model: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "simulator",
        "--replicas",
        "4",
        "--port",
        "0",
        "--speedup",
        "20",
        "--served-model-name",
        model,
    ]


def start_simulator(model: str) -> tuple[Any, list[str]]:
    """A fresh simulator (cold caches); its replica URLs from the `replica i URL ...` lines."""
    sim = subprocess.Popen(sim_cmd(model), stdout=subprocess.PIPE, cwd=ROOT, text=True)
    assert sim.stdout is not None
    urls: list[str] = []
    while len(urls) < 4:
        line = sim.stdout.readline()
        if not line:
            stop_processes([sim])
            raise RuntimeError("simulator exited")
        if line.startswith("replica ") and " http" in line:
            urls.append(line.split()[2])
    return sim, urls


async def hit_run(n_gw: int, args: argparse.Namespace, tmp: Path) -> Hits:
    model = f"scaleout-{uuid.uuid4().hex[:8]}"
    sim, urls = start_simulator(model)
    gws: list[tuple[Any, str]] = []
    try:
        gws = start_gateways(n_gw, urls, model, tmp)
        await wait_ready(gws)
        work = shared_prompts(args.requests, k=8, rate=args.rate, seed=7)
        errors = 0
        async with aiohttp.ClientSession() as h:

            async def send(i: int, item: Any) -> None:
                nonlocal errors
                await asyncio.sleep(item.arrival_s)
                body = {"model": model, "messages": list(item.messages), "max_tokens": 16}
                url = gws[i % len(gws)][1] + "/v1/chat/completions"  # alternate processes
                async with h.post(url, json=body) as r:
                    await r.read()
                    errors += r.status != 200

            await asyncio.gather(*(send(i, w) for i, w in enumerate(work)))
            stats = []
            for u in urls:
                async with h.get(u + "/sim/stats") as r:
                    stats.append(await r.json())
        prompt = sum(int(s["prompt_tokens"]) for s in stats)
        hit = sum(int(s["prefix_hit_tokens"]) for s in stats)
        share = [int(s["prompt_tokens"]) / prompt if prompt else 0.0 for s in stats]
        label = "1 proc" if n_gw == 1 else "2 procs"
        print(f"  hit ratio {label}: {hit / max(prompt, 1):.3f}", file=sys.stderr)
        return Hits(label, prompt, hit, errors, share)
    finally:
        stop_processes([p for p, _ in gws])
        stop_processes([sim])


# --- report ------------------------------------------------------------------------------------
def report(
    cmd: str, tp: list[Tput], hits: list[Hits], args: argparse.Namespace, took: float
) -> str:
    one, two = tp
    procs = ["gw1", "gw2", "upstream", "generator", "redis"]
    hdr = (
        f"{'throughput':<10} {'req/s':>7} {'x 1proc':>7} {'err':>4} {'p50 ms':>7} "
        + " ".join(f"{p:>9}" for p in procs)
        + f" {'other':>6} {'machine':>8}"
    )
    lines = [
        f"$ {cmd}",
        f"{os.cpu_count()} CPUs, {args.replicas} zero-latency upstream ports, concurrency "
        f"{args.concurrency}, {args.seconds:g} s window, prefix_aware + Redis index; "
        f"2 procs = two `gateway --config` processes on two ports, connections alternate; "
        f"took {took:.0f} s",
        "",
        hdr,
        "-" * len(hdr),
    ]
    for t in tp:
        cpus = " ".join((f"{t.cpu[p]:8.0f}%" if p in t.cpu else f"{'':>9}") for p in procs)
        lines.append(
            f"{t.label:<10} {t.rps:7.0f} {t.rps / one.rps:7.2f} {t.errors:4d} {t.p50_ms:7.2f} "
            f"{cpus} {t.other:5.0f}% {t.machine:7.0f}%"
        )
    lines.append(
        "(CPU columns: % of one core per process; other: busy core-% used by processes outside "
        "this bench; machine: % of all cores busy)"
    )
    lines += [
        "",
        f"{'prefix hits':<10} {'hit ratio':>9} {'prompt tok':>11} {'hit tok':>9} {'err':>4}  "
        "traffic share per replica",
        "-" * 80,
    ]
    for hh in hits:
        share = " ".join(f"{s:.2f}" for s in hh.per_replica)
        lines.append(
            f"{hh.label:<10} {hh.ratio:9.3f} {hh.prompt:11d} {hh.hit:9d} {hh.errors:4d}  {share}"
        )
    lines.append(
        f"(simulator --replicas 4 --speedup 20, restarted per run; shared_prompts n={args.requests} "
        f"k=8 rate={args.rate:g}/s seed=7)"
    )
    ratio = two.rps / one.rps
    drop = hits[1].ratio - hits[0].ratio
    lines += [
        "",
        f"goal 2 procs >= 1.7x req/s: {ratio:.2f}x {'PASS' if ratio >= 1.7 else 'FAIL'}",
        f"goal hit ratio does not drop with 2 procs: {drop:+.3f} "
        f"{'PASS' if drop >= -0.02 else 'FAIL'} (tolerance 0.02)",
    ]
    return "\n".join(lines)


async def amain(args: argparse.Namespace) -> str:
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-scaleout-") as d:
        tmp = Path(d)
        tp = await part1(args, tmp)
        hits = [await hit_run(n, args, tmp) for n in (1, 2)]
    cmd = shlex.join([".venv/bin/python", "-m", "bench.scaleout", *sys.argv[1:]])
    return report(cmd, tp, hits, args, time.monotonic() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.scaleout", description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=5.0, help="timed throughput window")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--replicas", type=int, default=4, help="zero-latency upstream ports")
    p.add_argument("--requests", type=int, default=160, help="shared_prompts requests per run")
    p.add_argument("--rate", type=float, default=16.0, help="shared_prompts arrivals per second")
    args = p.parse_args(argv)
    print(asyncio.run(amain(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
