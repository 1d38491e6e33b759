"""Tokens-per-minute limits hold for requests that set no `max_tokens` (issue 35).

Real simulated replicas, the real limiter (memory and Redis), through a real gateway: 30
concurrent chats without `max_tokens`, then 30 more once the first wave is settled. The tokens
the replicas served (their `usage`) never exceed what the tenant's bucket held plus its refill.
The charge at admission is bounded by the engine's context (`max_model_len` from /v1/models),
or by the pool's `default_max_tokens`; the answer's usage settles it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from redis.asyncio import Redis

from gateway import create_app, parse_config
from simulator.fleet import Fleet
from tests.support import Served, poll_until, start_server

REDIS_URL = "redis://127.0.0.1:6379/0"
TPM = 1000
KEY = "tpm-test-key-0001"


@contextlib.asynccontextmanager
async def _gateway(cfg: dict[str, Any]) -> AsyncIterator[tuple[Any, Served]]:
    app = create_app(parse_config(cfg))
    gw = await start_server(app, lifespan="on")
    try:
        yield app, gw
    finally:
        await gw.stop()


@contextlib.asynccontextmanager
async def _redis_keys_of(tenant: str) -> AsyncIterator[None]:
    """Delete the limiter's keys of `tenant` afterwards."""
    try:
        yield
    finally:
        r = Redis.from_url(REDIS_URL)
        try:
            keys = [k async for k in r.scan_iter(match=f"*{tenant}*")]
            if keys:
                await r.delete(*keys)
        finally:
            await r.aclose()


def _config(fleet: Fleet, tenant: str, backend: str, **pool: Any) -> dict[str, Any]:
    return {
        "pools": {"chat": {
            "replicas": [{"url": u, "name": f"r{i}"} for i, u in enumerate(fleet.urls)],
            "policy": "round_robin",
            "health": {"interval_s": 0.2},
            "scrape": {"interval_s": 0.1},
            "lora": {"refresh_s": 0.1},
            **pool,
        }},
        "tenants": [{"name": tenant, "api_keys": [KEY], "limits": {"tokens_per_minute": TPM}}],
        "ratelimit": {"backend": backend, "redis_url": REDIS_URL},
        "tracing": {"exporter": "none"},
    }  # fmt: skip


async def _wave(url: str, n: int) -> tuple[list[int], list[int]]:
    """`n` concurrent chats without max_tokens: (statuses, tokens served per 200 by usage)."""
    body = {"model": "qwen2.5-14b", "messages": [{"role": "user", "content": "Say hello."}]}
    headers = {"authorization": f"Bearer {KEY}"}

    async def one(h: aiohttp.ClientSession) -> tuple[int, int]:
        async with h.post(url + "/v1/chat/completions", json=body, headers=headers) as res:
            answer = await res.json()
            if res.status == 200:
                return 200, int(answer["usage"]["total_tokens"])
            assert res.status == 429, answer
            assert answer["error"]["type"] == "rate_limit_error"
            return 429, 0

    async with aiohttp.ClientSession() as h:
        done = await asyncio.gather(*(one(h) for _ in range(n)))
    return [s for s, _ in done], [t for s, t in done if s == 200]


@pytest.mark.parametrize("backend", ["memory", "redis"])
@pytest.mark.parametrize("bound", ["context", "default_max_tokens"])
async def test_requests_without_max_tokens_never_overrun_tokens_per_minute(
    backend: str, bound: str
) -> None:
    tenant = f"tpm-{uuid.uuid4().hex[:12]}"
    if bound == "context":
        # the engine's context is 256 tokens: no answer can make a request cost more
        fleet = Fleet(n=2, speedup=1000.0, max_model_len=256, output_lengths="uniform:40:80")
        pool: dict[str, Any] = {}
    else:  # a large context; the operator's estimate is what answers here come to
        fleet = Fleet(n=2, speedup=1000.0, output_lengths="uniform:40:100")
        pool = {"default_max_tokens": 100}
    async with fleet, _redis_keys_of(tenant):
        async with _gateway(_config(fleet, tenant, backend, **pool)) as (app, served):
            replicas = app.gateway.pools["chat"].replicas
            await poll_until(lambda: all(r.lora.base for r in replicas))  # /v1/models was read
            t0 = time.monotonic()
            first, used1 = await _wave(served.url, 30)
            second, used2 = await _wave(served.url, 30)  # after the first wave was settled
            elapsed = time.monotonic() - t0
    refill = elapsed * TPM / 60.0
    served_tokens = sum(used1) + sum(used2)
    assert served_tokens <= TPM + refill, (
        f"{served_tokens} tokens served against a {TPM} tokens/min bucket "
        f"({first.count(200)} + {second.count(200)} requests admitted)"
    )
    assert first.count(200) >= 1 and first.count(429) >= 1
    # the answers' usage gave back what the estimate over-charged: the second wave gets in
    assert second.count(200) >= 1
