"""Soak: many requests through a gateway process, watching its memory, file descriptors and tasks.

The gateway runs in its own process (same uvicorn settings as `gateway serve`) so its /proc can be
read; `bench.zero_upstream` plays the replicas. The load is a closed loop of keep-alive raw-socket
clients sending a mix of chat and completions, streamed and not, with a few bad requests, unknown
keys and clients that hang up mid-stream. RSS and open fds are sampled as it goes; at idle, before
and after, the fds and the gateway's asyncio tasks are counted.

    python -m bench.soak                       # 100k requests (about 2 minutes here)
    python -m bench.soak --requests 5000       # the size tests/chaos runs

Goal: RSS after the warm-up grows by at most 10%; fds and tasks at idle return to their count
after the warm-up. Exit status 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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

TASKS_PATH = "/__soak/tasks"
KEYS = ("sk-soak-tenant-one-1f2e3d", "sk-soak-tenant-two-4c5b6a")
MODEL = "bench-model"


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
    uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.server.host,
            port=config.server.port,
            loop=loop,  # type: ignore[arg-type]
            http="httptools",
            lifespan="on",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=2,
        )  # fmt: skip
    ).run()


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


SPECIAL = {
    "bad_json": _post(b"/v1/chat/completions", b'{"model": "x", "messages": [', KEYS[0]),
    "unknown_key": _post(b"/v1/chat/completions", b'{"model":"x","messages":[]}', "sk-not-a-key"),
    "abort_mid_stream": b"",  # a stream request whose client hangs up at the first chunk
}


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
    bad_answers: int = 0
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
        self.port = _free_port()
        cfg = {
            "server": {"host": "127.0.0.1", "port": self.port, "log_level": "warning"},
            "pools": {"chat": {
                "replicas": [{"url": f"http://127.0.0.1:{p}", "name": f"z{i}"}
                             for i, p in enumerate(ports)],
                "health": {"interval_s": 0.5}, "scrape": {"interval_s": 0.5},
            }},
            # small enough that the index fills during the warm-up and evicts from then on
            "index": {"capacity_blocks": 4000},
            "tenants": [{"name": f"t{i}", "api_keys": [k],
                         "limits": {"requests_per_second": 1e6, "tokens_per_minute": 1e15}}
                        for i, k in enumerate(KEYS)],
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
                special = i % 50
                if special == 3:
                    kind, data, abort = "bad_json", SPECIAL["bad_json"], False
                elif special == 17:
                    kind, data, abort = "unknown_key", SPECIAL["unknown_key"], False
                elif special == 29:
                    kind, data, abort = "abort_mid_stream", self.mix[1][1], True
                else:
                    kind, data, _ = self.mix[i % len(self.mix)]
                    abort = False
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
                if not self.judge(kind, status, body):
                    self.result.bad_answers += 1
                if abort:
                    conn = await self.connect()
                if i % max(1, self.requests // 100) == 0:
                    self.result.samples.append(Sample(i, self.rss_mb(), self.fds()))
        finally:
            if conn.transport is not None:
                conn.transport.close()

    @staticmethod
    def judge(kind: str, status: int, body: bytes) -> bool:
        if kind == "abort_mid_stream":
            return status in (200, 499)
        if status != 200:
            try:
                return isinstance(orjson.loads(body)["error"]["message"], str)
            except (orjson.JSONDecodeError, KeyError, TypeError):
                return False
        if kind == "stream":
            return body.endswith(b"data: [DONE]\n\n")
        try:
            return isinstance(orjson.loads(body).get("choices"), list)
        except (orjson.JSONDecodeError, AttributeError):
            return False

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
            r.task_names = (names0, names1)
            return r
        finally:
            self.stop()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    problems = result.problems()
    for line in problems:
        print("PROBLEM:", line)
    print("OK: no growth, no leak" if not problems else "FAILED")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
