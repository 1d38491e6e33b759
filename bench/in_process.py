"""A gateway app served in the bench's own process, as `gateway serve` serves it (the gateway's
server protocol, uvloop, no access log, no proxy headers), for benches that reach into the
running gateway: bench.cprofile_gateway profiles its loop thread, bench.trace_cost switches its
sampler."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import uvicorn

from gateway.http_protocol import GuardedHttpToolsProtocol

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
