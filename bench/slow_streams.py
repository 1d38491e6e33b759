"""Many long, slowly paced streams held at once by one gateway process: memory per stream, CPU per
token, every stream complete, and the same load straight at the upstream beside it.

    .venv/bin/python -m bench.slow_streams                       # 10,000 streams of 20 chunks, 1/s
    .venv/bin/python -m bench.slow_streams --streams 500 --chunks 5 --chunk-delay-ms 100   # quick

The upstream is `bench/zero_upstream.py` (paced ports only: a chunk every `--chunk-delay-ms` per
stream); the gateway is the installed one, started through its CLI with round robin; the load
generator (this process) opens `--streams` keep-alive connections over `--ramp-s` seconds, each
sending one streamed chat request and reading it to its end. Gateway on the first allowed CPU,
upstream and generator on the second (as `bench.overhead`).

Each stream costs the gateway two sockets (client and replica), so `RLIMIT_NOFILE` caps the
streams one process can hold; when the limit is below what `--streams` needs, the run is capped to
it and says so. Figures: gateway RSS before the streams and at its peak (growth per stream), its
CPU per relayed chunk while every stream was open (the relay alone) and over the whole run
(request setup included), streams completed with `[DONE]`, failed ones, and chunk throughput and
stream duration against direct.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httptools

from bench.harness import free_port, stop_processes
from bench.overhead import (
    PACED_MODEL,
    Variant,
    _pin,
    chat_bodies,
    gateway_config,
    http_requests,
    proc_cpu_s,
    start_gateway,
    wait_ready,
)

FD_SPARE = 200  # listening sockets, probes, scrapes, logs: a gateway's fds besides streams


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def stream_cap(streams: int) -> tuple[int, int]:
    """(streams one gateway can hold under RLIMIT_NOFILE, the limit): two sockets each."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return min(streams, max(1, (soft - FD_SPARE) // 2)), soft


class Stream(asyncio.Protocol):
    """One connection, one streamed request read to its end: events counted, the tail kept."""

    def __init__(self, run: Run, request: bytes) -> None:
        self.run = run
        self.request = request
        self.parser = httptools.HttpResponseParser(self)
        self.t0 = 0.0
        self.t_first = 0.0
        self.events = 0
        self.tail = b""
        self.status = 0
        self.done = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.t0 = time.perf_counter()
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._end(False)

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(False)

    def on_status(self, status: bytes) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if not self.t_first:
            self.t_first = time.perf_counter()
        self.events += body.count(b"data: ")
        self.run.chunks += body.count(b"data: ")
        self.tail = (self.tail + body)[-32:]

    def on_message_complete(self) -> None:
        self._end(self.status == 200 and self.tail.endswith(b"data: [DONE]\n\n"))

    def _end(self, ok: bool) -> None:
        if self.done:
            return
        self.done = True
        self.run.finished(self, ok, time.perf_counter())
        if self.transport is not None:
            self.transport.close()


@dataclass
class Run:
    total: int
    chunks: int = 0  # events received, all streams
    ok: int = 0
    failed: int = 0
    open: int = 0
    peak_open: int = 0
    durations: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    first_end: float = 0.0
    all_done: asyncio.Event = field(default_factory=asyncio.Event)

    def finished(self, s: Stream, ok: bool, now: float) -> None:
        self.open -= 1
        if not self.first_end:
            self.first_end = now
        if ok:
            self.ok += 1
            self.durations.append(now - s.t0)
            self.ttfts.append(s.t_first - s.t0)
        else:
            self.failed += 1
        if self.ok + self.failed >= self.total:
            self.all_done.set()


@dataclass
class Result:
    who: str
    run: Run
    seconds: float
    steady_s: float = 0.0  # every stream open
    steady_chunks: int = 0
    steady_cpu_s: float = 0.0
    cpu_s: float = 0.0  # the gateway's, whole run
    rss_before: int = 0
    rss_peak: int = 0
    connect_errors: int = 0


