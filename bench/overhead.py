"""What the gateway costs: the same load straight at a zero-latency upstream and through the gateway.

Gateway on one core, upstream and load generator on the other; each load runs direct and through
every gateway variant side by side, repeated, medians printed as ratios and differences. See
docs/overhead.md for how to read the table.

    .venv/bin/python -m bench.overhead            # ~3 min
    .venv/bin/python -m bench.overhead --quick    # ~35 s, one repeat, short windows
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httptools
import orjson
import yaml

ROOT = Path(__file__).resolve().parent.parent
GATEWAY_BIN = Path(sys.executable).parent / "gateway"
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")

MODEL = "bench-model"  # routed to the unpaced replicas
PACED_MODEL = "bench-paced"  # routed to the paced replicas

# goals from the issue
GOAL_STREAM_RATIO = 0.8
GOAL_CPU_PER_REQ_US = 500.0
GOAL_ADDED_P50_MS = 1.0
GOAL_TTFT_MS = 1.0


# --- gateway variants: one row per variant under each load ---------------------------------------
@dataclass(frozen=True)
class Variant:
    """A gateway configuration to measure: a name and a deep-merge over the base config."""

    name: str
    overrides: dict[str, Any] = field(default_factory=dict)


def variants(args: argparse.Namespace, sink_url: str) -> list[Variant]:
    """The rows to measure. A telemetry on/off pair is one more entry per policy."""
    base = [
        Variant(p, {"pools": {"zero": {"policy": p}, "paced": {"policy": p}}})
        for p in args.policies
    ]
    if args.tracing == "otlp":  # the hook for the lead's OpenTelemetry config
        otlp = {"tracing": {"exporter": "otlp_http", "endpoint": sink_url, "sampling_ratio": 1.0}}
        base += [Variant(v.name + "+otlp", _merge(v.overrides, otlp)) for v in base]
    return base


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def gateway_config(port: int, ports: list[int], paced: list[int], v: Variant) -> dict[str, Any]:
    pool = {
        "max_inflight_per_replica": 4096,  # never the limit here: the bench measures overhead
        "health": {"interval_s": 2},
        "scrape": {"interval_s": 1},
    }
    base = {
        "server": {"host": "127.0.0.1", "port": port, "log_level": "warning"},
        "pools": {
            "zero": {"replicas": [f"http://127.0.0.1:{p}" for p in ports], **pool},
            "paced": {"replicas": [f"http://127.0.0.1:{p}" for p in paced], **pool},
        },
        "routes": [
            {"match": {"model": PACED_MODEL}, "pool": "paced"},
            {"match": {}, "pool": "zero"},
        ],
        "index": {"backend": "memory"},
    }
    return _merge(base, v.overrides)


# --- the loads ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Load:
    key: str
    label: str
    stream: bool
    concurrency: int = 0  # closed loop: this many connections, each sends again when answered
    rate: float = 0.0  # open loop: Poisson arrivals per second (set at run time)
    paced: bool = False
    seconds: float = 3.0
    stagger: bool = False  # spread the first sends over one response time (paced streams)


def chat_bodies(n: int, stream: bool, model: str, size: int = 2048) -> list[bytes]:
    """n distinct ~2 KB chat bodies: one shared system prompt, a distinct user turn each."""
    rng = random.Random(1234)
    words = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(8000)).split()
    system = "You are a helpful assistant. " + " ".join(words[:200])
    out = []
    for i in range(n):
        body: dict[str, Any] = {
            "model": model,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Question {i}: "},
            ],
            "max_tokens": 64,
            "temperature": 0.0,
            "stream": stream,
        }
        room = size - len(orjson.dumps(body))
        rng.shuffle(words)
        filler = " ".join(words)[: max(0, room)]
        body["messages"][1]["content"] += filler
        out.append(orjson.dumps(body))
    return out


def http_requests(port: int, bodies: list[bytes]) -> list[bytes]:
    return [
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (port, len(b), b)
        for b in bodies
    ]


# --- CPU accounting ----------------------------------------------------------------------------
def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds; 1/CLK_TCK resolution."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


def core_busy_s() -> dict[int, float]:
    """Busy seconds of each CPU (everything but idle and iowait), from /proc/stat."""
    out = {}
    with open("/proc/stat", "rb") as f:
        for line in f:
            if line.startswith(b"cpu") and line[3:4].isdigit():
                name, *vals = line.split()
                v = [int(x) for x in vals]
                out[int(name[3:])] = (sum(v[:8]) - v[3] - v[4]) * TICK_S
    return out


@dataclass
class Snapshot:
    t: float
    cpu: dict[str, float]
    cores: dict[int, float]


def snapshot(pids: dict[str, int]) -> Snapshot:
    return Snapshot(time.perf_counter(), {k: proc_cpu_s(p) for k, p in pids.items()}, core_busy_s())


# --- the load generator: raw keep-alive HTTP/1.1 connections, parsed by httptools -----------------
class _Conn(asyncio.Protocol):
    """One keep-alive client connection; tells its Run when each answer is complete."""

    __slots__ = ("run", "t", "parser", "t0", "t_first", "tail")

    def __init__(self, run: Run) -> None:
        self.run = run
        self.parser = httptools.HttpResponseParser(self)
        self.t0 = 0
        self.t_first = 0
        self.tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t: asyncio.Transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.run.lost(self)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        if not self.t_first:
            self.t_first = time.perf_counter_ns()
        self.tail = (self.tail + body)[-16:] if len(body) < 16 else body

    def on_message_complete(self) -> None:
        now = time.perf_counter_ns()
        ok = self.parser.get_status_code() == 200
        if self.run.stream:
            ok = ok and self.tail.endswith(b"[DONE]\n\n")
        self.run.done(self, now, ok)

    def send(self, request: bytes, t0: int = 0) -> None:
        self.t_first = 0
        self.tail = b""
        self.t0 = t0 or time.perf_counter_ns()
        self.t.write(request)


class Run:
    """One measured load against one target: keeps the connections busy and records every answer."""

    def __init__(self, requests: list[bytes], stream: bool, closed_loop: bool) -> None:
        self.requests = requests
        self.stream = stream
        self.closed_loop = closed_loop
        self.i = 0
        self.stopping = False
        self.inflight = 0
        self.idle: list[_Conn] = []
        self.backlog: deque[int] = deque()  # open loop: arrival times waiting for a connection
        self.starts: list[int] = []
        self.firsts: list[int] = []
        self.ends: list[int] = []
        self.errors = 0
        self.drained = asyncio.Event()

    def _next(self) -> bytes:
        self.i += 1
        return self.requests[self.i % len(self.requests)]

    def send(self, c: _Conn, t0: int = 0) -> None:
        self.inflight += 1
        c.send(self._next(), t0)

    def arrive(self) -> None:
        if self.idle:
            self.send(self.idle.pop())
        else:
            self.backlog.append(time.perf_counter_ns())

    def done(self, c: _Conn, now: int, ok: bool) -> None:
        self.inflight -= 1
        if ok:
            self.starts.append(c.t0)
            self.firsts.append(c.t_first)
            self.ends.append(now)
        else:
            self.errors += 1
        if self.stopping:
            if not self.inflight:
                self.drained.set()
        elif self.closed_loop:
            self.send(c)
        elif self.backlog:
            self.send(c, self.backlog.popleft())
        else:
            self.idle.append(c)

    def lost(self, c: _Conn) -> None:
        if c.t0 and c in self.idle:
            self.idle.remove(c)


@dataclass
class Window:
    """What one (load, target) measurement saw over its timed window."""

    n: int
    errors: int
    seconds: float
    lat_ms: list[float]
    ttft_ms: list[float]
    cpu_s: dict[str, float]  # per process over the window
    cores_s: dict[int, float]  # per core over the window

    @property
    def rps(self) -> float:
        return self.n / self.seconds

    def cpu_per_req_us(self, who: str) -> float:
        return self.cpu_s.get(who, float("nan")) / max(self.n, 1) * 1e6


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def measure(
    load: Load, targets: list[int], requests: list[bytes], pids: dict[str, int], warmup_s: float
) -> Window:
    loop = asyncio.get_running_loop()
    run = Run(requests, load.stream, closed_loop=load.concurrency > 0)
    n_conns = load.concurrency or 64
    conns = []
    for i in range(n_conns):
        _, c = await loop.create_connection(
            lambda: _Conn(run), "127.0.0.1", targets[i % len(targets)]
        )
        conns.append(c)
    t_start = time.perf_counter()
    end_at = t_start + warmup_s + load.seconds
    feeder = None
    if run.closed_loop:
        spread = 0.0
        if load.stagger:  # one probe to learn how long a response takes, then spread the starts
            run.stopping = True
            run.send(conns[0])
            await run.drained.wait()
            spread = (run.ends[-1] - run.starts[-1]) / 1e9 if run.ends else 0.0
            run.stopping = False
            run.drained.clear()
            run.starts.clear(), run.firsts.clear(), run.ends.clear()
            run.errors = 0
        for c in conns:
            loop.call_later(random.random() * spread, run.send, c)
    else:
        run.idle.extend(conns)
        feeder = asyncio.create_task(_arrivals(run, load.rate, end_at))
    await asyncio.sleep(warmup_s)
    s0 = snapshot(pids)
    await asyncio.sleep(load.seconds)
    s1 = snapshot(pids)
    run.stopping = True
    if feeder is not None:
        feeder.cancel()
    if run.inflight:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(run.drained.wait(), 30)
    for c in conns:
        c.t.close()
    lo, hi = int(s0.t * 1e9), int(s1.t * 1e9)
    picked = [i for i, e in enumerate(run.ends) if lo <= e < hi]
    return Window(
        n=len(picked),
        errors=run.errors,
        seconds=s1.t - s0.t,
        lat_ms=[(run.ends[i] - run.starts[i]) / 1e6 for i in picked],
        ttft_ms=[(run.firsts[i] - run.starts[i]) / 1e6 for i in picked],
        cpu_s={k: s1.cpu[k] - s0.cpu[k] for k in s0.cpu},
        cores_s={k: s1.cores[k] - s0.cores[k] for k in s0.cores},
    )


async def _arrivals(run: Run, rate: float, end_at: float) -> None:
    """Poisson arrivals at `rate`/s; timers fire on the loop's ~1 ms grid, late ones go at once."""
    rng = random.Random(99)
    nxt = time.perf_counter()
    while True:
        nxt += rng.expovariate(rate)
        if nxt >= end_at:
            return
        delay = nxt - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        run.arrive()


