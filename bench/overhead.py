"""What the gateway costs: the same load straight at a zero-latency upstream and through the gateway.

The gateway runs on one CPU, the upstream (bench/zero_upstream.py) and this load generator on the
other; every load runs direct and through each gateway variant side by side, repeated, and the table
prints medians of ratios and differences. docs/overhead.md says how to read it.

    .venv/bin/python -m bench.overhead             # ~2.5 min
    .venv/bin/python -m bench.overhead --quick     # ~35 s
    .venv/bin/python -m bench.overhead --quick --only sat stream --profile /tmp/prof   # py-spy
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httptools
import orjson
import yaml

from bench.harness import free_port, stop_processes
from policies.registry import DEFAULT_POLICY

ROOT = Path(__file__).resolve().parent.parent
GATEWAY_BIN = Path(sys.executable).parent / "gateway"
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")

MODEL = "bench-model"  # routed to the unpaced replicas
PACED_MODEL = "bench-paced"  # routed to the paced replicas

# the hot-path issue's goals
GOAL_STREAM_UNPACED = 0.9  # x direct
GOAL_STREAM_PACED = 0.95
GOAL_CPU_PER_REQ_US = 500.0
GOAL_ADDED_P50_MS = 1.0  # at half saturation
GOAL_ADDED_P99_MS = 5.0
GOAL_TTFT_MS = 0.5  # added at c=1
GOAL_TRACED_X = 1.15  # --tracing otlp: CPU per request traced (sampling 1.0) / untraced
RUST_REFERENCE = "sgl-cache_aware"  # the public Rust cache-aware router the gateway is held to
RUST_POLICIES = ("cache_aware", "round_robin")  # sglang-router's, one row each when installed
# bench/floor_proxy.py's rows: its two server layers, and the uvicorn one with the gateway's
# routing unit (the last of --policies) in front of its forward
FLOOR_LAYERS = ("uvicorn", "raw", "routed")


# --- gateway variants: one row each under every load ---------------------------------------------
@dataclass(frozen=True)
class Variant:
    """A gateway configuration to measure: a name and a deep merge over the base config."""

    name: str
    overrides: dict[str, Any] = field(default_factory=dict)
    rust_policy: str | None = None  # a row of the public Rust router (sglang-router), not ours
    floor: str | None = None  # a row of bench/floor_proxy.py under this server layer, not ours
    server: str = "uvicorn"  # the HTTP server the gateway's ASGI app runs under
    src: Path | None = None  # run the gateway package from this directory (--baseline-src)

    @property
    def ours(self) -> bool:
        """A gateway row, not a reference (the Rust router, the floor)."""
        return self.rust_policy is None and self.floor is None


def policy_variant(policy: str) -> Variant:
    """The gateway with `policy` on both pools."""
    return Variant(policy, {"pools": {"zero": {"policy": policy}, "paced": {"policy": policy}}})


def traced(v: Variant, sink_url: str) -> Variant:
    """`v` with every request traced (sampling 1.0), OTLP/HTTP to `sink_url`."""
    otlp = {"tracing": {"exporter": "otlp_http", "endpoint": sink_url, "sampling_ratio": 1.0}}
    return Variant(v.name + "+otlp", _merge(v.overrides, otlp))


def variants(args: argparse.Namespace, sink_url: str) -> list[Variant]:
    """The gateway rows. A telemetry on/off pair is one more entry per policy (see --tracing)."""
    # as shipped, the request log is on (log_level info); --request-log sets its format, or off
    log = (
        {"server": {"log_level": "warning"}}
        if args.request_log == "off"
        else {"server": {"log_level": "info", "log_format": args.request_log}}
    )
    out = [Variant(v.name, _merge(v.overrides, log)) for v in map(policy_variant, args.policies)]
    if args.log_cost and args.request_log != "off":  # the same rows with the request log off
        off = {"server": {"log_level": "warning"}}
        out += [Variant(v.name + "-log", _merge(v.overrides, off)) for v in list(out)]
    if args.tracing == "otlp":
        out += [traced(v, sink_url) for v in out]
    if "granian" in args.servers:  # the same app under another server, for the first policy
        if shutil.which("granian", path=str(GATEWAY_BIN.parent)) is None:
            print("bench.overhead: granian is not installed (pip install granian): no granian row",
                  file=sys.stderr)  # fmt: skip
        else:
            out.append(Variant(f"{out[0].name}@granian", out[0].overrides, server="granian"))
    if args.baseline_src is not None:  # A/B in one run: the same policies from another tree
        out += [dataclasses.replace(v, name=v.name + "@base", src=args.baseline_src)
                for v in list(out) if v.server == "uvicorn"]  # fmt: skip
    if args.floor == "on":  # the least a Python proxy spends, under each server layer
        out += [Variant(f"floor@{layer}", floor=layer) for layer in FLOOR_LAYERS]
    if args.rust == "auto" and rust_router_installed():
        out += [Variant(f"sgl-{p}", rust_policy=p) for p in RUST_POLICIES]
    return out


def rust_router_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang_router") is not None


def start_rust_router(
    v: Variant, port: int, ports: list[int], workdir: Path, args: argparse.Namespace, cpu: int
) -> subprocess.Popen[bytes]:
    """sglang-router (a Rust binary behind a Python launcher) over `ports`, on the gateway's CPU.

    One router serves one set of workers, so a Rust row runs two: one for the unpaced replicas and
    one for the paced ones. Retries, the circuit breaker and health checks keep their defaults.
    """
    assert v.rust_policy is not None
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
           "--port", str(port), "--policy", v.rust_policy, "--log-level", "error",
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
           "--worker-urls", *(f"http://127.0.0.1:{p}" for p in ports)]  # fmt: skip
    log = open(workdir / f"gateway-{v.name}-{port}.log", "wb")  # noqa: SIM115 - lives with it
    p = subprocess.Popen(cmd, stdout=log, stderr=log, cwd="/")
    _pin(p.pid, cpu, args.nice)
    return p


def start_floor_proxy(
    v: Variant, port: int, ports: list[int], workdir: Path, args: argparse.Namespace, cpu: int
) -> subprocess.Popen[bytes]:
    """bench/floor_proxy.py over `ports`, on the gateway's CPU; like a Rust row, one process
    per pool (it reads no model name to choose one)."""
    assert v.floor is not None
    route = ["--server", "uvicorn", "--route", args.policies[-1]]  # the last policy's unit
    layer = route if v.floor == "routed" else ["--server", v.floor]
    cmd = [sys.executable, "-m", "bench.floor_proxy", *layer, "--port", str(port),
           "--upstream", *(f"http://127.0.0.1:{p}" for p in ports)]  # fmt: skip
    log = open(workdir / f"gateway-{v.name}-{port}.log", "wb")  # noqa: SIM115 - lives with it
    p = subprocess.Popen(cmd, stdout=log, stderr=log, cwd=ROOT)
    _pin(p.pid, cpu, args.nice)
    return p


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def gateway_config(port: int, ports: list[int], paced: list[int], v: Variant) -> dict[str, Any]:
    pool = {
        "max_inflight_per_replica": 4096,  # never the limit: the bench measures overhead
        "health": {"interval_s": 2},
        "scrape": {"interval_s": 1},
    }
    base = {
        "server": {"host": "127.0.0.1", "port": port},  # log level: the variant's
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
    concurrency: int = 0  # closed loop: this many connections, each sends again once answered
    rate: float = 0.0  # open loop: Poisson arrivals per second (set from the `sat` rows)
    paced: bool = False
    seconds: float = 1.5
    stagger: bool = False  # spread the first sends over one response time (long paced streams)


LOAD_KEYS = ("sat", "stream", "paced", "half", "ttft")


BODY_BYTES = 2048  # the issue's body; --body-bytes for production-sized prompts


def chat_bodies(n: int, stream: bool, model: str, size: int = BODY_BYTES) -> list[bytes]:
    """n distinct chat bodies of about `size` bytes: one shared system prompt (about 65 % of
    it: ~1.3 KB of the default 2 KB), a different user turn each (the rest, so every body has
    blocks of its own past the shared prefix)."""
    rng = random.Random(1234)
    letters = "abcdefghijklmnopqrstuvwxyz"
    count = max(1500, size // 3)  # enough words for any turn (~6.5 bytes a word)
    words = ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(count)]
    system = "You are a helpful assistant. " + " ".join(words[: round(200 * size / 2048)])
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
        rng.shuffle(words)
        room = max(0, size - len(orjson.dumps(body)))
        body["messages"][1]["content"] += " ".join(words)[:room]
        out.append(orjson.dumps(body))
    return out


def http_requests(port: int, bodies: list[bytes]) -> list[bytes]:
    return [
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (port, len(b), b)
        for b in bodies
    ]


# --- CPU accounting ----------------------------------------------------------------------------
def proc_cpu_s(pid: int, descendants: bool = False) -> float:
    """utime + stime of a process, all threads, in seconds (1/CLK_TCK resolution); with
    `descendants`, of its live child processes too (a server's worker processes)."""
    total = 0.0
    for p in _tree(pid) if descendants else [pid]:
        with contextlib.suppress(OSError), open(f"/proc/{p}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) * TICK_S
    return total


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for tid in os.listdir(f"/proc/{p}/task") if os.path.isdir(f"/proc/{p}/task") else ():
            with contextlib.suppress(OSError), open(f"/proc/{p}/task/{tid}/children") as f:
                todo += [int(c) for c in f.read().split()]
    return out


def core_busy_s() -> dict[int, float]:
    """Busy seconds of each CPU (all but idle and iowait), from /proc/stat."""
    out = {}
    with open("/proc/stat", "rb") as f:
        for line in f:
            if line.startswith(b"cpu") and line[3:4].isdigit():
                name, *vals = line.split()
                v = [int(x) for x in vals[:8]]
                out[int(name[3:])] = (sum(v) - v[3] - v[4]) * TICK_S
    return out


@dataclass
class Snapshot:
    t: float
    cpu: dict[str, float]
    cores: dict[int, float]


def snapshot(pids: dict[str, int]) -> Snapshot:
    return Snapshot(time.perf_counter(), {k: proc_cpu_s(p, k == "gateway") for k, p in pids.items()}, core_busy_s())


# --- the load generator: raw keep-alive HTTP/1.1 connections parsed by httptools -----------------
class _Conn(asyncio.Protocol):
    """One keep-alive client connection; tells its Run when each answer is complete."""

    __slots__ = ("run", "t", "parser", "busy", "t0", "t_first", "tail")

    def __init__(self, run: Run) -> None:
        self.run = run
        self.parser = httptools.HttpResponseParser(self)
        self.busy = False
        self.t0 = self.t_first = 0
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
        self.tail = body if len(body) >= 16 else (self.tail + body)[-16:]

    def on_message_complete(self) -> None:
        now = time.perf_counter_ns()
        ok = self.parser.get_status_code() == 200
        if self.run.stream:
            ok = ok and self.tail.endswith(b"[DONE]\n\n")
        self.busy = False
        self.run.done(self, now, ok)

    def send(self, request: bytes, t0: int) -> None:
        self.busy = True
        self.t_first = 0
        self.tail = b""
        self.t0 = t0 or time.perf_counter_ns()
        self.t.write(request)


class Run:
    """One load against one target: keeps its connections busy, records every answer."""

    def __init__(self, requests: list[bytes], stream: bool, closed_loop: bool) -> None:
        self.requests = requests
        self.stream = stream
        self.closed_loop = closed_loop
        self.i = 0
        self.stopping = False
        self.inflight = 0
        self.idle: list[_Conn] = []
        self.backlog: collections.deque[int] = collections.deque()  # open loop: waiting arrivals
        self.starts: list[int] = []
        self.firsts: list[int] = []
        self.ends: list[int] = []
        self.errors = 0
        self.drained = asyncio.Event()
        self.answered = asyncio.Event()

    def send(self, c: _Conn, t0: int = 0) -> None:
        if self.stopping or c.t.is_closing():
            return
        self.i += 1
        self.inflight += 1
        c.send(self.requests[self.i % len(self.requests)], t0)

    def arrive(self) -> None:
        if self.idle:
            self.send(self.idle.pop())
        else:  # latency counts from the arrival, not from when a connection came free
            self.backlog.append(time.perf_counter_ns())

    def done(self, c: _Conn, now: int, ok: bool) -> None:
        self.inflight -= 1
        self.answered.set()
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
        if c.busy:
            c.busy = False
            self.errors += 1
            self.inflight -= 1
            self.answered.set()
            if self.stopping and not self.inflight:
                self.drained.set()
        if c in self.idle:
            self.idle.remove(c)


@dataclass
class Window:
    """What one (load, target) measurement saw during its timed window."""

    n: int
    errors: int
    seconds: float
    lat_ms: list[float]
    ttft_ms: list[float]
    cpu_s: dict[str, float]  # per process
    cores_s: dict[int, float]  # per CPU

    @property
    def rps(self) -> float:
        return self.n / self.seconds

    def us_per_req(self, *who: str) -> float:
        return sum(self.cpu_s.get(w, float("nan")) for w in who) / max(self.n, 1) * 1e6

    def share(self, *who: str) -> float:
        """CPU used by these processes, in % of one CPU."""
        return sum(self.cpu_s.get(w, 0.0) for w in who) / self.seconds * 100

    def other(self, cpu: int, *ours: str) -> float:
        """CPU `cpu` was busy with other processes than ours, in %."""
        return self.cores_s.get(cpu, 0.0) / self.seconds * 100 - self.share(*ours)


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
    conns: list[_Conn] = []
    for i in range(load.concurrency or 64):
        _, c = await loop.create_connection(
            lambda: _Conn(run), "127.0.0.1", targets[i % len(targets)]
        )
        conns.append(c)
    end_at = time.perf_counter() + warmup_s + load.seconds
    feeder = None
    if run.closed_loop:
        spread = 0.0
        if load.stagger:  # time one response, then start the connections spread over that time
            run.closed_loop = False
            run.send(conns[0])
            await run.answered.wait()
            spread = (run.ends[-1] - run.starts[-1]) / 1e9 if run.ends else 0.0
            run.starts.clear(), run.firsts.clear(), run.ends.clear(), run.idle.clear()
            run.errors, run.closed_loop = 0, True
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
    """Poisson arrivals at `rate`/s (seeded); a timer that fires late sends what is due at once."""
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
def _pin(pid: int, cpu: int, nice: int) -> None:
    """Pin every thread of `pid` and of its descendants to `cpu` (later ones inherit it)."""
    for p in _tree(pid):
        for tid in os.listdir(f"/proc/{p}/task") if os.path.isdir(f"/proc/{p}/task") else ():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), {cpu})
                if nice:
                    os.setpriority(os.PRIO_PROCESS, int(tid), nice)


