"""A gateway app served in the bench's own process, as `gateway serve` serves it (the gateway's
server protocol, uvloop, no access log, no proxy headers), for benches that reach into the
running gateway: bench.cprofile_gateway profiles its loop thread, bench.trace_cost switches its
sampler."""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import uvicorn

from gateway.transport.protocol import GuardedHttpToolsProtocol

ROOT = Path(__file__).resolve().parent.parent


async def start(app: Any, port: int) -> tuple[uvicorn.Server, asyncio.Task[None]]:
    """Serve `app` on 127.0.0.1:`port`; returns once it listens (set `should_exit`, await the
    task, to stop it)."""
    server = uvicorn.Server(uvicorn.Config(
        app, host="127.0.0.1", port=port, loop="uvloop", http=GuardedHttpToolsProtocol,
        lifespan="on", log_config=None, access_log=False, proxy_headers=False,
    ))  # fmt: skip
    task = asyncio.create_task(server.serve())
    while not server.started:  # noqa: ASYNC110 - uvicorn sets a flag, no event
        await asyncio.sleep(0.05)
    return server, task


async def load(port: int, seconds: float, stream: bool = False) -> asyncio.subprocess.Process:
    """bench.overhead's closed-loop generator against `port` for `seconds` (unpaced 64-chunk
    streams with `stream`), in a child process (bench.cprofile_gateway's `--load-port` side);
    its last stdout line is a JSON summary."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.cprofile_gateway", "--load-port", str(port),
        "--seconds", str(seconds), *(["--load-stream"] if stream else []), cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip


@contextlib.contextmanager
def upstream(cpu: int | None = None) -> Iterator[dict[str, Any]]:
    """bench.zero_upstream (3 replica ports, 1 paced) for the body of the `with`, on `cpu` when
    given; yields what it printed when it started (its `ports` and `paced_ports`)."""
    up = subprocess.Popen([sys.executable, "-m", "bench.zero_upstream", "--ports", "3",
                           "--paced-ports", "1"], stdout=subprocess.PIPE, cwd=ROOT)  # fmt: skip
    try:
        if cpu is not None:
            os.sched_setaffinity(up.pid, {cpu})
        assert up.stdout is not None
        yield orjson.loads(up.stdout.readline())
    finally:
        up.terminate()
        up.wait(10)


Window = tuple[bool, float, int]  # the variant was on, CPU seconds, requests answered


async def alternate(
    windows: int, window_s: float, switch: Callable[[bool], None], answered: Callable[[], int]
) -> list[Window]:
    """`windows` windows of `window_s`, the variant switched on and off (`switch`) in the order
    o n n o o n n o ...: each kind before and after the other; this process's CPU and the
    requests `answered` in each (after a short pause for the previous kind's requests to end)."""
    out: list[Window] = []
    for i in range(windows):
        on = i % 4 in (1, 2)
        switch(on)
        await asyncio.sleep(0.05)
        c0, n0 = time.process_time(), answered()
        await asyncio.sleep(window_s)
        out.append((on, time.process_time() - c0, answered() - n0))
    return out


def compare(windows: list[Window]) -> tuple[float, float, list[float]]:
    """Median CPU µs per request with the variant on and off, and the on/off ratio of each pair
    of neighbouring windows of different kinds."""
    per = [(on, 1e6 * cpu / max(1, n)) for on, cpu, n in windows]
    ratios = [b[1] / a[1] if b[0] else a[1] / b[1] for a, b in zip(per, per[1:], strict=False)
              if a[0] != b[0]]  # fmt: skip
    on_us = statistics.median(us for on, us in per if on)
    off_us = statistics.median(us for on, us in per if not on)
    return on_us, off_us, ratios
