"""Scale-out: several gateway processes share one prefix index (and limits) through Redis."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import aiohttp
import redis.asyncio as aioredis
import yaml

from bench.harness import stop_all
from prefix_index.constants import DEFAULT_NAMESPACE, replica_scopes_key
from tests.gateway.fake_replica import Upstream
from tests.support import gateway_process, start_server, wait_ready

REDIS = "redis://127.0.0.1:6379/0"
PROMPT = "You are a meticulous assistant. " * 40  # ~1.3 KB: 20 blocks of 64 bytes


def config(urls: list[str], ns: str) -> dict[str, object]:
    return {
        "pools": {"chat": {"replicas": urls, "policy": "prefix_aware"}},
        "index": {"backend": "redis", "redis_url": REDIS},
        # a model name unique to this run keeps its index scope apart from other runs in Redis
        "routes": [{"match": {"model": ns}, "pool": "chat"}],
    }


async def test_two_processes_route_a_repeated_prefix_to_one_replica(tmp_path: Path) -> None:
    """The first request's blocks reach Redis in the background: the test waits for them (no
    fixed sleep), then every later request, through either process, must hit that replica."""
    ups = [Upstream(f"u{i}") for i in range(3)]
    served = [await start_server(u) for u in ups]
    ns = f"model-{uuid.uuid4().hex[:8]}"
    procs = [gateway_process(config([s.url for s in served], ns), tmp_path) for _ in range(2)]
    names = [f"127.0.0.1:{s.port}" for s in served]
    redis = aioredis.Redis.from_url(REDIS)
    try:
        for proc, url in procs:
            await wait_ready(url, proc, timeout_s=60)
        async with aiohttp.ClientSession() as h:
            for i in range(8):
                body = {
                    "model": ns,
                    "messages": [
                        {"role": "system", "content": PROMPT},
                        {"role": "user", "content": f"q{i}"},
                    ],
                }
                async with h.post(procs[i % 2][1] + "/v1/chat/completions", json=body) as res:
                    assert res.status == 200
                if i == 0:
                    held = [replica_scopes_key(DEFAULT_NAMESPACE, n) for n in names]
                    for _ in range(600):  # up to 30 s on a loaded machine
                        if await redis.exists(*held):
                            break
                        await asyncio.sleep(0.05)
    finally:
        await redis.aclose()
        for proc, _ in procs:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in procs:
            proc.wait(timeout=30)
        await stop_all(served)
    calls = sorted(u.calls for u in ups)
    assert calls == [0, 0, 8], calls  # every request, through either process, went to one replica


async def test_workers_flag_runs_several_processes(tmp_path: Path) -> None:
    up = Upstream("u")
    served = await start_server(up)
    ns = f"model-{uuid.uuid4().hex[:8]}"
    proc, url = gateway_process(config([served.url], ns), tmp_path, "--workers", "2")
    try:
        await wait_ready(url, proc)
        async with aiohttp.ClientSession() as h:
            for i in range(6):
                body = {"model": ns, "messages": [{"role": "user", "content": f"q{i}"}]}
                async with h.post(url + "/v1/chat/completions", json=body) as res:
                    assert res.status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        await served.stop()
    assert up.calls == 6


def test_workers_need_redis(tmp_path: Path) -> None:
    path = tmp_path / "routes.yaml"
    path.write_text(yaml.safe_dump({"pools": {"chat": {"replicas": ["http://127.0.0.1:9"]}}}))
    res = subprocess.run(
        [sys.executable, "-m", "gateway", "--config", str(path), "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1
    assert "index.backend: must be redis with --workers > 1" in res.stderr
