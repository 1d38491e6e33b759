"""Soak: many requests through a gateway process, watching its memory, file descriptors and tasks.

The gateway runs in its own process (same uvicorn settings as `gateway serve`) so its /proc can be
read; `bench.zero_upstream` plays the replicas. The load is a closed loop of keep-alive raw-socket
clients sending a mix of chat and completions, streamed and not, with a share of faults (see
`FAULTS`): from the client, bad JSON, unknown keys, hang-ups mid-stream, a unique `cache_salt` (a new
index scope each) and a `max_tokens` deeper than the tenant's token bucket (429); from the replica
(`"user": "fault:NAME"`, read by `bench.zero_upstream`), a stream framed with CRLF, a non-UTF-8
event, a non-JSON event and a replica dying mid-event. Every answer is classified (status, and how
a stream ended: `[DONE]` or an error event) and checked against what its kind should get; a stream
that is not complete UTF-8 SSE events ending in `[DONE]` or an error event counts as malformed.
RSS and open fds are sampled as it goes; at idle, before and after, the fds and the gateway's
asyncio tasks are counted; at the end the prefix index must be within `index.max_blocks`.

    python -m bench.soak                       # 100k requests (about 2 minutes here)
    python -m bench.soak --requests 5000       # the size tests/chaos runs

Goal: RSS after the warm-up grows by at most 10%; fds and tasks at idle return to their count
after the warm-up; no malformed or unexpected answer; the index within its bound. Exit status 1
otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httptools
import orjson
import yaml

from bench import verdict
from bench.harness import free_port, server_config

TASKS_PATH = "/__soak/tasks"
KEYS = ("sk-soak-tenant-one-1f2e3d", "sk-soak-tenant-two-4c5b6a")
SMALL_KEY = "sk-soak-tenant-small-9a8b7c"  # a tenant whose token bucket no huge max_tokens fits
SMALL_TOKENS_PER_MINUTE = 20_000
MODEL = "bench-model"
INDEX_MAX_BLOCKS = 2_000  # all scopes and replicas together; a scope counts 8
INDEX_BYTES_PER_BLOCK = (
    200  # the memory index's own bound (tests/prefix_index/test_index_bounds.py)
)


# --- the gateway side: `python -m bench.soak serve` ----------------------------------------------


class TaskProbe:
    """Wraps the gateway app: `GET /__soak/tasks` answers the event loop's task count; everything
    else goes to the gateway untouched."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[Any], Awaitable[None]],
    ) -> None:
        if scope["type"] == "http" and scope["path"] == TASKS_PATH:
            me = asyncio.current_task()
            names = Counter(
                (t.get_name().split(":")[0] if not t.get_name().startswith("Task-") else "Task")
                for t in asyncio.all_tasks()
                if t is not me
            )
            # pending loop timers: only plain asyncio shows them (uvloop keeps its own)
            scheduled = getattr(asyncio.get_running_loop(), "_scheduled", None)
            timers = None if scheduled is None else sum(not h.cancelled() for h in scheduled)
            body = orjson.dumps({"tasks": sum(names.values()), "names": names, "timers": timers})
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})  # fmt: skip
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


def serve(config_path: str, loop: str = "uvloop") -> None:
    import uvicorn

    from gateway import create_app, load_config

    config = load_config(config_path)
    app = TaskProbe(create_app(config))
    cfg = server_config(app, config.server.port, "on", host=config.server.host, loop=loop)
    uvicorn.Server(cfg).run()


# --- the load ------------------------------------------------------------------------------------


def _system(g: int) -> str:
    return f"You are assistant {g}. " + " ".join(f"rule{g}-{i}" for i in range(120))


