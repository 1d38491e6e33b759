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


# --- every choice is charged (issue 39) ---------------------------------------------------------
N, MAX_TOKENS = 4, 100  # each request may use 4 × 100 tokens: two fit a 1,000-token bucket


async def _choices_burst(urls: list[str], n: int) -> tuple[list[int], list[int]]:
    """`n` concurrent chats asking for N choices of MAX_TOKENS, spread over the gateways at
    `urls`: (statuses, tokens served per 200 by usage)."""
    body = {"model": "test-model", "messages": [{"role": "user", "content": "Say hello."}],
            "n": N, "max_tokens": MAX_TOKENS}  # fmt: skip
    headers = {"authorization": f"Bearer {KEY}"}

    async def one(h: aiohttp.ClientSession, url: str) -> tuple[int, int]:
        async with h.post(url + "/v1/chat/completions", json=body, headers=headers) as res:
            answer = await res.json()
            if res.status == 200:
                assert len(answer["choices"]) == N
                return 200, int(answer["usage"]["total_tokens"])
            assert res.status == 429, answer
            return 429, 0

    async with aiohttp.ClientSession() as h:
        done = await asyncio.gather(*(one(h, urls[i % len(urls)]) for i in range(n)))
    return [s for s, _ in done], [t for s, t in done if s == 200]


@pytest.mark.parametrize(
    ("backend", "gateways"), [("memory", 1), ("redis", 1), ("redis", 2)]
)
async def test_every_choice_is_charged_so_a_burst_never_overruns_the_bucket(
    backend: str, gateways: int
) -> None:
    """30 concurrent chats with n=4, max_tokens=100 against a 1,000 tokens/min tenant, through
    one gateway or two sharing the Redis limiter: the tokens served (the replica's usage, which
    counts every choice) stay within the bucket. When n was not charged, 9 were admitted and
    3,645 tokens served in under a second."""
    from tests.gateway.fake_replica import Upstream

    tenant = f"tpm-n-{uuid.uuid4().hex[:12]}"
    up = Upstream("r0", chunks=MAX_TOKENS)
    upstream = await start_server(up)
    cfg = {
        "pools": {"chat": {"replicas": [{"url": upstream.url, "name": "r0"}],
                           "policy": "round_robin", "health": {"interval_s": 0.2}}},
        "tenants": [{"name": tenant, "api_keys": [KEY], "limits": {"tokens_per_minute": TPM}}],
        "ratelimit": {"backend": backend, "redis_url": REDIS_URL},
        "tracing": {"exporter": "none"},
    }  # fmt: skip
    try:
        async with _redis_keys_of(tenant), contextlib.AsyncExitStack() as stack:
            urls = [(await stack.enter_async_context(_gateway(cfg)))[1].url for _ in range(gateways)]
            t0 = time.monotonic()
            statuses, used = await _choices_burst(urls, 30)
            elapsed = time.monotonic() - t0
    finally:
        await upstream.stop()
    refill = elapsed * TPM / 60.0
    assert sum(used) <= TPM + refill, (
        f"{sum(used)} tokens served against a {TPM} tokens/min bucket "
        f"({statuses.count(200)} of 30 requests admitted)"
    )
    assert statuses.count(200) >= 1 and statuses.count(429) >= 1
    assert all(u == 5 + N * MAX_TOKENS for u in used)  # the replica really answered N choices


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_retry_after_holds_while_the_requests_before_it_settle(backend: str) -> None:
    """A refused request retried when its Retry-After says is admitted, though the requests
    admitted before it finished (and were settled on their usage) in between: their settlement
    gives back, never takes more. When `n` was not charged, their answers put the bucket in debt
    and a request told "retry in 0.2 s" was refused again with "retry in 2.6 s"."""
    from tests.gateway.fake_replica import Upstream

    tenant = f"tpm-ra-{uuid.uuid4().hex[:12]}"
    up = Upstream("r0", chunks=MAX_TOKENS, delay_s=0.05)  # the burst is in flight when refused
    upstream = await start_server(up)
    limits = {"tokens_per_minute": 60_000, "burst_s": 1}  # 1,000 tokens, refilled in 1 s
    cfg = {
        "pools": {"chat": {"replicas": [{"url": upstream.url, "name": "r0"}],
                           "policy": "round_robin", "health": {"interval_s": 0.2}}},
        "tenants": [{"name": tenant, "api_keys": [KEY], "limits": limits}],
        "ratelimit": {"backend": backend, "redis_url": REDIS_URL},
        "tracing": {"exporter": "none"},
    }  # fmt: skip
    body = {"model": "test-model", "messages": [{"role": "user", "content": "Say hello."}],
            "n": N, "max_tokens": MAX_TOKENS}  # fmt: skip
    headers = {"authorization": f"Bearer {KEY}"}
    refusals: list[float] = []  # when each refusal came
    retry_afters: list[float] = []  # what each was told (retry-after-ms / 1000), not measured

    async def one(h: aiohttp.ClientSession) -> int:
        async with h.post(gw.url + "/v1/chat/completions", json=body, headers=headers) as res:
            await res.read()
            if res.status == 429:
                refusals.append(time.monotonic())
                retry_afters.append(int(res.headers["retry-after-ms"]) / 1000)
            return res.status

    try:
        async with _redis_keys_of(tenant), _gateway(cfg) as (_, gw):
            async with aiohttp.ClientSession() as h:
                statuses = await asyncio.gather(*(one(h) for _ in range(12)))
                assert statuses.count(200) >= 1 and refusals, statuses
                # a refill of a part of the bucket, not the whole of it
                assert min(retry_afters) < 1.0, retry_afters
                soonest = min(range(len(refusals)), key=lambda i: refusals[i] + retry_afters[i])
                wait = retry_afters[soonest]
                await asyncio.sleep(max(0.0, refusals[soonest] + wait - time.monotonic()))
                refusals.clear()
                retry_afters.clear()
                retried = await one(h)
    finally:
        await upstream.stop()
    assert retried == 200, f"told to retry in {wait:.3f} s, then told {retry_afters}"
