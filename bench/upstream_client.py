"""The gateway's upstream client alone: CPU per request and per streamed chunk, lean client vs aiohttp.

Both clients send the same chat bodies to bench/zero_upstream.py (its own process, on another CPU)
the way the gateway would, and this process's CPU time is divided by what completed.

    .venv/bin/python -m bench.upstream_client              # 3 repeats, about 1 min
    .venv/bin/python -m bench.upstream_client --seconds 1 --repeats 1
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson

from bench.overhead import chat_bodies
from gateway.transport.client import HttpClient

ROOT = Path(__file__).resolve().parent.parent
PATH = "/v1/chat/completions"
HEADERS = {"content-type": "application/json", "accept-encoding": "identity", "x-request-id": "r"}
RAW_HEADERS = [(k.encode(), v.encode()) for k, v in HEADERS.items()]

Call = Callable[[str, bytes, bool], Awaitable[int]]  # origin, body, stream -> body reads made


@dataclass(frozen=True)
class Load:
    label: str
    stream: bool
    paced: bool
    concurrency: int


LOADS = (
    Load("non-stream c=1", False, False, 1),
    Load("non-stream c=32", False, False, 32),
    Load("stream 64ch c=32", True, False, 32),
    Load("stream 64ch@2ms c=16", True, True, 16),
)


# --- the two clients, each used the way the gateway uses it -----------------------------------------
class Lean:
    name = "lean"

    def __init__(self) -> None:
        self.pool = HttpClient(connect_timeout_s=5.0)

    async def call(self, origin: str, body: bytes, stream: bool) -> int:
        resp = await self.pool.request(
            origin,
            b"POST",
            PATH.encode(),
            RAW_HEADERS,
            body,
            first_byte_timeout_s=30.0,
            idle_timeout_s=30.0,
            total_timeout_s=60.0,
        )
        reads = 0
        try:
            if not stream:
                await resp.read_all(1 << 24)
                return 1
            while await resp.read_chunk():
                reads += 1
        finally:
            resp.release()
        return reads

    async def aclose(self) -> None:
        await self.pool.aclose()


class Aiohttp:
    name = "aiohttp"

    def __init__(self) -> None:  # as gateway/forwarding/relay.py:make_session builds it
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=0, keepalive_timeout=30, ttl_dns_cache=10
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, connect=5.0),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )

    async def call(self, origin: str, body: bytes, stream: bool) -> int:
        resp = await self.session.post(
            origin + PATH,
            data=body,
            headers=HEADERS,
            timeout=aiohttp.ClientTimeout(total=60.0, connect=5.0, sock_read=30.0),
        )
        reads = 0
        try:
            if not stream:
                await resp.read()
                return 1
            while await resp.content.readany():
                reads += 1
        finally:
            resp.release()
        return reads

    async def aclose(self) -> None:
        await self.session.close()


# --- measuring ------------------------------------------------------------------------------------
@dataclass
class Window:
    requests: int
    reads: int
    cpu_s: float
    wall_s: float

    @property
    def us_per_req(self) -> float:
        return self.cpu_s / max(self.requests, 1) * 1e6


async def measure(
    client: Lean | Aiohttp,
    origin: str,
    load: Load,
    bodies: list[bytes],
    warm_s: float,
    seconds: float,
) -> Window:
    loop = asyncio.get_running_loop()
    done = [0, 0]
    counting = False
    stop_at = loop.time() + warm_s + seconds

    async def worker(i: int) -> None:
        n = i
        while loop.time() < stop_at:
            reads = await client.call(origin, bodies[n % len(bodies)], load.stream)
            n += load.concurrency
            if counting:
                done[0] += 1
                done[1] += reads

    tasks = [asyncio.create_task(worker(i)) for i in range(load.concurrency)]
    await asyncio.sleep(warm_s)
    counting = True
    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.sleep(seconds)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    n_req, n_reads = done
    counting = False
    await asyncio.gather(*tasks)
    return Window(n_req, n_reads, cpu, wall)


async def run(args: argparse.Namespace, ports: dict[str, list[int]]) -> None:
    origins = {False: f"http://127.0.0.1:{ports['ports'][0]}"}
    origins[True] = f"http://127.0.0.1:{ports['paced_ports'][0]}"
    loads = [ld for ld in LOADS if not args.only or any(k in ld.label for k in args.only)]
    results: dict[tuple[str, str], list[Window]] = {}
    for rep in range(args.repeats):
        for load in loads:
            bodies = chat_bodies(256, load.stream, "bench-model")
            order: list[type[Lean] | type[Aiohttp]] = [Lean, Aiohttp]
            if rep % 2:
                order.reverse()
            for cls in order:
                client = cls()
                try:
                    w = await measure(
                        client, origins[load.paced], load, bodies, args.warmup, args.seconds
                    )
                finally:
                    await client.aclose()
                results.setdefault((load.label, cls.name), []).append(w)
                print(
                    f"  rep {rep + 1} {load.label:22} {cls.name:8} {w.requests / w.wall_s:8.0f} req/s"
                    f" {w.us_per_req:7.1f} us/req",
                    file=sys.stderr,
                )
    report(loads, results, args.chunks)


def report(loads: list[Load], results: dict[tuple[str, str], list[Window]], chunks: int) -> None:
    base_names = ("aiohttp", "lean")
    print(
        f"{'load':22} {'client':8} {'req/s':>8} {'us/req':>8} {'us/chunk':>9} {'reads/req':>9}"
        f" {'x aiohttp':>10}"
    )
    print("-" * 80)
    base: dict[str, float] = {}
    per_req: dict[tuple[str, str], float] = {}
    for load in loads:
        for name in base_names:
            ws = results[(load.label, name)]
            us = statistics.median(w.us_per_req for w in ws)
            rps = statistics.median(w.requests / w.wall_s for w in ws)
            reads = statistics.median(w.reads / max(w.requests, 1) for w in ws)
            per_chunk = f"{us / chunks:9.2f}" if load.stream else " " * 9
            ratio = "" if name == "aiohttp" else f"{us / base[load.label]:10.2f}"
            if name == "aiohttp":
                base[load.label] = us
            per_req[(load.label, name)] = us
            print(f"{load.label:22} {name:8} {rps:8.0f} {us:8.1f} {per_chunk} {reads:9.1f} {ratio}")
    flat = next((ld.label for ld in loads if not ld.stream), None)
    for ld in loads:
        if ld.stream and flat is not None:
            extra = {n: (per_req[(ld.label, n)] - per_req[(flat, n)]) / chunks for n in base_names}
            print(
                f"{ld.label}: CPU per chunk beyond a non-streamed request ({flat}):"
                f" lean {extra['lean']:.1f} us, aiohttp {extra['aiohttp']:.1f} us"
            )
    print(
        "\nus/req: this process's CPU (user+sys) per completed request; us/chunk: us/req / chunks;"
        "\nx aiohttp: lean us/req divided by aiohttp us/req (lower is better)."
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="upstream_client", description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=2.0, help="timed window per measurement")
    p.add_argument("--warmup", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunks", type=int, default=64)
    p.add_argument("--chunk-delay-ms", type=float, default=2.0)
    p.add_argument("--only", nargs="*", help="run the loads whose label contains one of these")
    args = p.parse_args(argv)
    allowed = sorted(os.sched_getaffinity(0))
    cmd = [sys.executable, "-m", "bench.zero_upstream", "--ports", "1", "--paced-ports", "1"]
    cmd += ["--chunks", str(args.chunks), "--chunk-delay-ms", str(args.chunk_delay_ms)]
    up = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE)
    try:
        if len(allowed) > 1:  # the upstream's CPU is not ours: this process's CPU is the client's
            os.sched_setaffinity(up.pid, {allowed[1]})
            os.sched_setaffinity(0, {allowed[0]})
        assert up.stdout is not None
        ports = orjson.loads(up.stdout.readline())
        import uvloop

        uvloop.run(run(args, ports))
    finally:
        up.terminate()
        up.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