@dataclass
class Procs:
    upstream: subprocess.Popen[bytes]
    ports: list[int]
    paced: list[int]
    gateways: dict[str, tuple[subprocess.Popen[bytes], int]] = field(default_factory=dict)

    def stop(self) -> None:
        stop_processes([p for p, _ in self.gateways.values()] + [self.upstream])


def start_upstream(args: argparse.Namespace, cpu: int) -> Procs:
    cmd = [sys.executable, "-m", "bench.zero_upstream", "--ports", str(args.replicas)]
    cmd += ["--paced-ports", str(args.replicas), "--chunks", str(args.chunks)]
    cmd += ["--chunk-delay-ms", str(args.chunk_delay_ms)]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE)
    _pin(p.pid, cpu, args.nice)
    assert p.stdout is not None
    ports = orjson.loads(p.stdout.readline())
    return Procs(p, ports["ports"], ports["paced_ports"])


def start_gateway(
    v: Variant, cfg: dict[str, Any], workdir: Path, args: argparse.Namespace, cpu: int
) -> subprocess.Popen[bytes]:
    """The gateway through its CLI; --gateway-src puts another checkout's packages first."""
    path = workdir / f"gateway-{v.name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = {k: x for k, x in os.environ.items() if not k.startswith("OTEL_")}  # config decides
    cmd = [str(GATEWAY_BIN)]
    src = v.src or args.gateway_src
    if v.server == "granian":  # one worker, one runtime thread, uvloop: as `gateway serve` runs
        env["KVGATEWAY_CONFIG"] = str(path)
        granian = [str(GATEWAY_BIN.parent / "granian"), "--interface", "asgi", "--factory",
                   "--host", "127.0.0.1", "--port", str(cfg["server"]["port"]), "--loop", "uvloop",
                   "--workers", "1", "--runtime-mode", "st", "--http", "1", "--no-ws",
                   "--log-level", "warning", "gateway.cli:app_from_env"]  # fmt: skip
        if src is not None:
            env["PYTHONPATH"] = str(src.resolve())
        log = open(workdir / f"gateway-{v.name}.log", "wb")  # noqa: SIM115 - lives with it
        p = subprocess.Popen(granian, stdout=log, stderr=log, env=env, cwd="/")
        _pin(p.pid, cpu, args.nice)
        return p
    if src is not None:
        cmd = [sys.executable, "-m", "gateway"]
        env["PYTHONPATH"] = str(src.resolve())
    check = subprocess.run(
        [*cmd, "check", "--config", str(path)], capture_output=True, text=True, env=env, cwd="/"
    )
    if check.returncode != 0:
        raise RuntimeError(f"variant {v.name}: the gateway rejects its config:\n{check.stderr}")
    log = open(workdir / f"gateway-{v.name}.log", "wb")  # noqa: SIM115 - lives with the process
    p = subprocess.Popen([*cmd, "--config", str(path)], stdout=log, stderr=log, env=env, cwd="/")
    _pin(p.pid, cpu, args.nice)
    return p


