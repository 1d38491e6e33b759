"""Chaos run: a simulated fleet behind the gateway, steady mixed load, and a fault script.

Replicas are killed and restarted, one stalls mid-stream, one answers 500, one sends garbage SSE,
one dies mid-stream, the gateway's private Redis (index + rate limits) is stopped and restarted,
and a burst of 10x the fleet's admission capacity arrives at once. Every request is then accounted
for from the client side (a complete answer or a clear error, nothing hung, truncated or malformed),
and the error rate and prefix-hit ratio must recover once the faults stop.

Then the hostile phases (the reproductions of the hardening issue, one row each): a rogue replica
that frames SSE with CRLF, sends a non-UTF-8 or a non-JSON event, or dies in the middle of an
event; a flood of unique `cache_salt` values (the index must stay under `index.max_blocks`); a
tenant with a small `tokens_per_minute` asking for huge `max_tokens` (none may be admitted); and
slow request bodies, keyless and keyed, while `/health` must keep answering.

    python -m bench.chaos            # the default run, the one tests/chaos runs (about 45 s)
    python -m bench.chaos --long     # 5 replicas, 8 fault cycles (about 3.5 minutes)

Everything runs in one event loop on loopback, except Redis: a private `redis-server` on a free
port, never the shared one on 6379. Exit status 1 when an invariant is violated.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bench import verdict
from bench.harness import free_port, lifespan_done, read_body, start_server
from gateway import create_app
from gateway.config import load_config
from gateway.telemetry.tracing import Tracing
from simulator.fleet import Fleet
from simulator.workloads import text

MODEL = "qwen2.5-14b"
# outcomes that are a defect of the gateway: the client got neither an answer nor a clear error
DEFECTS = ("hung", "truncated_stream", "bad_sse_event", "invalid_json", "malformed_error",
           "connection_error", "admitted_past_limit", "health_unanswered",
           "check_failed")  # fmt: skip
ROGUE_MODEL = "rogue-model"
ROGUE_MODES = ("crlf", "garbage_utf8", "garbage_json", "die_mid_event")
TINY = ("tiny", "sk-chaos-tiny-3c91", 3000)  # name, key, tokens_per_minute
ADMIN_KEY = "sk-chaos-admin-0d6e"
# secrets that /admin/config must never show: the private Redis's password (it really requires
# it) and the password in the userinfo of a replica URL (the dead one of the flap pool)
REDIS_PASSWORD = "chaos-redis-pw-5b1f9e"
REPLICA_PASSWORD = "chaos-replica-pw-77c2"
FLAP_MODEL = "flap-model"


# --- the pieces ----------------------------------------------------------------------------------


class PrivateRedis:
    """A throwaway `redis-server` on its own port (no persistence); stop() kills it like a crash."""

    def __init__(self, port: int | None = None, password: str | None = None) -> None:
        self.port = port or free_port()
        self.password = password
        auth = f":{password}@" if password else ""
        self.url = f"redis://{auth}127.0.0.1:{self.port}/0"
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
            *(("--requirepass", self.password) if self.password else ()),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while loop.time() < deadline:
            if self._proc.returncode is not None:
                raise RuntimeError(f"redis-server exited on port {self.port}")
            with contextlib.suppress(OSError):
                r, w = await asyncio.open_connection("127.0.0.1", self.port)
                w.write(self._auth() + b"PING\r\n")
                if self.password:
                    await r.readline()  # +OK (or -WRONGPASS: then no +PONG below)
                ok = (await r.readline()).startswith(b"+PONG")
                w.close()
                if ok:
                    return
            await asyncio.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    async def info(self) -> dict[str, float]:
        """DBSIZE and used_memory, over a raw connection (RESP)."""
        r, w = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            w.write(self._auth() + b"DBSIZE\r\nINFO memory\r\n")
            if self.password:
                await r.readline()
            keys = int((await r.readline())[1:])
            size = int((await r.readline())[1:])
            text = (await r.readexactly(size + 2)).decode()
        finally:
            w.close()
        mem = next(int(ln.split(":")[1]) for ln in text.splitlines()
                   if ln.startswith("used_memory:"))  # fmt: skip
        return {"redis_keys": float(keys), "redis_used_memory": float(mem)}

    def _auth(self) -> bytes:
        return f"AUTH {self.password}\r\n".encode() if self.password else b""

    async def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()


class RogueReplica:
    """An OpenAI-speaking replica that breaks SSE the ways real ones have (the issue's repros).

    The mode comes from the request body's `user` field (`rogue:<mode>`), one of ROGUE_MODES:
    `crlf` (a good stream framed with CRLF CRLF), `garbage_utf8` / `garbage_json` (two good events,
    then one that is not UTF-8 / not JSON, then the rest), `die_mid_event` (two good events, half of
    a third, then the connection is dropped)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    @staticmethod
    def _chunk(i: int, text: str) -> bytes:
        return b"data: " + orjson.dumps({
            "id": "cmpl-rogue", "object": "chat.completion.chunk", "created": 0,
            "model": ROGUE_MODEL,
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
        }) + b"\n\n"  # fmt: skip

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if await lifespan_done(scope, receive, send):
            return
        path = scope["path"]
        if path == "/v1/models":
            await self._whole(send, 200, {"object": "list",
                                          "data": [{"id": ROGUE_MODEL, "object": "model"}]})
            return
        if path != "/v1/chat/completions":
            await self._whole(send, 200, {"status": "ok"})
            return
        body = orjson.loads(await read_body(receive))
        mode = str(body.get("user", "")).removeprefix("rogue:")
        self.calls[mode] += 1
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        chunks = [self._chunk(i, f"tok{i} ") for i in range(6)]

        async def out(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})
            await asyncio.sleep(0.01)

        for i, c in enumerate(chunks):
            if i == 2 and mode == "garbage_utf8":
                await out(b"data: {\"id\": \"\xff\xfe\xc3\x28 not utf-8\"}\n\n")
            elif i == 2 and mode == "garbage_json":
                await out(b"data: {\"id\": cmpl-rogue, choices: [oops\n\n")
            elif i == 2 and mode == "die_mid_event":
                await out(c[: len(c) // 2])
                raise ConnectionAbortedError("rogue replica dies mid-event")
            await out(c.replace(b"\n", b"\r\n") if mode == "crlf" else c)
        done = b"data: [DONE]\n\n"
        await send({"type": "http.response.body",
                    "body": done.replace(b"\n", b"\r\n") if mode == "crlf" else done})

    @staticmethod
    async def _whole(send: Any, status: int, obj: Any) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": orjson.dumps(obj)})


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
    hostile: bool = True  # the hostile phases after the recovery window
    index_max_blocks: int = 5_000  # small, so the cache_salt flood meets the bound
    salt_flood: int = 300  # requests, each with its own cache_salt
    rogue_per_mode: int = 12  # streamed requests per rogue-replica mode
    huge_max_tokens: int = 20  # requests of the small-bucket tenant
    slow_bodies: int = 40  # connections trickling a body (half keyless, half keyed)
    body_timeout_s: float = 2.0
    reload_requests: int = 20  # requests around the rejected reload (all must succeed)
    flap_s: float = 2.0  # how long the dead replica's metric and /ready are sampled

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


def gateway_config(plan: Plan, urls: list[str], redis_url: str,
                   rogue_url: str | None = None, dead_url: str | None = None) -> dict[str, Any]:
    cfg = {
        "server": {"expose_upstream_errors": False, "body_timeout_s": plan.body_timeout_s,
                   "admin_key": ADMIN_KEY},
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
        "index": {"backend": "redis", "redis_url": redis_url, "max_blocks": plan.index_max_blocks},
        "ratelimit": {"backend": "redis", "redis_url": redis_url},
        "priority_classes": {
            "interactive": {"rank": 0, "max_queue_wait_s": 1.5, "max_queue_len": 4 * plan.capacity},
            "batch": {"rank": 1, "max_queue_wait_s": 3.0, "max_queue_len": 8 * plan.capacity},
        },
        "tenants": [
            {"name": n, "api_keys": [k], "priority": c, "allowed_priorities": [c, *also],
             "weight": w, "limits": {"requests_per_second": 10_000}}
            for n, k, c, also, w, _ in TENANTS
        ] + [{"name": TINY[0], "api_keys": [TINY[1]], "priority": "batch",
              "limits": {"tokens_per_minute": TINY[2]}}],
    }  # fmt: skip
    if rogue_url is not None:
        cfg["pools"]["rogue"] = {  # type: ignore[index]
            "replicas": [{"url": rogue_url, "name": "rogue", "models": [ROGUE_MODEL]}],
            "policy": "round_robin", "retries": 2,
            "health": {"interval_s": 0.25, "timeout_s": 0.5, "failures_to_open": 1000,
                       "open_s": 0.5},
            "timeouts": {"connect_s": 0.5, "first_byte_s": 2.0, "idle_s": 1.5, "total_s": 4.0},
            "scrape": {"enabled": False},
        }  # fmt: skip
        cfg["routes"] = [{"match": {"model": ROGUE_MODEL}, "pool": "rogue"}, {"pool": "chat"}]
        if dead_url is not None:
            # a dead replica that flaps: nothing listens at its URL (which carries user:pass),
            # its circuit opens, goes half-open every open_s and fails its trial; retries 0, so
            # a client request sent to it on trial would fail. The live one is the rogue replica
            # in its plain mode (a good stream)
            cfg["pools"]["flap"] = {  # type: ignore[index]
                "replicas": [{"url": rogue_url, "name": "flap-live", "models": [FLAP_MODEL]},
                             {"url": dead_url, "name": "flap-dead", "models": [FLAP_MODEL]}],
                "policy": "round_robin", "retries": 0,
                "health": {"interval_s": 0.1, "timeout_s": 0.3, "failures_to_open": 1,
                           "open_s": 0.2},
                "timeouts": {"connect_s": 0.3, "first_byte_s": 2.0, "idle_s": 1.5,
                             "total_s": 4.0},
                "scrape": {"enabled": False},
            }
            cfg["routes"].insert(1, {"match": {"model": FLAP_MODEL}, "pool": "flap"})
    return cfg


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
    tag: str = ""  # the hostile phase it belongs to ("" : the steady load)


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
    """Content chunks then `[DONE]`: ok; a final `data: {"error": ...}`: a clear error.

    Events may end in LF, CRLF or CR (all three are SSE); every byte must be UTF-8 and every event
    before the last a JSON object, so garbage relayed from a replica is a defect either way."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        res.outcome = "bad_sse_event"
        return
    body = body.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    events = [e for e in body.split(b"\n\n") if e.strip()]
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
            if not body.endswith(b"\n\n") or any(not _content_event(p) for p in payloads[:-1]):
                res.outcome = "bad_sse_event"  # an error event, but after a broken event
                return
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


def _content_event(payload: bytes) -> bool:
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return False
    return isinstance(obj, dict) and "error" not in obj


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
        self.rogue = RogueReplica()
        self.index_before: dict[str, float] = {}
        self.index_after: dict[str, float] = {}
        self.cfg: dict[str, Any] | None = None
        self.config_path: Path | None = None
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
        await self.post(url, body, headers, res)

    async def post(self, url: str, body: dict[str, Any], headers: dict[str, str],
                   res: Result) -> None:
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

    # the hostile phases (the hardening issue's reproductions) ----------------------------------
    def custom(self, tag: str, body: dict[str, Any], key: str, tenant: str) -> Awaitable[None]:
        i, self._n = self._n, self._n + 1
        trace_id = f"{self.rng.getrandbits(128) or 1:032x}"
        headers = {"authorization": f"Bearer {key}", "content-type": "application/json",
                   "traceparent": f"00-{trace_id}-{self.rng.getrandbits(64) or 1:016x}-01",
                   "x-request-id": f"chaos-{i}"}  # fmt: skip
        t = self.now()
        res = Result(i, t, t, "chat", bool(body.get("stream")), tenant, "", False, trace_id,
                     tag=tag)  # fmt: skip
        return self.post(f"{self.url}/v1/chat/completions", body, headers, res)

    async def index_metrics(self) -> dict[str, float]:
        assert self.http is not None
        async with self.http.get(self.url + "/metrics") as resp:
            lines = (await resp.text()).splitlines()
        out: dict[str, float] = {"blocks": 0.0}
        for ln in lines:
            if ln.startswith("#") or " " not in ln:
                continue
            name, value = ln.rsplit(" ", 1)
            base = name.split("{", 1)[0]
            if base in ("gateway_index_scopes", "gateway_index_bytes",
                        "gateway_index_bound_evicted_blocks_total"):
                out[base.removeprefix("gateway_index_")] = float(value)
            elif base == "gateway_index_blocks":
                out["blocks"] += float(value)
        if self.redis is not None:  # the Redis backend keeps its entries there
            with contextlib.suppress(OSError, ValueError, StopIteration):
                out.update(await self.redis.info())
        return out

    async def index_after_upkeep(self, wait_s: float = 5.0) -> dict[str, float]:
        """The index's metrics once its bound has had its say: the Redis backend trims in its
        flusher when the write queue empties (or every second under load), so a read taken with
        the flood's last writes still queued may see the namespace a batch past the bound."""
        deadline = time.monotonic() + wait_s
        while True:
            got = await self.index_metrics()
            blocks = got.get("blocks") or got.get("redis_keys")
            if blocks is not None and blocks <= self.plan.index_max_blocks:
                return got
            if time.monotonic() >= deadline:
                return got
            await asyncio.sleep(0.25)

    async def batches(self, calls: list[Awaitable[None]], n: int = 40) -> None:
        for k in range(0, len(calls), n):
            await asyncio.gather(*calls[k:k + n])

    async def hostile(self) -> None:
        plan, acme = self.plan, TENANTS[0]
        msgs = [{"role": "user", "content": "hello rogue"}]
        calls = [self.custom(f"sse {mode}", {"model": ROGUE_MODEL, "messages": msgs, "stream": True,
                                              "max_tokens": 8, "user": f"rogue:{mode}"},
                             acme[1], acme[0])
                 for mode in ROGUE_MODES for _ in range(plan.rogue_per_mode)]  # fmt: skip
        self.note(f"rogue replica: {len(calls)} streams ({', '.join(ROGUE_MODES)})")
        await self.batches(calls)
        self.index_before = await self.index_metrics()
        flood = []
        for k in range(plan.salt_flood):
            body = {"model": MODEL, "max_tokens": 4, "cache_salt": f"flood-{plan.seed}-{k}",
                    "messages": [{"role": "system", "content": self.prompts[k % len(self.prompts)]},
                                 {"role": "user", "content": f"salted {k}"}]}  # fmt: skip
            flood.append(self.custom("salt flood", body, acme[1], acme[0]))
        self.note(f"{len(flood)} requests with unique cache_salt")
        await self.batches(flood)
        self.index_after = await self.index_after_upkeep()
        huge = [self.custom("huge max_tokens", {"model": MODEL, "messages": msgs,
                                                 "max_tokens": 50_000 + k}, TINY[1], TINY[0])
                for k in range(plan.huge_max_tokens)]  # fmt: skip
        self.note(f"{len(huge)} requests with max_tokens 50000 from a {TINY[2]} tokens/min tenant")
        await self.batches(huge)
        self.note(f"{plan.slow_bodies} slow bodies (half keyless) while /health is probed")
        slow = [self.slow_body(keyed=k % 2 == 1) for k in range(plan.slow_bodies)]
        await asyncio.gather(*slow, self.probe_health(plan.body_timeout_s + 1.0))
        if self.config_path is not None:
            await self.reload_phase()
            await self.flap_phase()
            await self.secrets_phase()

    # admin checks: one Result each, ok or check_failed (a defect: the run fails) ---------------
    def check(self, tag: str, ok: bool, what: str, t: float | None = None) -> bool:
        i, self._n = self._n, self._n + 1
        t0 = self.now() if t is None else t
        res = Result(i, t0, self.now(), "admin", False, "-", "", False, "", tag=tag)
        if not ok:
            res.outcome, res.error = "check_failed", what
            self.log(f"chaos: {tag}: CHECK FAILED: {what}")
        self.results.append(res)
        return ok

    async def admin(self, method: str, path: str) -> tuple[int, bytes]:
        assert self.http is not None
        headers = {"authorization": f"Bearer {ADMIN_KEY}"}
        async with asyncio.timeout(10.0):
            async with self.http.request(method, self.url + path, headers=headers) as resp:
                return resp.status, await resp.read()

    async def max_inflight(self, pool: str = "chat") -> set[int]:
        _, raw = await self.admin("GET", "/admin/status")
        pools = {p["name"]: p for p in orjson.loads(raw)["pools"]}
        return {r["max_inflight"] for r in pools[pool]["replicas"]}

    def chat(self, tag: str, n: int, model: str = MODEL, stream: bool = False) -> list[Awaitable[None]]:
        acme = TENANTS[0]
        return [self.custom(tag, {"model": model, "max_tokens": 8, "stream": stream,
                                  "user": "rogue:plain",
                                  "messages": [{"role": "user", "content": f"{tag} {k}"}]},
                            acme[1], acme[0])
                for k in range(n)]  # fmt: skip

    def write_config(self, cfg: dict[str, Any]) -> None:
        assert self.config_path is not None
        self.config_path.write_bytes(orjson.dumps(cfg, option=orjson.OPT_INDENT_2))

    async def reload_phase(self) -> None:
        """A reload that validates but fails while applied (tokens chunking, and a tokenizer
        path to a file that exists but is not a tokenizer): 422 with an OpenAI-shaped error,
        `last_error` in /admin/config, the running config unchanged, requests still served;
        then a valid reload applies."""
        assert self.config_path is not None and self.cfg is not None
        tag, base = "reload rejected", self.plan.max_inflight
        before = await self.max_inflight()
        not_tok = self.config_path.parent / "not-a-tokenizer.json"
        not_tok.write_text('{"this file": "is not a tokenizer"}\n')
        bad = orjson.loads(orjson.dumps(self.cfg))
        bad["pools"]["chat"]["max_inflight_per_replica"] = base + 1
        bad["index"]["chunking"] = {"mode": "tokens", "tokenizer": str(not_tok)}
        self.write_config(bad)
        self.note("reload: a config that validates but cannot be applied (tokenizer file is not one)")
        t = self.now()
        calls = self.chat(tag, self.plan.reload_requests)
        half = len(calls) // 2
        reload_call = self.admin("POST", "/admin/reload")
        *_, (status, raw) = await asyncio.gather(*calls[:half], reload_call)
        try:
            err = orjson.loads(raw).get("error")
        except orjson.JSONDecodeError:
            err = None
        shaped = (isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"]
                  and isinstance(err.get("type"), str) and "code" in err and "param" in err)
        self.check(tag, status == 422 and bool(shaped),
                   f"POST /admin/reload answered {status} {raw[:200]!r} (want 422, OpenAI error)", t)
        _, raw = await self.admin("GET", "/admin/config")
        version = orjson.loads(raw).get("version", {})
        self.check(tag, bool(version.get("last_error")),
                   f"/admin/config version has no last_error after the rejected reload: {version}")
        after = await self.max_inflight()
        self.check(tag, after == before == {base},
                   f"max_inflight per replica {before} before, {after} after a rejected reload")
        await asyncio.gather(*calls[half:])
        tag = "reload applied"
        good = orjson.loads(orjson.dumps(self.cfg))
        good["pools"]["chat"]["max_inflight_per_replica"] = base + 1
        self.write_config(good)
        self.note(f"reload: a valid config (max_inflight_per_replica {base} -> {base + 1})")
        t = self.now()
        status, raw = await self.admin("POST", "/admin/reload")
        applied = status == 200 and orjson.loads(raw).get("applied") is True
        self.check(tag, applied, f"POST /admin/reload of a valid config: {status} {raw[:200]!r}", t)
        _, raw = await self.admin("GET", "/admin/config")
        version = orjson.loads(raw).get("version", {})
        self.check(tag, version.get("last_error") is None,
                   f"last_error still set after a valid reload: {version.get('last_error')!r}")
        now_inflight = await self.max_inflight()
        self.check(tag, now_inflight == {base + 1},
                   f"max_inflight per replica {now_inflight} after the valid reload (want {base + 1})")
        await self.batches(self.chat(tag, self.plan.reload_requests // 2))

    async def flap_phase(self) -> None:
        """The dead replica of pool `flap` (nothing listens) flaps open / half-open: sampled
        from /metrics and /ready it reads 0 and is not counted, and no client request of the
        pool (retries 0) fails because of its trials."""
        assert self.http is not None
        tag = "flap dead replica"
        self.note(f"flap: sampling the dead replica for {self.plan.flap_s:g} s under requests")
        end = self.now() + self.plan.flap_s
        states: Counter[str] = Counter()

        async def sample() -> None:
            assert self.http is not None
            while self.now() < end:
                t = self.now()
                async with self.http.get(self.url + "/metrics") as resp:
                    lines = (await resp.text()).splitlines()
                up = [ln for ln in lines if ln.startswith("gateway_replica_up{")
                      and 'pool="flap"' in ln and 'replica="flap-dead"' in ln]  # fmt: skip
                for ln in lines:
                    if (ln.startswith("gateway_replica_circuit_state{") and 'replica="flap-dead"'
                            in ln and ln.endswith(" 1.0")):
                        states[ln.split('state="', 1)[1].split('"', 1)[0]] += 1
                value = float(up[0].rsplit(" ", 1)[1]) if len(up) == 1 else None
                async with self.http.get(self.url + "/ready") as resp:
                    ready = orjson.loads(await resp.read())
                counted = ready.get("available_replicas", {}).get("flap")
                self.check(tag, value == 0.0 and counted == 1,
                           f"dead replica: gateway_replica_up {value}, /ready counts {counted} "
                           "of pool flap (want 0 and 1, the live one)", t)
                await asyncio.sleep(0.05)

        async def load() -> None:
            pending = []
            while self.now() < end:
                pending += self.chat(tag, 1, model=FLAP_MODEL, stream=True)
                pending[-1] = asyncio.ensure_future(pending[-1])
                await asyncio.sleep(0.05)
            await asyncio.gather(*pending)

        await asyncio.gather(sample(), load())
        self.note(f"flap: dead replica circuit states seen {dict(states)}")
        self.check(tag, states.get("half_open", 0) + states.get("open", 0) > 0,
                   f"the dead replica's circuit never read open or half-open: {dict(states)}")

    async def secrets_phase(self) -> None:
        tag = "secrets /admin/config"
        t = self.now()
        status, raw = await self.admin("GET", "/admin/config")
        text = raw.decode("utf-8", "replace")
        leaked = [s for s in (REDIS_PASSWORD, REPLICA_PASSWORD) if s in text]
        self.check(tag, status == 200 and not leaked,
                   f"/admin/config ({status}) shows the password(s) {leaked}", t)
        self.check(tag, "***" in text, "/admin/config shows no masked URL (were the secrets set?)")
        self.note("secrets: /admin/config checked for the Redis and replica URL passwords")

    async def slow_body(self, keyed: bool) -> None:
        i, self._n = self._n, self._n + 1
        t = self.now()
        tag = "slow body " + ("keyed" if keyed else "keyless")
        res = Result(i, t, t, "chat", False, TENANTS[1][0] if keyed else "-", "", False, "",
                     tag=tag)  # fmt: skip
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        auth = f"authorization: Bearer {TENANTS[1][1]}\r\n" if keyed else ""
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n"
                f"content-type: application/json\r\ncontent-length: 100000\r\n{auth}\r\n")
        writer = None
        try:
            async with asyncio.timeout(self.plan.body_timeout_s + 3.0):
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(head.encode() + b'{"model": "')

                async def trickle() -> None:
                    with contextlib.suppress(OSError):
                        while True:
                            await asyncio.sleep(0.2)
                            writer.write(b"a")
                            await writer.drain()

                dribble = asyncio.create_task(trickle())
                try:
                    raw = await reader.readuntil(b"\r\n\r\n")
                    res.status = int(raw.split(b" ", 2)[1])
                    length = 0
                    for ln in raw.split(b"\r\n")[1:]:
                        k, _, v = ln.partition(b":")
                        if k.strip().lower() == b"content-length":
                            length = int(v)
                    payload = await reader.readexactly(length)
                finally:
                    dribble.cancel()
            judge_error_body(res, payload)
        except TimeoutError:
            res.outcome = "hung"
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError) as exc:
            res.outcome, res.error = "connection_error", type(exc).__name__
        finally:
            if writer is not None:
                writer.close()
        res.t_end = self.now()
        self.results.append(res)

    async def probe_health(self, for_s: float) -> None:
        assert self.http is not None
        end = self.now() + for_s
        while self.now() < end:
            i, self._n = self._n, self._n + 1
            t = self.now()
            res = Result(i, t, t, "health", False, "-", "", False, "", tag="/health (slow bodies)")
            try:
                async with asyncio.timeout(1.0):
                    async with self.http.get(self.url + "/health") as resp:
                        res.status = resp.status
                        await resp.read()
                if res.status != 200:
                    res.outcome = "health_unanswered"
            except (TimeoutError, aiohttp.ClientError, OSError):
                res.outcome = "health_unanswered"
            res.t_end = self.now()
            self.results.append(res)
            await asyncio.sleep(0.1)

    # putting it together --------------------------------------------------------------------------
    async def run(self) -> Report:
        plan = self.plan
        self.redis = PrivateRedis(password=REDIS_PASSWORD if plan.hostile else None)
        await self.redis.start()
        tmp = tempfile.TemporaryDirectory(prefix="chaos-")
        try:
            async with Fleet(n=plan.replicas, model=MODEL, speedup=plan.speedup,
                             seed=plan.seed) as fleet:  # fmt: skip
                self.fleet = fleet
                rogue = await start_server(self.rogue, lifespan="on") if plan.hostile else None
                dead = f"http://chaos:{REPLICA_PASSWORD}@127.0.0.1:{free_port()}"
                cfg = gateway_config(plan, fleet.urls, self.redis.url,
                                     rogue.url if rogue is not None else None,
                                     dead if rogue is not None else None)  # fmt: skip
                self.deadline_s = client_deadline_s(cfg)
                tracing = Tracing(None, exporter=self.exporter, environ={})
                # served from a config file, so POST /admin/reload (the reload phase) works
                self.cfg, self.config_path = cfg, Path(tmp.name) / "chaos.yaml"
                self.write_config(cfg)
                app = create_app(load_config(self.config_path), tracing=tracing,
                                 config_path=str(self.config_path))
                server = await start_server(app, lifespan="on")
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
                    if rogue is not None:
                        await rogue.stop()
        finally:
            await self.redis.stop()
            tmp.cleanup()
        return self.report()

    async def _drive(self) -> None:
        plan = self.plan
        self.t0 = asyncio.get_running_loop().time()
        script = asyncio.create_task(self.run_script())
        await self.load(plan.duration_s)
        await script
        if self.pending:
            await asyncio.wait(set(self.pending))
        if plan.hostile:
            await self.hostile()

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
                      self.events, self.deadline_s, self.index_before, self.index_after)  # fmt: skip


# --- the accounting ------------------------------------------------------------------------------


@dataclass
class Report:
    plan: Plan
    results: list[Result]
    faults: Window
    events: list[tuple[float, str]]
    deadline_s: float
    index_before: dict[str, float] = field(default_factory=dict)
    index_after: dict[str, float] = field(default_factory=dict)

    def phase(self, r: Result) -> str:
        if r.tag:
            return r.tag
        if r.burst:
            return "burst"
        if r.t_start < self.plan.warmup_s:
            return "warmup"
        return "faults" if r.t_start < self.plan.faults_end_s else "recovery"

    def hit_ratio(self, lo: float, hi: float) -> float | None:
        rs = [r for r in self.results
              if not r.tag and lo <= r.t_end < hi and r.outcome == "ok"
              and r.cached_tokens is not None
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
            if r.status >= 500 and not r.tried and not r.tag
            and self.faults.healthy(r.t_start, self.plan.replicas, grace) > 0
        ]  # fmt: skip

    def errors_after_faults(self, settle_s: float = 2.0) -> list[Result]:
        return [r for r in self.results
                if not r.tag and r.t_start >= self.plan.faults_end_s + settle_s
                and r.outcome != "ok"]  # fmt: skip

    def violations(self) -> list[str]:
        out = []
        defects = Counter(f"{self.phase(r)}: {r.outcome}" for r in self.results
                          if r.outcome in DEFECTS)  # fmt: skip
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
        if self.plan.hostile:
            # the memory backend reports its blocks; the Redis one holds one HASH per block (and
            # a ZSET per scope and replica, counted 8 blocks a scope by the bound): its key count
            blocks = self.index_after.get("blocks") or self.index_after.get("redis_keys")
            if blocks is None or blocks > self.plan.index_max_blocks:
                out.append(f"the index holds {blocks} blocks after the cache_salt flood "
                           f"(index.max_blocks {self.plan.index_max_blocks})")  # fmt: skip
            for r in self.results:
                if r.outcome == "check_failed":
                    out.append(f"{r.tag}: {r.error}")
            for tag, want in (("sse crlf", "ok"), ("huge max_tokens", "shed"),
                              ("reload rejected", "ok"), ("reload applied", "ok"),
                              ("flap dead replica", "ok")):
                bad = [r for r in self.results if r.tag == tag and r.outcome != want]
                if bad:
                    out.append(f"{tag}: {len(bad)} not {want}: "
                               f"{Counter(r.outcome + ' ' + r.error for r in bad)}")  # fmt: skip
        return out

    def table(self) -> str:
        p = self.plan
        phases = ["warmup", "faults", "burst", "recovery"]
        phases += list(dict.fromkeys(r.tag for r in self.results if r.tag))
        cols = ["sent", "ok", "failed over", "shed", "errors", "defects", "hung"]
        lines = [
            f"chaos: {p.replicas} replicas, speedup {p.speedup:g}, {p.rate:g} req/s steady, "
            f"{p.cycles} fault cycle(s), {p.duration_s:.0f} s, seed {p.seed}, "
            f"client deadline {self.deadline_s:.0f} s",
            f"{'phase':<24}" + "".join(f"{c:>12}" for c in cols),
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
            return f"{name:<24}" + "".join(f"{v:>12}" for v in vals)

        for ph in phases:
            lines.append(row(ph, [r for r in self.results if self.phase(r) == ph]))
        lines.append(row("total", self.results))
        main = [r for r in self.results if not r.tag]
        if len(main) != len(self.results):
            lines.append(row("  of which steady load", main))
        errs = Counter(f"{r.outcome}: {r.error}" + (f" [{r.code}]" if r.tag else "")
                       + (f" ({r.tag})" if r.tag else "")
                       for r in self.results if r.outcome in ("error", "shed"))  # fmt: skip
        lines.append("errors by type:")
        lines += [f"  {n:>6}  {k}" for k, n in errs.most_common()] or ["       0"]
        defects = Counter(f"{self.phase(r)}: {r.outcome}"
                          for r in self.results if r.outcome in DEFECTS)  # fmt: skip
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
        if self.index_after:
            b, a = self.index_before, self.index_after

            def ix(d: dict[str, float]) -> str:
                local = (f"gateway_index_scopes {d.get('scopes', 0):.0f}, blocks "
                         f"{d.get('blocks', 0):.0f}, gateway_index_bytes {d.get('bytes', 0):.0f}")
                if "redis_keys" in d:
                    local += (f"; Redis {d['redis_keys']:.0f} keys, used_memory "
                              f"{d['redis_used_memory'] / 1e6:.2f} MB")
                return local

            lines.append(
                f"index around the cache_salt flood ({p.salt_flood} unique salts, index.max_blocks "
                f"{p.index_max_blocks}):\n  before {ix(b)}\n  after  {ix(a)}; bound evictions "
                f"{a.get('bound_evicted_blocks_total', 0) - b.get('bound_evicted_blocks_total', 0):.0f}"
            )
            slow = [r for r in self.results if r.tag.startswith("slow body")]
            for tag in sorted({r.tag for r in slow}):
                rs = [r.t_end - r.t_start for r in slow if r.tag == tag]
                lines.append(f"{tag}: answered after {min(rs):.2f}-{max(rs):.2f} s "
                             f"(body_timeout_s {p.body_timeout_s:g})")  # fmt: skip
        return "\n".join(lines)


async def run_chaos(plan: Plan, log: Callable[[str], None] = print) -> Report:
    return await Chaos(plan, log).run()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.chaos", description=__doc__.splitlines()[0])
    p.add_argument("--short", action="store_true", help="the default run (kept for old scripts)")
    p.add_argument("--long", action="store_true", help="5 replicas, 8 fault cycles (~3.5 min)")
    p.add_argument("--no-hostile", action="store_true", help="skip the hostile phases")
    p.add_argument("--cycles", type=int, help="fault cycles (long run: 8)")
    p.add_argument("--replicas", type=int)
    p.add_argument("--rate", type=float, help="steady arrivals per second")
    p.add_argument("--speedup", type=float)
    p.add_argument("--seed", type=int)
    args = p.parse_args(argv)
    plan = LONG if args.long else SHORT
    overrides = {k: v for k, v in vars(args).items()
                 if k not in ("short", "long", "no_hostile") and v is not None}  # fmt: skip
    if args.no_hostile:
        overrides["hostile"] = False
    plan = Plan(**{**plan.__dict__, **overrides})
    t = time.perf_counter()
    report = asyncio.run(run_chaos(plan))
    print(report.table())
    bad = report.violations()
    print(f"wall time {time.perf_counter() - t:.0f} s")
    return verdict(bad, "VIOLATION", "OK: every request got a complete answer or a clear error")


if __name__ == "__main__":
    sys.exit(main())