async def drive(
    who: str, ports: list[int], streams: int, ramp_s: float, timeout_s: float,
    bodies: list[bytes], gw_pid: int | None,
) -> Result:  # fmt: skip
    """Open `streams` streams over `ramp_s`, round robin over `ports`, and wait for all of them."""
    loop = asyncio.get_running_loop()
    run = Run(streams)
    reqs = {p: http_requests(p, bodies) for p in ports}
    res = Result(who, run, 0.0)
    if gw_pid is not None:
        res.rss_before = res.rss_peak = rss_bytes(gw_pid)
    cpu0 = proc_cpu_s(gw_pid) if gw_pid is not None else 0.0
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        port = ports[i % len(ports)]
        req = reqs[port][i % len(bodies)]
        try:
            await loop.create_connection(lambda: Stream(run, req), "127.0.0.1", port)
        except OSError:
            res.connect_errors += 1
            run.open -= 1
            run.failed += 1
            if run.ok + run.failed >= run.total:
                run.all_done.set()

    tasks = []
    for i in range(streams):
        at = t0 + ramp_s * i / streams
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        run.open += 1
        run.peak_open = max(run.peak_open, run.open)
        tasks.append(asyncio.ensure_future(one(i)))
    ramped = time.perf_counter()
    chunks0 = run.chunks
    steady_cpu0 = proc_cpu_s(gw_pid) if gw_pid is not None else 0.0
    steady_end: float | None = None
    deadline = ramped + timeout_s
    while not run.all_done.is_set() and time.perf_counter() < deadline:
        if gw_pid is not None:
            res.rss_peak = max(res.rss_peak, rss_bytes(gw_pid))
        if steady_end is None and run.first_end:  # the first stream ended: no longer all open
            steady_end = time.perf_counter()
            if run.first_end < ramped:  # one ended before the last opened: no such window
                continue
            res.steady_s = steady_end - ramped
            res.steady_chunks = run.chunks - chunks0
            if gw_pid is not None:
                res.steady_cpu_s = proc_cpu_s(gw_pid) - steady_cpu0
        try:
            await asyncio.wait_for(run.all_done.wait(), 0.25)
        except TimeoutError:
            pass
    res.seconds = time.perf_counter() - t0
    if gw_pid is not None:
        res.cpu_s = proc_cpu_s(gw_pid) - cpu0
    await asyncio.gather(*tasks)
    return res


