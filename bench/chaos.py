"""Chaos run: a simulated fleet behind the gateway, steady mixed load, and a fault script.

Replicas are killed and restarted, one stalls mid-stream, one answers 500, one sends garbage SSE,
one dies mid-stream, the gateway's private Redis (index + rate limits) is stopped and restarted,
and a burst of 10x the fleet's admission capacity arrives at once. Every request is then accounted
for from the client side (a complete answer or a clear error, nothing hung, truncated or malformed),
and the error rate and prefix-hit ratio must recover once the faults stop.

    python -m bench.chaos            # the long run (about 3 minutes)
    python -m bench.chaos --short    # the CI-sized run that tests/chaos runs (about 30 s)

Everything runs in one event loop on loopback, except Redis: a private `redis-server` on a free
port, never the shared one on 6379. Exit status 1 when an invariant is violated.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shutil
import socket
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import uvicorn
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway import create_app, parse_config
from gateway.tracing import Tracing
from simulator.fleet import Fleet
from simulator.workloads import text

MODEL = "qwen2.5-14b"
# outcomes that are a defect of the gateway: the client got neither an answer nor a clear error
DEFECTS = ("hung", "truncated_stream", "bad_sse_event", "invalid_json", "malformed_error",
           "connection_error")  # fmt: skip
GARBAGE_DEFECTS = frozenset({"truncated_stream", "bad_sse_event", "invalid_json"})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- the pieces ----------------------------------------------------------------------------------


class PrivateRedis:
    """A throwaway `redis-server` on its own port (no persistence); stop() kills it like a crash."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: asyncio.subprocess.Process | None = None

    @staticmethod
    def available() -> bool:
        return shutil.which("redis-server") is not None

    async def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (scripts/ensure-deps installs it)")
        self._proc = await asyncio.create_subprocess_exec(
            binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while loop.time() < deadline:
            if self._proc.returncode is not None:
                raise RuntimeError(f"redis-server exited on port {self.port}")
            with contextlib.suppress(OSError):
                r, w = await asyncio.open_connection("127.0.0.1", self.port)
                w.write(b"PING\r\n")
                ok = (await r.read(7)).startswith(b"+PONG")
                w.close()
                if ok:
                    return
            await asyncio.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    async def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()


class LoopbackServer:
    """An ASGI app served by uvicorn in the running loop on a free loopback port."""

    def __init__(self, app: Any) -> None:
        config = uvicorn.Config(
            app, host="127.0.0.1", port=0, lifespan="on", loop="none", http="httptools",
            log_config=None, access_log=False, timeout_graceful_shutdown=2,
        )  # fmt: skip
        self.server = uvicorn.Server(config)
        self.server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
        self.task: asyncio.Task[None] | None = None
        self.url = ""

    async def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 15
        while not self.server.started:
            if self.task.done() or loop.time() > deadline:
                raise RuntimeError("the gateway did not start")
            await asyncio.sleep(0.005)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task


# --- the plan ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """Sizes and times (wall seconds from the start of the load)."""

    replicas: int = 4
    speedup: float = 10.0  # 30 simulated seconds = 3 s wall
    rate: float = 40.0  # steady arrivals per second
    warmup_s: float = 4.0
    cycles: int = 1  # the fault script runs this many times, each on other replicas
    cycle_s: float = 15.0
    recovery_s: float = 10.0
    max_inflight: int = 8  # per replica: the admission capacity is replicas x this
    burst_factor: int = 10
    groups: int = 8  # shared system prompts
    system_tokens: int = 600
    seed: int = 1

    @property
    def faults_end_s(self) -> float:
        return self.warmup_s + self.cycles * self.cycle_s

    @property
    def duration_s(self) -> float:
        return self.faults_end_s + self.recovery_s

    @property
    def capacity(self) -> int:
        return self.replicas * self.max_inflight


SHORT = Plan()
LONG = Plan(replicas=5, rate=50.0, warmup_s=10.0, cycles=8, cycle_s=18.0, recovery_s=30.0)

TENANTS = [  # name, key, class, may also use, weight, share of traffic
    ("acme", "sk-chaos-acme-7f3a9c", "interactive", ["batch"], 2.0, 0.5),
    ("beta", "sk-chaos-beta-51d0e2", "interactive", [], 1.0, 0.3),
    ("nightly", "sk-chaos-nightly-a8b4", "batch", [], 1.0, 0.2),
]


def gateway_config(plan: Plan, urls: list[str], redis_url: str) -> dict[str, Any]:
    return {
        "server": {"expose_upstream_errors": False},
        "pools": {
            "chat": {
                "replicas": [{"url": u, "name": f"r{i}"} for i, u in enumerate(urls)],
                "policy": "prefix_aware",
                "max_inflight_per_replica": plan.max_inflight,
                "health": {"interval_s": 0.25, "timeout_s": 0.5, "failures_to_open": 3,
                           "open_s": 1.0},
                "timeouts": {"connect_s": 0.5, "first_byte_s": 2.0, "idle_s": 1.5, "total_s": 4.0},
                "scrape": {"interval_s": 0.25, "timeout_s": 0.5, "stale_after_s": 2.0},
                "retries": 2,
            }
        },
        "index": {"backend": "redis", "redis_url": redis_url},
        "ratelimit": {"backend": "redis", "redis_url": redis_url},
        "priority_classes": {
            "interactive": {"rank": 0, "max_queue_wait_s": 1.5, "max_queue_len": 4 * plan.capacity},
            "batch": {"rank": 1, "max_queue_wait_s": 3.0, "max_queue_len": 8 * plan.capacity},
        },
        "tenants": [
            {"name": n, "api_keys": [k], "priority": c, "allowed_priorities": [c, *also],
             "weight": w, "limits": {"requests_per_second": 10_000}}
            for n, k, c, also, w, _ in TENANTS
        ],
    }  # fmt: skip


def client_deadline_s(cfg: dict[str, Any]) -> float:
    """The longest a request can take at this gateway: queue wait + every attempt + slack."""
    pool = cfg["pools"]["chat"]
    queue = max(c["max_queue_wait_s"] for c in cfg["priority_classes"].values())
    return queue + (pool["retries"] + 1) * pool["timeouts"]["total_s"] + 3.0


# --- one request, judged from the client side --------------------------------------------------


@dataclass
class Result:
    i: int
    t_start: float
    t_end: float
    kind: str  # chat | completions
    stream: bool
    tenant: str
    priority: str
    burst: bool
    trace_id: str
    status: int = 0
    outcome: str = "ok"  # ok | error | shed | one of DEFECTS
    error: str = ""  # error type (status and OpenAI type) for errors and shed
    code: str = ""
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    replica: str | None = None  # from the gateway's trace
    tried: tuple[str, ...] = ()
    retries: int = 0


def _usage(obj: Any) -> tuple[int, int | None]:
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(usage, dict):
        return 0, None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return int(usage.get("prompt_tokens") or 0), cached if isinstance(cached, int) else None


def judge_error_body(res: Result, body: bytes) -> None:
    try:
        err = orjson.loads(body)["error"]
        assert isinstance(err["message"], str) and isinstance(err["type"], str)
        assert "param" in err and "code" in err
    except (orjson.JSONDecodeError, KeyError, TypeError, AssertionError):
        res.outcome = "malformed_error"
        return
    res.error, res.code = f"{res.status} {err['type']}", str(err["code"])
    res.outcome = "shed" if res.status == 429 else "error"


def judge_json(res: Result, body: bytes) -> None:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        res.outcome = "invalid_json"
        return
    if not isinstance(obj, dict) or not isinstance(obj.get("choices"), list) or not obj["choices"]:
        res.outcome = "invalid_json"
        return
    res.prompt_tokens, res.cached_tokens = _usage(obj)


def judge_sse(res: Result, body: bytes) -> None:
    """Content chunks then `[DONE]`: ok; a final `data: {"error": ...}`: a clear error."""
    events = [e for e in body.replace(b"\r\n", b"\n").split(b"\n\n") if e.strip()]
    payloads: list[bytes] = []
    for e in events:
        data = [ln[5:].strip() for ln in e.split(b"\n") if ln.startswith(b"data:")]
        payloads.append(b"\n".join(data))
    if payloads and payloads[-1] != b"[DONE]":
        try:
            last = orjson.loads(payloads[-1])
        except orjson.JSONDecodeError:
            last = None
        if isinstance(last, dict) and isinstance(last.get("error"), dict):
            err = last["error"]
            res.outcome = "error"
            res.error, res.code = f"stream {err.get('type')}", str(err.get("code"))
            return
    if not payloads or payloads[-1] != b"[DONE]" or not body.endswith(b"\n\n"):
        res.outcome = "truncated_stream"
        return
    content = 0
    for p in payloads[:-1]:
        try:
            obj = orjson.loads(p)
        except orjson.JSONDecodeError:
            res.outcome = "bad_sse_event"
            return
        if not isinstance(obj, dict) or "error" in obj:
            res.outcome = "bad_sse_event"
            return
        if obj.get("choices"):
            content += 1
        if obj.get("usage"):
            res.prompt_tokens, res.cached_tokens = _usage(obj)
    if content == 0:
        res.outcome = "truncated_stream"


# --- the run -------------------------------------------------------------------------------------


@dataclass
class Window:
    """Fault intervals per replica, for 'was a healthy replica there?'."""

    faulted: dict[int, list[list[float]]] = field(default_factory=dict)

    def begin(self, replica: int, t: float) -> None:
        self.faulted.setdefault(replica, []).append([t, float("inf")])

    def end(self, replica: int, t: float) -> None:
        for span in self.faulted.get(replica, []):
            if span[1] == float("inf"):
                span[1] = t

    def healthy(self, t: float, n: int, grace_s: float) -> int:
        bad = {r for r, spans in self.faulted.items() for a, b in spans if a <= t <= b + grace_s}
        return n - len(bad)


class Chaos:
    def __init__(self, plan: Plan, log: Callable[[str], None] = print) -> None:
        self.plan = plan
        self.log = log
        self.rng = random.Random(plan.seed)
        self.results: list[Result] = []
        self.pending: set[asyncio.Task[None]] = set()
        self.faults = Window()
        self.events: list[tuple[float, str]] = []
        self.t0 = 0.0
        self.deadline_s = 0.0
        self.url = ""
        self.fleet: Fleet | None = None
        self.redis: PrivateRedis | None = None
        self.http: aiohttp.ClientSession | None = None
        self.exporter = InMemorySpanExporter()
        self._n = 0
        prompts = [
            text(f"chaos-sys-{plan.seed}-{g}", plan.system_tokens) for g in range(plan.groups)
        ]
        self.prompts = prompts

    def now(self) -> float:
        return asyncio.get_running_loop().time() - self.t0

    # the request mix -------------------------------------------------------------------------
    def request(self, burst: bool) -> tuple[str, dict[str, Any], dict[str, str], Result]:
        rng, i = self.rng, self._n
        self._n += 1
        name, key, klass, also, _, _ = rng.choices(TENANTS, [t[5] for t in TENANTS])[0]
        priority = klass if not also or rng.random() < 0.7 else also[0]
        g = rng.randrange(len(self.prompts))
        user = text(f"chaos-user-{self.plan.seed}-{i}", rng.randint(8, 40))
        roll = rng.random()
        kind = "chat" if roll < 0.75 else "completions"
        stream = rng.random() < 0.55
        body: dict[str, Any] = {"model": MODEL, "max_tokens": rng.randint(8, 32), "stream": stream}
        if kind == "chat":
            body["messages"] = [
                {"role": "system", "content": self.prompts[g]},
                {"role": "user", "content": user},
            ]
        else:
            body["prompt"] = self.prompts[g] + user
        if stream and rng.random() < 0.6:
            body["stream_options"] = {"include_usage": True}
        trace_id = f"{rng.getrandbits(128) or 1:032x}"
        headers = {
            "authorization": f"Bearer {key}",
            "content-type": "application/json",
            "traceparent": f"00-{trace_id}-{rng.getrandbits(64) or 1:016x}-01",
            "x-request-id": f"chaos-{i}",
        }
        if priority != klass:
            headers["x-priority"] = priority
        t = self.now()
        res = Result(i, t, t, kind, stream, name, priority, burst, trace_id)
        return (
            f"{self.url}/v1/{'chat/completions' if kind == 'chat' else 'completions'}",
            body,
            headers,
            res,
        )

    async def one(self, burst: bool = False) -> None:
        url, body, headers, res = self.request(burst)
        assert self.http is not None
        try:
            async with asyncio.timeout(self.deadline_s):
                async with self.http.post(url, data=orjson.dumps(body), headers=headers) as resp:
                    res.status = resp.status
                    raw = await resp.read()
            if res.status != 200:
                judge_error_body(res, raw)
            elif res.stream:
                judge_sse(res, raw)
            else:
                judge_json(res, raw)
        except TimeoutError:
            res.outcome = "hung"
        except (aiohttp.ClientError, OSError) as exc:
            res.outcome, res.error = "connection_error", type(exc).__name__
        res.t_end = self.now()
        self.results.append(res)

    def spawn(self, burst: bool = False) -> None:
        task = asyncio.create_task(self.one(burst))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def load(self, until_s: float) -> None:
        """Poisson arrivals at the plan's rate until `until_s`."""
        while True:
            gap = self.rng.expovariate(self.plan.rate)
            if self.now() + gap >= until_s:
                await asyncio.sleep(max(0.0, until_s - self.now()))
                return
            await asyncio.sleep(gap)
            self.spawn()

    # the faults --------------------------------------------------------------------------------
    async def fault(self, i: int, mode: str, **kw: Any) -> None:
        assert self.fleet is not None and self.http is not None
        async with self.http.post(
            self.fleet.urls[i] + "/sim/fault", json={"mode": mode, **kw}
        ) as resp:
            resp.raise_for_status()
        if mode == "none":
            self.faults.end(i, self.now())
        else:
            self.faults.begin(i, self.now())
        self.note(f"r{i} fault {mode} {kw or ''}".strip())

    def note(self, what: str) -> None:
        self.events.append((self.now(), what))

    async def kill(self, i: int) -> None:
        assert self.fleet is not None
        self.faults.begin(i, self.now())
        await self.fleet.stop(i)
        self.note(f"r{i} killed")

    async def restart(self, i: int) -> None:
        assert self.fleet is not None
        await self.fleet.start(i)
        self.faults.end(i, self.now())
        self.note(f"r{i} restarted (cold cache)")

    async def redis_down(self) -> None:
        assert self.redis is not None
        await self.redis.stop()
        self.note("redis stopped")

    async def redis_up(self) -> None:
        assert self.redis is not None
        await self.redis.start()
        self.note("redis restarted (empty)")

    async def burst(self) -> None:
        n = self.plan.burst_factor * self.plan.capacity
        for _ in range(n):
            self.spawn(burst=True)
        self.note(f"burst of {n} requests")

    def script(self, cycle: int) -> list[tuple[float, Callable[[], Awaitable[None]]]]:
        """One fault cycle; the replicas it hits rotate from cycle to cycle."""
        n = self.plan.replicas
        a, b, c, d = ((cycle + k) % n for k in range(4))
        return [
            (0.0, lambda: self.kill(a)),
            (1.0, lambda: self.fault(b, "stall", after_chunks=2, count=3)),
            (3.0, lambda: self.restart(a)),
            (4.0, lambda: self.fault(c, "error_500")),
            (6.0, lambda: self.fault(c, "none")),
            (6.5, lambda: self.fault(d, "garbage_sse", after_chunks=2, count=3)),
            (8.0, self.redis_down),
            (10.0, self.redis_up),
            (11.0, self.burst),
            (12.5, lambda: self.fault(b, "die_midstream", after_chunks=3, count=2)),
            (14.0, lambda: self.all_clear()),
        ]

    async def all_clear(self) -> None:
        for i in range(self.plan.replicas):
            await self.fault(i, "none")

    async def run_script(self) -> None:
        plan = self.plan
        steps: list[tuple[float, Callable[[], Awaitable[None]]]] = []
        for cycle in range(plan.cycles):
            base = plan.warmup_s + cycle * plan.cycle_s
            steps += [(base + t, f) for t, f in self.script(cycle)]
        for at, step in sorted(steps, key=lambda s: s[0]):
            await asyncio.sleep(max(0.0, at - self.now()))
            await step()

    # putting it together --------------------------------------------------------------------------
    async def run(self) -> Report:
        plan = self.plan
        self.redis = PrivateRedis()
        await self.redis.start()
        try:
            async with Fleet(n=plan.replicas, model=MODEL, speedup=plan.speedup,
                             seed=plan.seed) as fleet:  # fmt: skip
                self.fleet = fleet
                cfg = gateway_config(plan, fleet.urls, self.redis.url)
                self.deadline_s = client_deadline_s(cfg)
                tracing = Tracing(None, exporter=self.exporter, environ={})
                server = LoopbackServer(create_app(parse_config(cfg), tracing=tracing))
                await server.start()
                self.url = server.url
                # idle client connections go before the gateway's own 5 s keep-alive timeout
                # closes them: a POST on a connection the server is closing just then fails
                # (HTTP/1.1 keep-alive race, not a gateway fault)
                connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
                timeout = aiohttp.ClientTimeout(total=None)
                try:
                    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
                        self.http = http
                        await self._drive()
                finally:
                    await server.stop()
        finally:
            await self.redis.stop()
        return self.report()

    async def _drive(self) -> None:
        plan = self.plan
        self.t0 = asyncio.get_running_loop().time()
        script = asyncio.create_task(self.run_script())
        await self.load(plan.duration_s)
        await script
        if self.pending:
            await asyncio.wait(set(self.pending))

    def report(self) -> Report:
        spans = {
            f"{s.context.trace_id:032x}": s
            for s in self.exporter.get_finished_spans()
            if s.name == "gateway.request" and s.context is not None
        }
        for r in self.results:
            span = spans.get(r.trace_id)
            if span is not None and span.attributes is not None:
                a = span.attributes
                r.replica = a.get("gateway.replica")  # type: ignore[assignment]
                r.tried = tuple(a.get("gateway.replicas_tried") or ())  # type: ignore[arg-type]
                r.retries = int(a.get("gateway.retries") or 0)  # type: ignore[arg-type]
        return Report(self.plan, sorted(self.results, key=lambda r: r.i), self.faults,
                      self.events, self.deadline_s)  # fmt: skip


# --- the accounting ------------------------------------------------------------------------------


@dataclass
class Report:
    plan: Plan
    results: list[Result]
    faults: Window
    events: list[tuple[float, str]]
    deadline_s: float
    garbage_replicas: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        self.garbage_replicas = frozenset(
            what.split()[0] for _, what in self.events if "garbage_sse" in what
        )

    def phase(self, r: Result) -> str:
        if r.burst:
            return "burst"
        if r.t_start < self.plan.warmup_s:
            return "warmup"
        return "faults" if r.t_start < self.plan.faults_end_s else "recovery"

    def known_defect(self, r: Result) -> bool:
        """A defect explained by the garbage_sse fault (the gateway relays it: reported)."""
        return r.outcome in GARBAGE_DEFECTS and r.replica in self.garbage_replicas

    def hit_ratio(self, lo: float, hi: float) -> float | None:
        rs = [r for r in self.results
              if lo <= r.t_end < hi and r.outcome == "ok" and r.cached_tokens is not None
              and r.prompt_tokens]  # fmt: skip
        prompt = sum(r.prompt_tokens for r in rs)
        return sum(r.cached_tokens or 0 for r in rs) / prompt if prompt else None

    @property
    def baseline_hit(self) -> float:
        return self.hit_ratio(self.plan.warmup_s / 2, self.plan.warmup_s) or 0.0

    def recovery_s(self) -> float | None:
        """Wall seconds from the end of the faults to the first 1-s window back at 90% of the
        warm-up hit ratio, after which no window drops below 80% of it (None: never)."""
        end, base = self.plan.faults_end_s, self.baseline_hit
        windows = []
        t = end
        while t + 1.0 <= self.plan.duration_s + 1e-9:
            windows.append((t, self.hit_ratio(t, t + 1.0)))
            t += 1.0
        for k, (start, ratio) in enumerate(windows):
            if (
                ratio is not None
                and ratio >= 0.9 * base
                and all(x is None or x >= 0.8 * base for _, x in windows[k:])
            ):
                return start - end
        return None

    def unsent_5xx(self) -> list[Result]:
        """5xx answers for requests no replica saw, while a replica was healthy."""
        grace = 2.5  # a restarted or cleared replica: circuit half-open after open_s, then probed
        return [
            r for r in self.results
            if r.status >= 500 and not r.tried
            and self.faults.healthy(r.t_start, self.plan.replicas, grace) > 0
        ]  # fmt: skip

    def errors_after_faults(self, settle_s: float = 2.0) -> list[Result]:
        return [r for r in self.results
                if r.t_start >= self.plan.faults_end_s + settle_s and r.outcome != "ok"]  # fmt: skip

    def violations(self) -> list[str]:
        out = []
        defects = Counter(r.outcome for r in self.results
                          if r.outcome in DEFECTS and not self.known_defect(r))  # fmt: skip
        if defects:
            out.append(f"defects (neither an answer nor a clear error): {dict(defects)}")
        hung = sum(r.outcome == "hung" for r in self.results)
        if hung:
            out.append(f"{hung} requests hung past the {self.deadline_s:.0f} s client deadline")
        unsent = self.unsent_5xx()
        if unsent:
            out.append(f"{len(unsent)} 5xx never sent to a replica while one was healthy: "
                       f"{Counter(r.error for r in unsent)}")  # fmt: skip
        late = self.errors_after_faults()
        if late:
            out.append(f"{len(late)} errors after the faults stopped: "
                       f"{Counter(r.outcome + ' ' + r.error for r in late)}")  # fmt: skip
        rec = self.recovery_s()
        if rec is None:
            out.append(f"the prefix-hit ratio did not recover (baseline {self.baseline_hit:.2f})")
        elif rec * self.plan.speedup > 30.0:
            out.append(f"the prefix-hit ratio took {rec:.1f} s wall = "
                       f"{rec * self.plan.speedup:.0f} s simulated to recover (> 30 s)")  # fmt: skip
        if not any(r.outcome == "ok" for r in self.results if self.phase(r) == "recovery"):
            out.append("no request succeeded after the faults")
        return out

    def table(self) -> str:
        p = self.plan
        phases = ["warmup", "faults", "burst", "recovery"]
        cols = ["sent", "ok", "failed over", "shed", "errors", "defects", "hung"]
        lines = [
            f"chaos: {p.replicas} replicas, speedup {p.speedup:g}, {p.rate:g} req/s steady, "
            f"{p.cycles} fault cycle(s), {p.duration_s:.0f} s, seed {p.seed}, "
            f"client deadline {self.deadline_s:.0f} s",
            f"{'phase':<10}" + "".join(f"{c:>12}" for c in cols),
        ]

        def row(name: str, rs: list[Result]) -> str:
            vals = [
                len(rs),
                sum(r.outcome == "ok" for r in rs),
                sum(r.outcome == "ok" and r.retries > 0 for r in rs),
                sum(r.outcome == "shed" for r in rs),
                sum(r.outcome == "error" for r in rs),
                sum(r.outcome in DEFECTS and r.outcome != "hung" for r in rs),
                sum(r.outcome == "hung" for r in rs),
            ]
            return f"{name:<10}" + "".join(f"{v:>12}" for v in vals)

        for ph in phases:
            lines.append(row(ph, [r for r in self.results if self.phase(r) == ph]))
        lines.append(row("total", self.results))
        errs = Counter(f"{r.outcome}: {r.error}" for r in self.results
                       if r.outcome in ("error", "shed"))  # fmt: skip
        lines.append("errors by type:")
        lines += [f"  {n:>6}  {k}" for k, n in errs.most_common()] or ["       0"]
        defects = Counter(
            f"{r.outcome}{' (garbage_sse relayed: known, reported)' if self.known_defect(r) else ''}"
            for r in self.results if r.outcome in DEFECTS
        )  # fmt: skip
        lines.append("defects:")
        lines += [f"  {n:>6}  {k}" for k, n in defects.most_common()] or ["       0"]
        rec = self.recovery_s()
        fault_hit = self.hit_ratio(p.warmup_s, p.faults_end_s)
        lines.append(
            f"prefix-hit ratio: warm-up {self.baseline_hit:.2f}, during faults "
            f"{fault_hit if fault_hit is not None else float('nan'):.2f}, last 3 s "
            f"{self.hit_ratio(p.duration_s - 3, p.duration_s + 1) or 0:.2f}; recovered "
            + ("never" if rec is None else f"{rec:.1f} s wall ({rec * p.speedup:.0f} s simulated)")
            + " after the faults stopped"
        )
        late = self.errors_after_faults()
        lines.append(f"errors started >2 s after the faults stopped: {len(late)}; "
                     f"unsent 5xx with a healthy replica: {len(self.unsent_5xx())}")  # fmt: skip
        first = [(t, w) for t, w in self.events if t < p.warmup_s + p.cycle_s]
        more = f" (then {p.cycles - 1} more cycles on rotated replicas)" if p.cycles > 1 else ""
        lines.append("fault script: " + "; ".join(f"{t:.1f}s {w}" for t, w in first) + more)
        return "\n".join(lines)


async def run_chaos(plan: Plan, log: Callable[[str], None] = print) -> Report:
    return await Chaos(plan, log).run()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.chaos", description=__doc__.splitlines()[0])
    p.add_argument("--short", action="store_true", help="the CI-sized run (about 30 s)")
    p.add_argument("--cycles", type=int, help="fault cycles (long run: 8)")
    p.add_argument("--replicas", type=int)
    p.add_argument("--rate", type=float, help="steady arrivals per second")
    p.add_argument("--speedup", type=float)
    p.add_argument("--seed", type=int)
    args = p.parse_args(argv)
    plan = SHORT if args.short else LONG
    overrides = {k: v for k, v in vars(args).items() if k != "short" and v is not None}
    plan = Plan(**{**plan.__dict__, **overrides})
    t = time.perf_counter()
    report = asyncio.run(run_chaos(plan))
    print(report.table())
    bad = report.violations()
    print(f"wall time {time.perf_counter() - t:.0f} s")
    for v in bad:
        print("VIOLATION:", v)
    print("OK: every request got a complete answer or a clear error" if not bad else "FAILED")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