def bodies(n_variants: int = 64) -> list[tuple[str, bytes, bool]]:
    """(kind, request bytes for a keep-alive connection, stream) for the mix, built once."""
    out = []
    for i in range(n_variants):
        stream = i % 4 == 1
        user = f"question {i}: " + "tell me more " * 12
        if i % 10 == 7:
            body: dict[str, Any] = {"model": MODEL, "prompt": _system(i % 8) + user}
            path = b"/v1/completions"
        else:
            body = {"model": MODEL, "messages": [{"role": "system", "content": _system(i % 8)},
                                                 {"role": "user", "content": user}]}  # fmt: skip
            path = b"/v1/chat/completions"
        body["stream"] = stream
        if stream and i % 8 == 1:
            body["stream_options"] = {"include_usage": True}
        out.append(
            ("stream" if stream else "json", _post(path, orjson.dumps(body), KEYS[i % 2]), stream)
        )
    return out


def _post(path: bytes, body: bytes, key: str | None) -> bytes:
    auth = f"authorization: Bearer {key}\r\n".encode() if key else b""
    return (
        b"POST " + path + b" HTTP/1.1\r\nhost: gw\r\n" + auth
        + b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body
    )  # fmt: skip


def _chat(key: str, **extra: Any) -> bytes:
    msgs = [{"role": "system", "content": _system(3)}, {"role": "user", "content": "fault?"}]
    return _post(b"/v1/chat/completions", orjson.dumps({"model": MODEL, "messages": msgs, **extra}),
                 key)  # fmt: skip


SPECIAL = {
    "bad_json": _post(b"/v1/chat/completions", b'{"model": "x", "messages": [', KEYS[0]),
    "unknown_key": _post(b"/v1/chat/completions", b'{"model":"x","messages":[]}', "sk-not-a-key"),
    "abort_mid_stream": b"",  # a stream request whose client hangs up at the first chunk
    "over_tokens": _chat(SMALL_KEY, max_tokens=10_000_000),
    **{f"fault_{n}": _chat(KEYS[1], stream=True, user=f"fault:{n}")
       for n in ("crlf", "badutf8", "nonjson", "die")},
    "unique_salt": b"",  # built per request: a cache_salt no other request has
}  # fmt: skip

# i % 50 -> the fault that request carries (others: the ordinary mix)
FAULTS = {3: "bad_json", 17: "unknown_key", 29: "abort_mid_stream", 7: "fault_crlf",
          11: "fault_badutf8", 23: "fault_nonjson", 37: "fault_die", 41: "unique_salt",
          45: "over_tokens"}  # fmt: skip

# what each kind must get: (statuses, how a 200 stream ends: "done", "error_event" or None: json)
EXPECT: dict[str, tuple[frozenset[int], str | None]] = {
    "json": (frozenset({200}), None),
    "stream": (frozenset({200}), "done"),
    "bad_json": (frozenset({400, 422}), None),
    "unknown_key": (frozenset({401}), None),
    "over_tokens": (frozenset({429}), None),
    "unique_salt": (frozenset({200}), None),
    "fault_crlf": (frozenset({200}), "done"),
    # broken mid-stream: the client gets the good events, then the gateway's error event
    "fault_badutf8": (frozenset({200}), "error_event"),
    "fault_nonjson": (frozenset({200}), "error_event"),
    "fault_die": (frozenset({200}), "error_event"),
}
_LINE_END = re.compile(r"\r\n|\r|\n")
_EVENT_END = re.compile(r"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r|\n)")


def sse_ending(body: bytes) -> str | None:
    """How a streamed body ends: "done" (`[DONE]` last), "error_event" (an `{"error": ...}` event
    last), or None when malformed: not UTF-8, an unfinished event, an event whose data is neither
    a JSON object nor `[DONE]`, anything after `[DONE]` or the error event, or neither at the end."""
    try:
        text = body.decode()
    except UnicodeDecodeError:
        return None
    pos, ending = 0, None
    for m in _EVENT_END.finditer(text):
        block, pos = text[pos : m.start()], m.end()
        data = [ln[5:].removeprefix(" ") for ln in _LINE_END.split(block) if ln.startswith("data:")]
        if not data:
            continue  # a comment or extra blank line
        if ending is not None:
            return None  # an event after the stream's end
        joined = "\n".join(data)
        if joined == "[DONE]":
            ending = "done"
            continue
        try:
            obj = orjson.loads(joined)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(obj, dict):
            return None
        if "error" in obj:
            if not isinstance(obj["error"], dict) or not isinstance(
                obj["error"].get("message"), str
            ):
                return None
            ending = "error_event"
    if text[pos:].strip("\r\n"):
        return None  # an unfinished event
    return ending