def wait_ready(
    port: int, proc: subprocess.Popen[bytes], path: str = "/ready", timeout_s: float = 30
) -> None:
    """Poll `path` (the gateway's /ready: every replica probed healthy) instead of sleeping."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway on :{port} exited with {proc.returncode}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=1) as r:
                if r.status == 200:
                    return
        time.sleep(0.1)
    raise RuntimeError(f"gateway on :{port} not ready after {timeout_s}s")


# --- profiling (optional): py-spy on the gateway during its timed windows --------------------------
class Profiler:
    def __init__(self, out: Path | None, cpu: int, native: bool) -> None:
        self.out = out
        self.cpu = cpu
        self.native = native
        self.spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy"
        self.files: list[Path] = []

    def start(self, pid: int, name: str, seconds: float) -> subprocess.Popen[bytes] | None:
        if self.out is None:
            return None
        path = self.out / f"{name}.txt"
        cmd = [self.spy, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds)))]
        cmd += ["--rate", "250", "--format", "raw", "--output", str(path)]
        cmd += ["--native"] if self.native else ["--nonblocking"]
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _pin(p.pid, self.cpu, 0)
        self.files.append(path)
        return p

    def summary(self, top: int = 12) -> str:
        out = []
        for path in self.files:
            if path.exists():
                out.append(summarize_stacks(path, top))
        return "\n".join(out)


def summarize_stacks(path: Path, top: int) -> str:
    """Self and inclusive share per function (lines merged) of a py-spy raw (collapsed) file."""
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = [
            f.rsplit(":", 1)[0] + ")" if f.endswith(")") and ":" in f else f
            for f in stack.split(";")
            if not f.startswith(("process ", "thread "))
        ]
        if frames:
            own[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    lines = [f"profile {path.name}: {total} samples (Runner.run self = event loop in C + epoll)"]
    lines += [f"  self {100 * n / total:5.1f}%  {f}" for f, n in own.most_common(top)]
    ours = [(f, n) for f, n in incl.most_common() if "gateway/" in f or "prefix_index/" in f]
    lines += [f"  incl {100 * n / total:5.1f}%  {f}" for f, n in ours[:top]]
    return "\n".join(lines)


# --- the plan, the run, the table --------------------------------------------------------------------
@dataclass
class Plan:
    loads: list[Load]
    repeats: int
    warmup_s: float
    body_bytes: int = BODY_BYTES


def make_plan(args: argparse.Namespace) -> Plan:
    secs = 1.0 if args.quick else args.seconds
    c, cp, ch, d = args.concurrency, args.paced_concurrency, args.chunks, args.chunk_delay_ms
    loads = {
        "sat": Load("sat", f"non-stream c={c}", False, concurrency=c, seconds=secs),
        "stream": Load("stream", f"stream {ch}ch c={c}", True, concurrency=c, seconds=secs),
        "paced": Load(
            "paced",
            f"stream {ch}ch@{d:g}ms c={cp}",
            True,
            concurrency=cp,
            paced=True,
            seconds=secs * 1.5,
            stagger=True,
        ),
        "half": Load("half", "non-stream 50% of sat", False, seconds=secs),
        "ttft": Load("ttft", "TTFT stream c=1", True, concurrency=1, seconds=secs),
    }
    keys = set(args.only or LOAD_KEYS)
    if "half" in keys:
        keys.add("sat")  # its rate is half the measured saturation
    return Plan(
        loads=[loads[k] for k in LOAD_KEYS if k in keys],
        repeats=1 if args.quick else args.repeats,
        warmup_s=0.3 if args.quick else 0.5,
        body_bytes=args.body_bytes,
    )


Results = dict[tuple[str, str], list[Window]]


async def run_all(
    plan: Plan,
    procs: Procs,
    vs: list[Variant],
    logs: Path,
    prof: Profiler,
) -> tuple[Results, dict[str, list[float]]]:
    bodies = {
        (s, paced): chat_bodies(256, s, PACED_MODEL if paced else MODEL, plan.body_bytes)
        for s in (False, True)
        for paced in (False, True)
    }
    results: Results = {}
    rates: dict[str, list[float]] = {}
    names = ["direct"] + [v.name for v in vs]
    for rep in range(plan.repeats):
        for load in plan.loads:
            if load.key == "half":  # half of what the first variant just managed, this repeat
                load = dataclasses.replace(load, rate=0.5 * results[("sat", vs[0].name)][-1].rps)
                rates.setdefault("half", []).append(load.rate)
            for who in names if rep % 2 == 0 else names[::-1]:  # alternate against drift
                pids = {"upstream": procs.upstream.pid, "generator": os.getpid()}
                spy = None
                if who == "direct":
                    targets = procs.paced if load.paced else procs.ports
                else:
                    paced = f"{who}@paced"  # a Rust row's second router
                    proc, port = procs.gateways[paced if load.paced and paced in procs.gateways else who]
                    targets, pids["gateway"] = [port], proc.pid
                    if rep == 0 and load.key in ("sat", "stream", "paced"):
                        spy = prof.start(
                            proc.pid, f"{load.key}-{who}", plan.warmup_s + load.seconds
                        )
                reqs = http_requests(targets[0], bodies[(load.stream, load.paced)])
                w = await measure(load, targets, reqs, pids, plan.warmup_s)
                if spy is not None:
                    spy.wait()
                results.setdefault((load.key, who), []).append(w)
                _progress(rep, plan, load, who, w)
                if w.errors or not w.n:
                    log = logs / f"gateway-{who}.log"
                    tail = log.read_text()[-3000:] if log.exists() else ""
                    msg = f"{load.label} via {who}: {w.errors} failed, {w.n} answered\n{tail}"
                    if not w.n:
                        raise RuntimeError(msg)
                    print(f"bench.overhead: warning: {msg}", file=sys.stderr)
    return results, rates


def _progress(rep: int, plan: Plan, load: Load, who: str, w: Window) -> None:
    print(
        f"  [{rep + 1}/{plan.repeats}] {load.label:<24} {who:<16} {w.rps:8.0f} req/s"
        f"  p50 {pct(w.lat_ms, 0.5):8.2f} ms  gateway {w.share('gateway'):4.0f}% CPU",
        file=sys.stderr,
    )


def med(xs: Iterable[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


@dataclass
class Row:
    """Medians over the repeats of one (load, path) cell; paired with the same repeat's direct run."""

    rps: float
    p50: float
    p99: float
    load_core: float
    other_gw: float
    ratio: float = float("nan")
    cpu_ratio: float = float("nan")
    add50: float = float("nan")
    add99: float = float("nan")
    gw_us: float = float("nan")
    gw_core: float = float("nan")