# --- processes ---------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pin(pid: int, cpu: int) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), {cpu})


@dataclass
class Procs:
    upstream: subprocess.Popen[bytes]
    ports: list[int]
    paced: list[int]
    gateways: dict[str, tuple[subprocess.Popen[bytes], int]] = field(default_factory=dict)

    def stop(self) -> None:
        for p, _ in self.gateways.values():
            p.terminate()
        self.upstream.terminate()
        for p in [self.upstream, *(p for p, _ in self.gateways.values())]:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def start_upstream(args: argparse.Namespace, cpu: int) -> tuple[subprocess.Popen[bytes], Any]:
    cmd = [sys.executable, "-m", "bench.zero_upstream", "--ports", str(args.replicas)]
    cmd += ["--paced-ports", str(args.replicas), "--chunks", str(args.chunks)]
    cmd += ["--chunk-delay-ms", str(args.chunk_delay_ms)]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE)
    _pin(p.pid, cpu)
    assert p.stdout is not None
    return p, orjson.loads(p.stdout.readline())


def start_gateway(
    v: Variant, cfg: dict[str, Any], workdir: Path, cpu: int, src: Path | None
) -> subprocess.Popen[bytes]:
    """The gateway through its CLI; `src` puts another checkout's packages first on the path."""
    path = workdir / f"gateway-{v.name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    cmd, env = [str(GATEWAY_BIN)], None
    if src is not None:
        cmd = [sys.executable, "-m", "gateway"]
        env = {**os.environ, "PYTHONPATH": str(src.resolve())}
    check = subprocess.run(
        [*cmd, "check", "--config", str(path)], capture_output=True, text=True, env=env
    )
    if check.returncode != 0:
        raise RuntimeError(f"variant {v.name}: the gateway rejects its config:\n{check.stderr}")
    log = open(workdir / f"gateway-{v.name}.log", "wb")  # noqa: SIM115 - lives with the process
    p = subprocess.Popen([*cmd, "--config", str(path)], stdout=log, stderr=log, env=env, cwd="/")
    _pin(p.pid, cpu)
    return p


