"""Test-only helpers: polling for a condition, a `gateway --config` process and its readiness,
headless Chromium on a page.

Servers and ports come from the dev harness (`bench/harness.py`, not in the wheel), re-exported here.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import yaml

from bench.harness import Served, free_port, serving, start_server

__all__ = [
    "CHROMIUM", "Served", "at_once", "chromium", "free_port", "gateway_process", "poll_until",
    "serving", "start_server", "wait_ready",
]  # fmt: skip
CHROMIUM = Path("/usr/bin/chromium")
T = TypeVar("T")


async def poll_until(cond: Any, timeout_s: float = 10.0, every_s: float = 0.01) -> None:
    """Poll `cond()` until it is true (state owned by another task or process); fail after timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():  # noqa: ASYNC110 - the condition lives in code that offers no event to wait on
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(every_s)


def at_once(call: Coroutine[Any, Any, T]) -> T:
    """What the coroutine `call` returns, when it finishes on its first step: it waited on
    nothing (no I/O, no timer, no lock). How a test says "this did not stall" without timing it."""
    try:
        call.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    call.close()
    raise AssertionError(f"{call.__qualname__} waited on something")


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


async def chromium(
    url: str, *args: str, profile: Path, window: str = "1400,1000", budget_ms: int = 5000
) -> bytes:
    """Headless Chromium on `url` with `args` (`--dump-dom`, `--screenshot=PATH`, ...), its own
    profile directory, `budget_ms` of virtual time for the page's scripts; returns its stdout."""
    proc = await asyncio.create_subprocess_exec(
        str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--disable-dev-shm-usage", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
        f"--window-size={window}", f"--virtual-time-budget={budget_ms}", *args, url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    return out