def row(load: Load, ws: list[Window], ds: list[Window], gcpu: int, direct: bool) -> Row:
    def lat(w: Window) -> list[float]:
        return w.ttft_ms if load.key == "ttft" else w.lat_ms

    r = Row(
        rps=med(w.rps for w in ws),
        p50=med(pct(lat(w), 0.5) for w in ws),
        p99=med(pct(lat(w), 0.99) for w in ws),
        load_core=med(w.share("generator", "upstream") for w in ws),
        other_gw=float("nan"),
    )
    if direct:
        return r
    r.other_gw = med(w.other(gcpu, "gateway") for w in ws)
    pairs = list(zip(ws, ds, strict=True))
    r.ratio = med(g.rps / d.rps for g, d in pairs)
    r.cpu_ratio = med(
        d.us_per_req("generator", "upstream") / g.us_per_req("gateway") for g, d in pairs
    )
    r.add50 = med(pct(lat(g), 0.5) - pct(lat(d), 0.5) for g, d in pairs)
    r.add99 = med(pct(lat(g), 0.99) - pct(lat(d), 0.99) for g, d in pairs)
    r.gw_us = med(w.us_per_req("gateway") for w in ws)
    r.gw_core = med(w.share("gateway") for w in ws)
    return r


def _f(x: float, fmt: str, width: int) -> str:
    return f"{x:{fmt}}".rjust(width) if x == x else "".rjust(width)