def wait_ready(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
    """Poll /ready (every replica probed healthy) rather than sleeping a guess."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway on :{port} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"gateway on :{port} not ready after {timeout_s}s")


# --- the plan, the table, the goals ----------------------------------------------------------------
@dataclass
class Plan:
    loads: list[Load]
    repeats: int
    warmup_s: float


def make_plan(args: argparse.Namespace) -> Plan:
    secs = 1.0 if args.quick else args.seconds
    c, cp = args.concurrency, args.paced_concurrency
    ch, d = args.chunks, args.chunk_delay_ms
    loads = [
        Load("sat", f"non-stream  c={c}", stream=False, concurrency=c, seconds=secs),
        Load("stream", f"stream {ch}ch c={c}", stream=True, concurrency=c, seconds=secs),
        Load(
            "paced",
            f"stream {ch}ch@{d:g}ms c={cp}",
            stream=True,
            concurrency=cp,
            paced=True,
            seconds=secs * 1.5,
            stagger=True,
        ),
        Load("half", "non-stream  50% sat", stream=False, seconds=secs),
        Load("ttft", "TTFT stream c=1", stream=True, concurrency=1, seconds=secs * 0.7),
    ]
    return Plan(
        loads=loads,
        repeats=1 if args.quick else args.repeats,
        warmup_s=0.3 if args.quick else 0.5,
    )


Results = dict[tuple[str, str], list[Window]]


async def run_all(
    plan: Plan,
    procs: Procs,
    vs: list[Variant],
    bodies: dict[tuple[bool, bool], list[bytes]],
    logs: Path,
) -> tuple[Results, dict[str, float]]:
    results: Results = {}
    rates: dict[str, float] = {}
    names = ["direct"] + [v.name for v in vs]
    for rep in range(plan.repeats):
        for load in plan.loads:
            if load.key == "half":
                base = statistics.median(w.rps for w in results[("sat", vs[0].name)])
                load = dataclasses.replace(load, rate=0.5 * base)
                rates["half"] = load.rate
            order = names if rep % 2 == 0 else names[::-1]  # alternate, so drift hits both sides
            for who in order:
                pids = {"upstream": procs.upstream.pid, "generator": os.getpid()}
                if who == "direct":
                    targets = procs.paced if load.paced else procs.ports
                else:
                    proc, port = procs.gateways[who]
                    targets = [port]
                    pids["gateway"] = proc.pid
                reqs = http_requests(targets[0], bodies[(load.stream, load.paced)])
                w = await measure(load, targets, reqs, pids, plan.warmup_s)
                if w.errors or not w.n:
                    log = logs / f"gateway-{who}.log"
                    tail = log.read_text()[-3000:] if log.exists() else ""
                    msg = f"{load.label} via {who}: {w.errors} failed, {w.n} answered\n{tail}"
                    if not w.n:
                        raise RuntimeError(msg)
                    print(f"bench.overhead: warning: {msg}", file=sys.stderr)
                results.setdefault((load.key, who), []).append(w)
                print(
                    f"  [{rep + 1}/{plan.repeats}] {load.label:<24} {who:<16} "
                    f"{w.rps:8.0f} req/s  p50 {pct(w.lat_ms, 0.5):7.2f} ms  errors {w.errors}",
                    file=sys.stderr,
                )
    return results, rates


def med(xs: Iterator[float] | list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def report(
    plan: Plan,
    res: Results,
    rates: dict[str, float],
    vs: list[Variant],
    args: argparse.Namespace,
    cpus: tuple[int, int],
) -> str:
    gcpu, lcpu = cpus
    out: list[str] = []
    w = out.append
    hdr = (
        f"{'load':<24} {'path':<16} {'req/s':>8} {'xdirect':>8} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'+p50 ms':>8} {'+p99 ms':>8} {'gw us/req':>9} {'us/chunk':>8} {'gw core':>7} "
        f"{'load core':>9}"
    )
    w(hdr)
    w("-" * len(hdr))
    for load in plan.loads:
        direct = res[(load.key, "direct")]
        label = load.label
        if load.key == "half":
            label = f"non-stream {rates['half']:.0f}/s"
        for who in ["direct"] + [v.name for v in vs]:
            ws = res[(load.key, who)]
            use_ttft = load.key == "ttft"

            def lat(win: Window, use_ttft: bool = use_ttft) -> list[float]:
                return win.ttft_ms if use_ttft else win.lat_ms

            p50 = med(pct(lat(x), 0.5) for x in ws)
            p99 = med(pct(lat(x), 0.99) for x in ws)
            rps = med(x.rps for x in ws)
            load_core = med(
                (x.cpu_s["upstream"] + x.cpu_s["generator"]) / x.seconds * 100 for x in ws
            )
            if who == "direct":
                w(
                    f"{label:<24} {who:<16} {rps:8.0f} {'':>8} {p50:7.2f} {p99:7.2f} "
                    f"{'':>8} {'':>8} {'':>9} {'':>8} {'':>7} {load_core:8.0f}%"
                )
                continue
            ratio = med(g.rps / d.rps for g, d in zip(ws, direct, strict=True))
            add50 = med(pct(lat(g), 0.5) - pct(lat(d), 0.5) for g, d in zip(ws, direct, strict=True))
            add99 = med(
                pct(lat(g), 0.99) - pct(lat(d), 0.99) for g, d in zip(ws, direct, strict=True)
            )
            per_req = med(x.cpu_per_req_us("gateway") for x in ws)
            per_chunk = f"{per_req / args.chunks:8.1f}" if load.stream and not use_ttft else ""
            gw_core = med(x.cpu_s["gateway"] / x.seconds * 100 for x in ws)
            cpu_col = f"{per_req:9.0f}" if not use_ttft else ""
            w(
                f"{'':<24} {who:<16} {rps:8.0f} {ratio:8.2f} {p50:7.2f} {p99:7.2f} "
                f"{add50:+8.2f} {add99:+8.2f} {cpu_col:>9} {per_chunk:>8} {gw_core:6.0f}% "
                f"{load_core:8.0f}%"
            )
    w("")
    w(_bottleneck(res, vs, args, gcpu, lcpu))
    w("")
    w(_goals(res, vs))
    return "\n".join(out)


def _bottleneck(
    res: Results, vs: list[Variant], args: argparse.Namespace, gcpu: int, lcpu: int
) -> str:
    d = res[("sat", "direct")]
    g = res[("sat", vs[0].name)]
    gen = med(x.cpu_per_req_us("generator") for x in d)
    up = med(x.cpu_per_req_us("upstream") for x in d)
    gw = med(x.cpu_per_req_us("gateway") for x in g)
    sgen = med(x.cpu_per_req_us("generator") for x in res[("stream", "direct")])
    sup = med(x.cpu_per_req_us("upstream") for x in res[("stream", "direct")])
    sgw = med(x.cpu_per_req_us("gateway") for x in res[("stream", vs[0].name)])
    windows = [x for ws in res.values() for x in ws]

    def other(core: int, procs: list[str]) -> float:
        return med(
            (x.cores_s.get(core, 0.0) - sum(x.cpu_s.get(p, 0.0) for p in procs)) / x.seconds * 100
            for x in windows
        )

    return (
        f"load-side cost per request (direct runs, CPU {lcpu}): non-stream generator {gen:.0f} us "
        f"+ upstream {up:.0f} us vs gateway {gw:.0f} us; stream generator {sgen:.0f} us + upstream "
        f"{sup:.0f} us vs gateway {sgw:.0f} us\n"
        f"other processes' load, median over windows: CPU {gcpu} (gateway) "
        f"{other(gcpu, ['gateway']):.0f}%, CPU {lcpu} (load) "
        f"{other(lcpu, ['generator', 'upstream']):.0f}%"
    )


def _goals(res: Results, vs: list[Variant]) -> str:
    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    rows = []
    for v in vs:
        n = v.name

        def ratio(key: str, n: str = n) -> float:
            return med(
                g.rps / d.rps for g, d in zip(res[(key, n)], res[(key, "direct")], strict=True)
            )

        def added(key: str, ttft: bool, n: str = n) -> float:
            pairs = zip(res[(key, n)], res[(key, "direct")], strict=True)
            if ttft:
                return med(pct(g.ttft_ms, 0.5) - pct(d.ttft_ms, 0.5) for g, d in pairs)
            return med(pct(g.lat_ms, 0.5) - pct(d.lat_ms, 0.5) for g, d in pairs)

        s, p = ratio("stream"), ratio("paced")
        cpu = med(x.cpu_per_req_us("gateway") for x in res[("sat", n)])
        half = added("half", False)
        ttft = added("ttft", True)
        rows += [
            f"[{n}]",
            f"  stream req/s through gateway >= {GOAL_STREAM_RATIO} x direct, unpaced:"
            f" {s:6.2f}   {verdict(s >= GOAL_STREAM_RATIO)}",
            f"  stream req/s through gateway >= {GOAL_STREAM_RATIO} x direct, paced:  "
            f" {p:6.2f}   {verdict(p >= GOAL_STREAM_RATIO)}",
            f"  gateway CPU per non-streamed request <= {GOAL_CPU_PER_REQ_US:.0f} us:    "
            f" {cpu:6.0f}   {verdict(cpu <= GOAL_CPU_PER_REQ_US)}",
            f"  added p50 at half saturation <= {GOAL_ADDED_P50_MS} ms:              "
            f" {half:6.2f}   {verdict(half <= GOAL_ADDED_P50_MS)}",
            f"  TTFT difference at c=1 <= {GOAL_TTFT_MS} ms:                    "
            f" {ttft:6.2f}   {verdict(ttft <= GOAL_TTFT_MS)}",
        ]
    return "goals (medians over repeats)\n" + "\n".join(rows)


# --- main --------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench.overhead", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one repeat of 1 s windows (~35 s)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seconds", type=float, default=2.5, help="timed window per measurement")
    p.add_argument("--concurrency", type=int, default=32, help="closed-loop connections")
    p.add_argument("--paced-concurrency", type=int, default=128)
    p.add_argument("--chunks", type=int, default=64, help="SSE chunks per streamed response")
    p.add_argument("--chunk-delay-ms", type=float, default=5.0, help="pace of the paced stream")
    p.add_argument("--replicas", type=int, default=3, help="upstream ports per pool")
    p.add_argument(
        "--policies", nargs="+", default=["round_robin", "prefix_aware"], help="gateway variants"
    )
    p.add_argument(
        "--tracing",
        choices=["off", "otlp"],
        default="off",
        help="otlp: add a telemetry-on row per policy (OTLP/HTTP to the upstream's sink)",
    )
    p.add_argument("--gateway-cpu", type=int, help="CPU for the gateway (default: first allowed)")
    p.add_argument("--load-cpu", type=int, help="CPU for upstream + generator (default: second)")
    p.add_argument(
        "--gateway-src",
        type=Path,
        help="run the gateway package found in this directory (e.g. a `git archive` of another "
        "commit) instead of the installed one",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2 and (args.gateway_cpu is None or args.load_cpu is None):
        print("bench.overhead: needs two CPUs (gateway on one, load on the other)", file=sys.stderr)
        return 2
    gcpu = allowed[0] if args.gateway_cpu is None else args.gateway_cpu
    lcpu = allowed[1] if args.load_cpu is None else args.load_cpu
    os.sched_setaffinity(0, {lcpu})
    plan = make_plan(args)
    t_begin = time.monotonic()
    up, ports = start_upstream(args, lcpu)
    procs = Procs(up, ports["ports"], ports["paced_ports"])
    sink = f"http://127.0.0.1:{procs.ports[0]}"
    vs = variants(args, sink)
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        try:
            kept = []
            for v in vs:
                port = _free_port()
                cfg = gateway_config(port, procs.ports, procs.paced, v)
                try:
                    proc = start_gateway(v, cfg, Path(tmp), gcpu, args.gateway_src)
                except RuntimeError as exc:
                    print(f"bench.overhead: skipping {exc}", file=sys.stderr)
                    continue
                procs.gateways[v.name] = (proc, port)
                kept.append(v)
            if not kept:
                return 1
            for proc, port in procs.gateways.values():
                wait_ready(port, proc)
                _pin(proc.pid, gcpu)  # threads started since launch
            bodies = {
                (s, paced): chat_bodies(256, s, PACED_MODEL if paced else MODEL)
                for s in (False, True)
                for paced in (False, True)
            }
            results, rates = _run_loop(run_all(plan, procs, kept, bodies, Path(tmp)))
            table = report(plan, results, rates, kept, args, (gcpu, lcpu))
        finally:
            procs.stop()
    elapsed = time.monotonic() - t_begin
    print(_preamble(args, plan, gcpu, lcpu, elapsed))
    print(table)
    return 0


def _run_loop(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _preamble(args: argparse.Namespace, plan: Plan, gcpu: int, lcpu: int, elapsed: float) -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return (
        f"bench.overhead: {plan.repeats} repeat(s), {args.replicas} replicas per pool, "
        f"{args.chunks} SSE chunks, paced at {args.chunk_delay_ms:g} ms/chunk; gateway on CPU "
        f"{gcpu}, upstream + generator on CPU {lcpu} ({model}, {os.cpu_count()} CPUs, "
        f"Python {sys.version.split()[0]}); took {elapsed:.0f} s\n"
    )



if __name__ == "__main__":
    sys.exit(main())
