"""Shared test helpers: run any ASGI app on an ephemeral loopback port in the current loop."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import uvicorn
import yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    def __init__(self, server: uvicorn.Server, task: asyncio.Task[None], port: int) -> None:
        self.server = server
        self.task = task
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


async def start_server(app: Any, port: int = 0, lifespan: str = "auto") -> Served:
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        lifespan=lifespan,
        log_config=None,
        access_log=False,
        loop="none",
        http="httptools",
        timeout_graceful_shutdown=2,
    )
    server = uvicorn.Server(config)
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve())
    for _ in range(2000):  # poll readiness, up to ~10 s
        if server.started or task.done():
            break
        await asyncio.sleep(0.005)
    if task.done():
        task.result()
        raise RuntimeError("server exited during startup")
    if not server.started:
        raise RuntimeError("server did not start")
    bound = server.servers[0].sockets[0].getsockname()[1]
    return Served(server, task, bound)


@contextlib.asynccontextmanager
async def serving(app: Any, port: int = 0, lifespan: str = "auto") -> AsyncIterator[Served]:
    served = await start_server(app, port, lifespan)
    try:
        yield served
    finally:
        await served.stop()


async def poll_until(cond: Any, timeout_s: float = 10.0, every_s: float = 0.01) -> None:
    """Poll `cond()` until it is true (state owned by another task or process); fail after timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():  # noqa: ASYNC110 - the condition lives in code that offers no event to wait on
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(every_s)


def gateway_process(
    cfg: dict[str, Any], tmp: Path, *args: str
) -> tuple[subprocess.Popen[bytes], str]:
    """`gateway --config` in its own process on a free port; output goes to a log beside the config."""
    port = free_port()
    cfg = {**cfg, "server": {**cfg.get("server", {}), "host": "127.0.0.1", "port": port}}
    path = tmp / f"gw-{port}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with open(tmp / f"gw-{port}.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "--config", str(path), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return proc, f"http://127.0.0.1:{port}"


async def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """Poll /ready until 200; fail if the process exits first."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession() as h:
        while loop.time() < deadline:
            assert proc.poll() is None, "gateway process exited"
            try:
                async with h.get(url + "/ready") as res:
                    if res.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError("gateway did not become ready")