def _pc(x: float, width: int) -> str:
    return f"{x:.0f}%".rjust(width) if x == x else "".rjust(width)


def report(
    plan: Plan,
    res: Results,
    rates: dict[str, list[float]],
    vs: list[Variant],
    args: argparse.Namespace,
) -> str:
    gcpu = args.gateway_cpu
    hdr = (
        f"{'load':<24} {'path':<19} {'req/s':>7} {'x direct':>8} {'x cpu':>6} {'p50 ms':>7} "
        f"{'p99 ms':>7} {'+p50 ms':>8} {'+p99 ms':>8} {'gw us/req':>9} {'us/chunk':>8} "
        f"{'gw cpu':>6} {'other':>6} {'load cpu':>8}"
    )
    out = [hdr, "-" * len(hdr)]
    rows: dict[tuple[str, str], Row] = {}
    for load in plan.loads:
        ds = res[(load.key, "direct")]
        label = f"non-stream ~{med(rates['half']):.0f}/s" if load.key == "half" else load.label
        for who in ["direct"] + [v.name for v in vs]:
            r = rows[(load.key, who)] = row(load, res[(load.key, who)], ds, gcpu, who == "direct")
            chunk = r.gw_us / args.chunks if load.stream and load.key != "ttft" else float("nan")
            cpu_x = r.cpu_ratio if load.key in ("sat", "stream") else float("nan")
            out.append(
                f"{label if who == 'direct' else '':<24} {who:<19} {r.rps:7.0f} "
                f"{_f(r.ratio, '.2f', 8)} {_f(cpu_x, '.2f', 6)} {r.p50:7.2f} {r.p99:7.2f} "
                f"{_f(r.add50, '+.2f', 8)} {_f(r.add99, '+.2f', 8)} {_f(r.gw_us, '.0f', 9)} "
                f"{_f(chunk, '.1f', 8)} {_pc(r.gw_core, 6)} {_pc(r.other_gw, 6)} "
                f"{_pc(r.load_core, 8)}"
            )
    out += ["", _notes(res, rows, vs, args), "", _goals(rows, vs, res)]
    return "\n".join(out)