class _Conn(asyncio.Protocol):
    """One keep-alive client connection; one request at a time."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.status = 0
        self.body: list[bytes] = []
        self.abort_at_first = False
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("closed by the gateway"))

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_exception(exc)

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        if self.abort_at_first and self.transport is not None:
            self.transport.abort()  # the client leaves mid-stream
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_result((499, b""))

    def on_message_complete(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((self.status, b"".join(self.body)))

    async def request(self, data: bytes, abort_at_first: bool = False) -> tuple[int, bytes]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.body, self.status, self.abort_at_first = [], 0, abort_at_first
        self.transport.write(data)
        return await self.waiter


@dataclass
class Sample:
    done: int
    rss_mb: float
    fds: int
    tasks: int | None = None  # only at idle checkpoints
    timers: int | None = None  # pending loop timers at idle (plain asyncio loop only)


@dataclass
class SoakResult:
    requests: int
    concurrency: int
    wall_s: float
    samples: list[Sample] = field(default_factory=list)
    start: Sample | None = None
    warm: Sample | None = None
    end: Sample | None = None
    statuses: Counter[str] = field(default_factory=Counter)
    bad_answers: int = 0  # malformed: see sse_ending; or a non-200 without an OpenAI error body
    unexpected: Counter[str] = field(default_factory=Counter)  # well-formed, not what EXPECT says
    endings: Counter[str] = field(default_factory=Counter)  # "kind: done / error_event"
    index: dict[str, float] = field(default_factory=dict)  # /metrics at the end (idle)
    task_names: tuple[dict[str, int], dict[str, int]] = ({}, {})

    @property
    def rss_growth(self) -> float:
        assert self.warm is not None and self.end is not None
        return (self.end.rss_mb - self.warm.rss_mb) / self.warm.rss_mb

    def problems(self, max_growth: float = 0.10, timers: bool = True) -> list[str]:
        assert self.warm is not None and self.end is not None
        out = []
        if self.rss_growth > max_growth:
            out.append(f"RSS grew {self.rss_growth:+.1%} after the warm-up (> {max_growth:.0%})")
        # idle keep-alive connections to the upstream stay pooled: at most one per concurrent
        # client, so that many may differ between two idle moments; a leak grows with requests
        if self.end.fds > self.warm.fds + self.concurrency:
            out.append(
                f"open fds at idle: {self.warm.fds} after the warm-up, {self.end.fds} at the end"
            )
        if self.end.tasks != self.warm.tasks:
            out.append(f"asyncio tasks at idle: {self.warm.tasks} after the warm-up, "
                       f"{self.end.tasks} at the end: {self.task_names}")  # fmt: skip
        if timers and self.warm.timers is not None and self.end.timers is not None:
            if self.end.timers > self.warm.timers + 5:
                out.append(f"pending loop timers at idle: {self.warm.timers} after the warm-up, "
                           f"{self.end.timers} at the end")  # fmt: skip
        if self.bad_answers:
            out.append(f"{self.bad_answers} answers neither complete nor a clear error")
        if self.unexpected:
            out.append(f"answers other than their kind should get: {dict(self.unexpected)}")
        ix = self.index
        if not ix:
            out.append("no gateway_index_* figures in /metrics")
        else:
            load = ix["blocks"] + 8 * ix["scopes"]
            if load > INDEX_MAX_BLOCKS:
                out.append(
                    f"index holds {load:.0f} blocks+8*scopes > max_blocks {INDEX_MAX_BLOCKS}"
                )
            if ix["bytes"] > INDEX_MAX_BLOCKS * INDEX_BYTES_PER_BLOCK:
                out.append(f"index takes {ix['bytes']:.0f} B > "
                           f"{INDEX_MAX_BLOCKS} x {INDEX_BYTES_PER_BLOCK} B")  # fmt: skip
        return out

    def table(self) -> str:
        assert self.start and self.warm and self.end
        lines = [
            f"soak: {self.requests} requests, {self.concurrency} keep-alive clients, "
            f"{self.wall_s:.0f} s, {self.requests / self.wall_s:.0f} req/s",
            f"{'point':<22}{'requests':>10}{'RSS MiB':>10}{'fds':>7}{'tasks':>7}{'timers':>8}",
        ]

        def row(name: str, s: Sample) -> str:
            tasks = "" if s.tasks is None else str(s.tasks)
            timers = "" if s.timers is None else str(s.timers)
            return f"{name:<22}{s.done:>10}{s.rss_mb:>10.1f}{s.fds:>7}{tasks:>7}{timers:>8}"

        lines.append(row("start (idle)", self.start))
        lines.append(row("after warm-up (idle)", self.warm))
        step = max(1, len(self.samples) // 8)
        for s in self.samples[::step]:
            lines.append(row("  under load", s))
        lines.append(row("end (idle)", self.end))
        peak = max([s.rss_mb for s in self.samples] + [self.end.rss_mb])
        lines.append(
            f"RSS after warm-up {self.warm.rss_mb:.1f} -> end {self.end.rss_mb:.1f} MiB "
            f"({self.rss_growth:+.1%}, goal <= +10%), peak {peak:.1f} MiB; fds {self.warm.fds} -> "
            f"{self.end.fds}; tasks {self.warm.tasks} -> {self.end.tasks}; loop timers "
            f"{self.warm.timers} -> {self.end.timers}"
        )
        lines.append("answers: " + ", ".join(f"{k}: {v}" for k, v in sorted(self.statuses.items()))
                     + f"; malformed: {self.bad_answers}")  # fmt: skip
        lines.append("stream ends: " + ", ".join(f"{k}: {v}" for k, v in sorted(self.endings.items()))
                     + f"; unexpected: {sum(self.unexpected.values())}")  # fmt: skip
        ix = self.index
        if ix:
            lines.append(
                f"index at the end: {ix['blocks']:.0f} blocks, {ix['scopes']:.0f} scopes, "
                f"{ix['bytes'] / 1024:.0f} KiB, {ix['evicted']:.0f} bound-evicted "
                f"(max_blocks {INDEX_MAX_BLOCKS}; {self.statuses['unique_salt 200']} unique salts)"
            )
        return "\n".join(lines)


class Soak:
    def __init__(
        self, requests: int, concurrency: int, warmup: int, workdir: Path, loop: str = "uvloop"
    ) -> None:
        self.requests, self.concurrency, self.warmup = requests, concurrency, warmup
        self.loop = loop
        self.workdir = workdir
        self.mix = bodies()
        self.upstream: subprocess.Popen[bytes] | None = None
        self.gateway: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.next = 0
        self.result = SoakResult(requests, concurrency, 0.0)

    # processes ---------------------------------------------------------------------------------
    def start(self) -> None:
        self.upstream = subprocess.Popen(
            [sys.executable, "-m", "bench.zero_upstream", "--ports", "2", "--chunks", "16"],
            stdout=subprocess.PIPE,
        )
        assert self.upstream.stdout is not None
        ports = json.loads(self.upstream.stdout.readline())["ports"]
        self.port = free_port()
        cfg = {
            "server": {"host": "127.0.0.1", "port": self.port, "log_level": "warning"},
            "pools": {"chat": {
                "replicas": [{"url": f"http://127.0.0.1:{p}", "name": f"z{i}"}
                             for i, p in enumerate(ports)],
                "health": {"interval_s": 0.5}, "scrape": {"interval_s": 0.5},
            }},
            # small enough that the index fills during the warm-up and evicts from then on
            # max_blocks: the unique cache salts make new scopes all along; the bound holds them
            "index": {"capacity_blocks": 4000, "max_blocks": INDEX_MAX_BLOCKS},
            "tenants": [{"name": f"t{i}", "api_keys": [k],
                         "limits": {"requests_per_second": 1e6, "tokens_per_minute": 1e15}}
                        for i, k in enumerate(KEYS)]
                       + [{"name": "small", "api_keys": [SMALL_KEY],
                           "limits": {"tokens_per_minute": SMALL_TOKENS_PER_MINUTE}}],
        }  # fmt: skip
        path = self.workdir / "soak.yaml"
        path.write_text(yaml.safe_dump(cfg))
        log = open(self.workdir / "gateway.log", "wb")  # noqa: SIM115 - the child owns it
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        self.gateway = subprocess.Popen(
            [sys.executable, "-m", "bench.soak", "serve", "--config", str(path), "--loop", self.loop],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        log.close()

    def stop(self) -> None:
        for proc in (self.gateway, self.upstream):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self.upstream is not None and self.upstream.stdout is not None:
            self.upstream.stdout.close()

    # measurements ------------------------------------------------------------------------------
    def rss_mb(self) -> float:
        assert self.gateway is not None
        for line in Path(f"/proc/{self.gateway.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def fds(self) -> int:
        assert self.gateway is not None
        return len(os.listdir(f"/proc/{self.gateway.pid}/fd"))

    async def tasks(self) -> tuple[int, dict[str, int], int | None]:
        conn = await self.connect()
        try:
            status, body = await conn.request(
                b"GET " + TASKS_PATH.encode() + b" HTTP/1.1\r\nhost: gw\r\n\r\n"
            )
        finally:
            assert conn.transport is not None
            conn.transport.close()
        assert status == 200
        data = orjson.loads(body)
        return int(data["tasks"]), dict(data["names"]), data["timers"]

    async def index_metrics(self) -> dict[str, float]:
        conn = await self.connect()
        try:
            status, body = await conn.request(b"GET /metrics HTTP/1.1\r\nhost: gw\r\n\r\n")
        finally:
            assert conn.transport is not None
            conn.transport.close()
        if status != 200:
            return {}
        names = {
            "gateway_index_bytes": "bytes",
            "gateway_index_scopes": "scopes",
            "gateway_index_blocks": "blocks",
            "gateway_index_bound_evicted_blocks": "evicted",
        }
        out = dict.fromkeys(names.values(), 0.0)
        seen = False
        for line in body.decode().splitlines():
            if line.startswith("gateway_index_"):
                name = line.split("{")[0].split(" ")[0].removesuffix("_total")
                if name in names:
                    out[names[name]] += float(line.rsplit(" ", 1)[1])
                    seen = True
        return out if seen else {}

    async def idle_sample(self, done: int) -> tuple[Sample, dict[str, int]]:
        """Let in-flight work and closed connections settle, then count (the same way twice)."""
        await asyncio.sleep(1.5)
        tasks, names, timers = await self.tasks()
        return Sample(done, self.rss_mb(), self.fds(), tasks, timers), names

    async def connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(_Conn, "127.0.0.1", self.port)
        return conn

    async def wait_ready(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.gateway is not None and self.gateway.poll() is None, "gateway exited"
            try:
                conn = await self.connect()
                status, _ = await conn.request(b"GET /ready HTTP/1.1\r\nhost: gw\r\n\r\n")
                assert conn.transport is not None
                conn.transport.close()
                if status == 200:
                    return
            except OSError:
                pass
            await asyncio.sleep(0.05)
        raise RuntimeError("the gateway did not become ready")

    # the load ----------------------------------------------------------------------------------
    async def client(self, until: int) -> None:
        conn = await self.connect()
        try:
            while self.next < until:
                i = self.next
                self.next += 1
                abort = False
                special = FAULTS.get(i % 50)
                if special is None:
                    kind, data, _ = self.mix[i % len(self.mix)]
                elif special == "abort_mid_stream":
                    kind, data, abort = special, self.mix[1][1], True
                elif special == "unique_salt":
                    kind, data = special, _chat(KEYS[i % 2], cache_salt=f"soak-salt-{i}")
                else:
                    kind, data = special, SPECIAL[special]
                if conn.closed:
                    conn = await self.connect()
                try:
                    status, body = await conn.request(data, abort)
                except (ConnectionError, httptools.HttpParserError):
                    self.result.statuses["connection_error"] += 1
                    self.result.bad_answers += 1
                    conn = await self.connect()
                    continue
                self.result.statuses[f"{kind} {status}"] += 1
                verdict = self.judge(kind, status, body)
                if verdict is None:
                    self.result.bad_answers += 1
                elif verdict:
                    self.result.unexpected[f"{kind} {status} {verdict}"] += 1
                if abort:
                    conn = await self.connect()
                if i % max(1, self.requests // 100) == 0:
                    self.result.samples.append(Sample(i, self.rss_mb(), self.fds()))
        finally:
            if conn.transport is not None:
                conn.transport.close()

    def judge(self, kind: str, status: int, body: bytes) -> str | None:
        """None: malformed; "": as expected; else what came instead (well-formed, unexpected)."""
        if kind == "abort_mid_stream":
            return "" if status in (200, 499) else "status"
        statuses, ending = EXPECT[kind]
        if status != 200:
            try:
                ok = isinstance(orjson.loads(body)["error"]["message"], str)
            except (orjson.JSONDecodeError, KeyError, TypeError):
                ok = False
            return None if not ok else ("" if status in statuses else "error")
        if kind == "stream" or kind.startswith("fault_"):
            got = sse_ending(body)
            if got is None:
                return None
            self.result.endings[f"{kind}: {got}"] += 1
            return "" if got == ending else got
        try:
            ok = isinstance(orjson.loads(body).get("choices"), list)
        except (orjson.JSONDecodeError, AttributeError):
            return None
        return "" if ok and status in statuses else "json"

    async def run(self) -> SoakResult:
        self.start()
        try:
            await self.wait_ready()
            r = self.result
            r.start, _ = await self.idle_sample(0)
            t0 = time.perf_counter()
            await asyncio.gather(*(self.client(self.warmup) for _ in range(self.concurrency)))
            warm_s = time.perf_counter() - t0
            r.warm, names0 = await self.idle_sample(self.next)
            t1 = time.perf_counter()
            await asyncio.gather(*(self.client(self.requests) for _ in range(self.concurrency)))
            r.wall_s = warm_s + time.perf_counter() - t1
            r.end, names1 = await self.idle_sample(self.next)
            r.index = await self.index_metrics()
            r.task_names = (names0, names1)
            return r
        finally:
            self.stop()


async def run_soak(
    requests: int,
    concurrency: int = 32,
    warmup: int | None = None,
    workdir: Path | None = None,
    loop: str = "uvloop",
) -> SoakResult:
    """`loop`: the gateway's event loop, `uvloop` as in production, or `asyncio` (slower, but its
    pending timers can be counted)."""
    warm = warmup if warmup is not None else max(1000, requests // 10)
    if workdir is not None:
        return await Soak(requests, concurrency, warm, workdir, loop).run()
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        return await Soak(requests, concurrency, warm, Path(tmp), loop).run()


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["serve"]:
        p = argparse.ArgumentParser(prog="bench.soak serve")
        p.add_argument("--config", required=True)
        p.add_argument("--loop", default="uvloop", choices=["uvloop", "asyncio"])
        a = p.parse_args(args[1:])
        serve(a.config, a.loop)
        return 0
    p = argparse.ArgumentParser(prog="bench.soak", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--warmup", type=int, help="requests before the baseline (default 10%%)")
    p.add_argument("--loop", default="uvloop", choices=["uvloop", "asyncio"],
                   help="the gateway's loop; asyncio also counts pending timers")  # fmt: skip
    a = p.parse_args(args)
    result = asyncio.run(run_soak(a.requests, a.concurrency, a.warmup, loop=a.loop))
    print(result.table())
    return verdict(result.problems(), "PROBLEM", "OK: no growth, no leak")


if __name__ == "__main__":
    sys.exit(main())