def report(rs: list[Result], args: argparse.Namespace, capped: str) -> str:
    def pct(xs: list[float], q: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    direct = next((r for r in rs if r.who == "direct"), None)
    lines = [
        f"bench.slow_streams: {rs[0].run.total} streams of {args.chunks} chunks at "
        f"{args.chunk_delay_ms:g} ms each, opened over {args.ramp_s:g} s, {args.replicas} "
        f"replica ports; {os.cpu_count()} CPUs, Python {sys.version.split()[0]}{capped}",
        "",
        f"{'path':<8} {'done':>6} {'failed':>6} {'peak open':>9} {'chunks/s':>9} {'x direct':>8} "
        f"{'dur p50 s':>9} {'dur p99 s':>9} {'ttft p50 ms':>11} {'ttft p99 ms':>11} "
        f"{'RSS MB':>7} {'+RSS MB':>7} {'KB/stream':>9} {'us/chunk':>8} {'us/chunk all':>12}",
    ]
    for r in rs:
        rate = r.steady_chunks / r.steady_s if r.steady_s else float("nan")
        ratio = ""
        if direct is not None and r is not direct and direct.steady_s:
            ratio = f"{rate / (direct.steady_chunks / direct.steady_s):.2f}"
        mem = cpu = ""
        if r.who != "direct":
            grow = r.rss_peak - r.rss_before
            mem = (f"{r.rss_peak / 2**20:7.0f} {grow / 2**20:7.0f} "
                   f"{grow / max(1, r.run.peak_open) / 1024:9.1f}")  # fmt: skip
            per = r.steady_cpu_s / r.steady_chunks * 1e6 if r.steady_chunks else float("nan")
            all_ = r.cpu_s / r.run.chunks * 1e6 if r.run.chunks else float("nan")
            cpu = f"{per:8.1f} {all_:12.1f}"
        else:
            mem, cpu = f"{'':7} {'':7} {'':9}", f"{'':8} {'':12}"
        lines.append(
            f"{r.who:<8} {r.run.ok:>6} {r.run.failed:>6} {r.run.peak_open:>9} {rate:>9.0f} "
            f"{ratio:>8} {pct(r.run.durations, 0.5):>9.2f} {pct(r.run.durations, 0.99):>9.2f} "
            f"{pct(r.run.ttfts, 0.5) * 1e3:>11.1f} {pct(r.run.ttfts, 0.99) * 1e3:>11.1f} "
            f"{mem} {cpu}"
        )
    lines += [
        "",
        "chunks/s and us/chunk: while every stream was open (from the last opened to the first "
        "ended); us/chunk all: the gateway's CPU over the whole run (request setup included) "
        "per chunk relayed; +RSS: peak minus before the streams; KB/stream: that over the peak "
        "open streams",
    ]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench.slow_streams", description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=10_000)
    p.add_argument("--chunks", type=int, default=20, help="SSE content chunks per stream")
    p.add_argument("--chunk-delay-ms", type=float, default=1000.0, help="gap before each chunk")
    p.add_argument("--ramp-s", type=float, default=5.0, help="open the streams over this long")
    p.add_argument("--replicas", type=int, default=3, help="upstream ports (replicas)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="give up on streams after")
    p.add_argument("--no-direct", action="store_true", help="skip the direct run")
    p.add_argument("--gateway-src", type=Path, help="run the gateway package from this directory")
    p.add_argument("--gateway-cpu", type=int)
    p.add_argument("--load-cpu", type=int)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.nice = 0
    streams, limit = stream_cap(args.streams)
    capped = ""
    if streams < args.streams:
        capped = (f"; capped from {args.streams}: RLIMIT_NOFILE {limit} holds {streams} "
                  f"streams (2 sockets each)")  # fmt: skip
    cpus = sorted(os.sched_getaffinity(0))
    gcpu = args.gateway_cpu if args.gateway_cpu is not None else cpus[0]
    lcpu = args.load_cpu if args.load_cpu is not None else cpus[-1]
    import subprocess

    import orjson

    up = subprocess.Popen(
        [sys.executable, "-m", "bench.zero_upstream", "--ports", "0", "--paced-ports",
         str(args.replicas), "--chunks", str(args.chunks), "--chunk-delay-ms",
         str(args.chunk_delay_ms)],
        cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.PIPE,
    )  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = [up]
    try:
        _pin(up.pid, lcpu, 0)
        os.sched_setaffinity(0, {lcpu})
        assert up.stdout is not None
        paced = orjson.loads(up.stdout.readline())["paced_ports"]
        bodies = chat_bodies(256, True, PACED_MODEL)
        tmp = Path(tempfile.mkdtemp(prefix="slow-streams-"))
        port = free_port()
        v = Variant("round_robin", {"pools": {"paced": {
            "policy": "round_robin", "max_inflight_per_replica": 1_000_000}}})  # fmt: skip
        cfg = gateway_config(port, [], paced, v)
        del cfg["pools"]["zero"]  # the paced pool only
        cfg["routes"] = [{"match": {}, "pool": "paced"}]
        gw = start_gateway(v, cfg, tmp, args, gcpu)
        procs.append(gw)
        wait_ready(port, gw)
        results: list[Result] = []
        run = _loop()
        # a few streams first: imports, caches and pools warm before the RSS baseline
        warm = chat_bodies(64, False, PACED_MODEL)  # answered at once, ignored
        run(drive("warm", [port], 64, 0.2, args.timeout_s, warm, gw.pid))
        if not args.no_direct:
            results.append(run(drive("direct", paced, streams, args.ramp_s, args.timeout_s,
                                     bodies, None)))  # fmt: skip
        results.append(run(drive("gateway", [port], streams, args.ramp_s, args.timeout_s,
                                 bodies, gw.pid)))  # fmt: skip
        print(report(results, args, capped))
        bad = sum(r.run.failed for r in results) + sum(r.run.total - r.run.ok - r.run.failed
                                                       for r in results)  # fmt: skip
        return 1 if bad else 0
    finally:
        stop_processes(procs[::-1])


def _loop():  # type: ignore[no-untyped-def]
    try:
        import uvloop

        return uvloop.run
    except ImportError:
        return asyncio.run


if __name__ == "__main__":
    sys.exit(main())