def _notes(res: Results, rows: dict[tuple[str, str], Row], vs: list[Variant], args: Any) -> str:
    lines = []
    if ("sat", "direct") in res:
        d = res[("sat", "direct")]
        gen, up = (
            med(w.us_per_req("generator") for w in d),
            med(w.us_per_req("upstream") for w in d),
        )
        gw = rows[("sat", vs[0].name)].gw_us
        lines.append(
            f"load side, non-stream direct: generator {gen:.0f} us + upstream {up:.0f} us of CPU per "
            f"request on the load CPU, gateway {gw:.0f} us on its own. Direct is bound by the load "
            f"CPU, {100 * gen / (gen + up):.0f}% of it the generator (a free generator could raise "
            f"direct at most {(gen + up) / up:.1f}x); the gateway rows are bound by the gateway."
        )
    for key in ("stream", "paced"):
        if (key, "direct") in res and ("sat", "direct") in res:
            per = [
                (rows[(key, v.name)].gw_us - rows[("sat", v.name)].gw_us) / args.chunks for v in vs
            ]
            text = ", ".join(f"{v.name} {x:.1f} us" for v, x in zip(vs, per, strict=True))
            lines.append(f"{key}: gateway CPU per chunk beyond a non-streamed request: {text}")
    lines += _against_base(res, vs)
    windows = [w for ws in res.values() for w in ws]
    other_gw = med(w.other(args.gateway_cpu, "gateway") for w in windows)
    other_load = med(w.other(args.load_cpu, "generator", "upstream") for w in windows)
    lines.append(
        f"other processes on the gateway CPU: median {other_gw:.0f}% of it, on the load CPU "
        f"{other_load:.0f}%"
    )
    if other_gw > 15:
        lines.append(
            "WARNING: the gateway shared its CPU with other work; req/s, latency and TTFT rows are "
            "pessimistic (CPU per request and 'x cpu' much less so)"
        )
    return "\n".join(lines)


def _against_base(res: Results, vs: list[Variant]) -> list[str]:
    """With --baseline-src: each row's gateway CPU per request over its `@base` row's, the median
    of the ratios of the same repeat's windows (run side by side)."""
    lines = []
    for key in LOAD_KEYS:
        pairs = [(v.name, res.get((key, v.name)), res.get((key, v.name + "@base"))) for v in vs]
        text = ", ".join(
            f"{name} {med(a.us_per_req('gateway') / b.us_per_req('gateway') for a, b in zip(ws, bs, strict=True)):.3f}x"
            for name, ws, bs in pairs
            if ws and bs
        )  # fmt: skip
        if text:
            lines.append(f"{key}: gateway CPU per request, this tree / --baseline-src: {text}")
    return lines


def _goals(rows: dict[tuple[str, str], Row], vs: list[Variant], res: Results) -> str:
    def line(text: str, value: float, ok: bool, fmt: str = "7.2f") -> str:
        verdict = "PASS" if ok else "FAIL"
        return f"  {text:<58} {value:{fmt}}  {verdict if value == value else 'n/a'}"

    def get(key: str, attr: str, name: str) -> float:
        r = rows.get((key, name))
        return getattr(r, attr) if r is not None else float("nan")

    def cpu_over(name: str, base: str) -> float:
        """CPU per saturated request of `name` over `base`'s, taken within each repeat (the two
        ran back to back), then the median: two medians apart would add their noise."""
        pairs = zip(res.get(("sat", name), []), res.get(("sat", base), []), strict=False)
        return med(a.us_per_req("gateway") / b.us_per_req("gateway") for a, b in pairs)

    rust = {v.name for v in vs if v.rust_policy is not None}
    ref = RUST_REFERENCE if RUST_REFERENCE in rust else None
    out = ["goals (medians over repeats)"]
    if ref is None:
        out.append(f"  ({RUST_REFERENCE} not measured: the goals against it read n/a)")
    for v in vs:
        if not v.ours:
            continue
        out.append(f"[{v.name}]")
        s, p = get("stream", "ratio", v.name), get("paced", "ratio", v.name)
        cpu, rps = get("sat", "gw_us", v.name), get("sat", "rps", v.name)
        ref_cpu = get("sat", "gw_us", ref) if ref else float("nan")
        ref_rps = get("sat", "rps", ref) if ref else float("nan")
        half50, half99 = get("half", "add50", v.name), get("half", "add99", v.name)
        ttft = get("ttft", "add50", v.name)
        cpu_x, rps_x = cpu / ref_cpu, rps / ref_rps
        out += [
            line(f"CPU per non-streamed request <= {RUST_REFERENCE}'s (x)", cpu_x, cpu_x <= 1.0),
            line(f"req/s at c=32 >= {RUST_REFERENCE}'s (x)", rps_x, rps_x >= 1.0),
            line(
                f"gateway CPU per non-streamed request <= {GOAL_CPU_PER_REQ_US:.0f} us",
                cpu, cpu <= GOAL_CPU_PER_REQ_US, "7.0f",
            ),
            line(f"stream req/s >= {GOAL_STREAM_UNPACED} x direct (unpaced)", s, s >= GOAL_STREAM_UNPACED),
            line(f"stream req/s >= {GOAL_STREAM_PACED} x direct (paced)", p, p >= GOAL_STREAM_PACED),
            line(f"added p50 at half saturation <= {GOAL_ADDED_P50_MS:g} ms", half50, half50 <= GOAL_ADDED_P50_MS),
            line(f"added p99 at half saturation <= {GOAL_ADDED_P99_MS:g} ms", half99, half99 <= GOAL_ADDED_P99_MS),
            line(f"added TTFT p50 at c=1 <= {GOAL_TTFT_MS:g} ms", ttft, ttft <= GOAL_TTFT_MS),
        ]  # fmt: skip
        if v.name.endswith("+otlp"):  # --tracing otlp: the traced row against its untraced one
            x = cpu_over(v.name, v.name.removesuffix("+otlp"))
            goal = f"traced CPU per request <= {GOAL_TRACED_X:g} x untraced"
            out.append(line(goal, x, x <= GOAL_TRACED_X))
        if v.name.endswith("-log"):  # --log-cost: the row as shipped against its log-off twin
            x = cpu_over(v.name.removesuffix("-log"), v.name)
            out.append(f"  {'CPU per request, request log on / off (x)':<58} {x:7.2f}  (measured)")
    floors = [v.name for v in vs if v.floor is not None]
    if floors:  # not goals: what the rows above are up against
        out.append("[floor: a bare Python pass-through, bench/floor_proxy.py]")
        ref_cpu = get("sat", "gw_us", ref) if ref else float("nan")
        for name in floors:
            x = get("sat", "gw_us", name) / ref_cpu
            out.append(
                f"  {f'{name} CPU per request / {RUST_REFERENCE} (x)':<58} {x:7.2f}  (measured)"
            )
        base = "floor@uvicorn"  # the server layer the gateway runs on: the rest is its own work
        for v in vs:
            if v.ours and base in floors:
                x = get("sat", "gw_us", v.name) / get("sat", "gw_us", base)
                out.append(f"  {f'{v.name} CPU per request / {base} (x)':<58} {x:7.2f}  (measured)")
    return "\n".join(out)


# --- main --------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench.overhead", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one repeat of 1 s windows (~35 s)")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--seconds", type=float, default=1.5, help="timed window per measurement")
    p.add_argument("--only", nargs="+", choices=LOAD_KEYS, help="run only these loads")
    p.add_argument("--concurrency", type=int, default=32, help="connections for sat and stream")
    p.add_argument("--paced-concurrency", type=int, default=128)
    p.add_argument("--chunks", type=int, default=64, help="SSE chunks per streamed response")
    p.add_argument("--chunk-delay-ms", type=float, default=5.0, help="pace of the paced stream")
    p.add_argument("--replicas", type=int, default=3, help="upstream ports per pool")
    p.add_argument(
        "--body-bytes",
        type=int,
        default=BODY_BYTES,
        help="chat body size (the goals are set at 2 KB; production prompts run 10-50 KB)",
    )
    p.add_argument(
        "--policies",
        nargs="+",
        default=["round_robin", DEFAULT_POLICY],
        help=f"gateway rows, one per policy (the pools' default is {DEFAULT_POLICY}); the last "
        "is floor@routed's",
    )
    p.add_argument(
        "--tracing",
        choices=["off", "otlp"],
        default="off",
        help="otlp: add a tracing-on row per policy, OTLP/HTTP to the upstream's /v1/traces sink",
    )
    p.add_argument(
        "--request-log",
        choices=["text", "json", "off"],
        default="text",
        help="the gateway rows' request log: text (as shipped), json, or off (log_level warning)",
    )
    p.add_argument(
        "--log-cost",
        action="store_true",
        help="add each gateway row again with the request log off, and their CPU ratio",
    )
    p.add_argument(
        "--servers",
        nargs="+",
        choices=["uvicorn", "granian"],
        default=["uvicorn"],
        help="granian: one more row, the first policy's gateway app under granian (ASGI)",
    )
    p.add_argument(
        "--rust",
        choices=["auto", "off"],
        default="auto",
        help="auto: add sglang-router rows (cache_aware, round_robin) when it is installed",
    )
    p.add_argument(
        "--floor",
        choices=["on", "off"],
        default="on",
        help="on: add bench/floor_proxy.py rows (a bare pass-through under uvicorn and under a raw "
        "asyncio protocol): the least a Python proxy spends",
    )
    p.add_argument("--gateway-cpu", type=int, help="CPU for the gateway (default: first allowed)")
    p.add_argument("--load-cpu", type=int, help="CPU for upstream and generator (default: second)")
    p.add_argument("--nice", type=int, default=0, help="niceness for every bench process")
    p.add_argument(
        "--gateway-src",
        type=Path,
        help="run the gateway package in this directory (e.g. a `git archive` of another commit)",
    )
    p.add_argument(
        "--baseline-src",
        type=Path,
        help="also run each policy's gateway from this directory, as `<policy>@base` rows (A/B "
        "in one run, interleaved)",
    )
    p.add_argument("--profile", type=Path, help="py-spy the gateway's timed windows into this dir")
    p.add_argument("--profile-native", action="store_true", help="py-spy --native (pauses it)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    allowed = sorted(os.sched_getaffinity(0))
    if args.gateway_cpu is None:
        args.gateway_cpu = allowed[0]
    if args.load_cpu is None:
        args.load_cpu = next((c for c in allowed if c != args.gateway_cpu), args.gateway_cpu)
    if args.load_cpu == args.gateway_cpu:
        print("bench.overhead: needs two CPUs (gateway on one, load on the other)", file=sys.stderr)
        return 2
    os.sched_setaffinity(0, {args.load_cpu})
    if args.nice:
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    plan = make_plan(args)
    t_begin = time.monotonic()
    procs = start_upstream(args, args.load_cpu)
    vs = variants(args, f"http://127.0.0.1:{procs.ports[0]}")
    prof = Profiler(args.profile, args.load_cpu, args.profile_native)
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        try:
            kept = []
            for v in vs:
                port = free_port()
                if not v.ours:  # a reference: one process per pool
                    start = start_rust_router if v.rust_policy is not None else start_floor_proxy
                    paced = free_port()
                    other = start(v, port, procs.ports, Path(tmp), args, args.gateway_cpu)
                    procs.gateways[v.name] = (other, port)
                    other = start(v, paced, procs.paced, Path(tmp), args, args.gateway_cpu)
                    procs.gateways[f"{v.name}@paced"] = (other, paced)
                    kept.append(v)
                    continue
                cfg = gateway_config(port, procs.ports, procs.paced, v)
                try:
                    proc = start_gateway(v, cfg, Path(tmp), args, args.gateway_cpu)
                except RuntimeError as exc:
                    print(f"bench.overhead: skipping {exc}", file=sys.stderr)
                    continue
                procs.gateways[v.name] = (proc, port)
                kept.append(v)
            if not kept:
                return 1
            if not rust_router_installed():
                print("bench.overhead: sglang-router is not installed (pip install sglang-router): "
                      "no Rust router rows", file=sys.stderr)  # fmt: skip
            ours = {v.name for v in kept if v.ours}  # a reference's `@paced` twin is not
            for name, (proc, port) in procs.gateways.items():
                try:
                    wait_ready(port, proc, "/ready" if name in ours else "/health")
                except RuntimeError:
                    for log in Path(tmp).glob("*.log"):
                        print(f"--- {log.name}\n{log.read_text()[-2000:]}", file=sys.stderr)
                    raise
                _pin(proc.pid, args.gateway_cpu, args.nice)  # threads started since launch
            results, rates = _run_loop(run_all(plan, procs, kept, Path(tmp), prof))
        finally:
            procs.stop()
    print(_preamble(args, plan, time.monotonic() - t_begin))
    print(report(plan, results, rates, kept, args))
    if args.profile is not None:
        print("\n" + prof.summary())
    return 0


def _run_loop(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _preamble(args: argparse.Namespace, plan: Plan, elapsed: float) -> str:
    cpu = "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    src = args.gateway_src or "the installed gateway"
    sizes = [len(b) for b in chat_bodies(256, False, MODEL, plan.body_bytes)]
    return (
        f"bench.overhead: {plan.repeats} repeat(s), {args.replicas} replicas per pool, "
        f"256 chat bodies of {min(sizes)}-{max(sizes)} bytes, "
        f"{args.chunks} SSE chunks/stream, paced {args.chunk_delay_ms:g} ms/chunk; gateway ({src}) "
        f"on CPU {args.gateway_cpu}, upstream + generator on CPU {args.load_cpu}; {cpu}, "
        f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}; took {elapsed:.0f} s\n"
    )


if __name__ == "__main__":
    sys.exit(main())
