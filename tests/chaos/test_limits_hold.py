"""Issue 22: limits hold through the real gateway, whatever the body asks for.

Token buckets under concurrent bursts with both backends (a request whose max_tokens can never
fit is refused and told so; a refund never gives back more than was taken; usage the gateway
cannot account for keeps its charge), a client's integer `priority` never reaching the engine
unless the gateway set it, and a 504 that names the timeout that fired.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from redis.asyncio import Redis

from gateway.limits.ratelimit import (
    MemoryRateLimiter,
    RateLimiter,
    RedisRateLimiter,
    Rule,
    rate_limited,
)
from tests.gateway.conftest import Rig, rig
from tests.gateway.fake_replica import Upstream

REDIS_URL = "redis://127.0.0.1:6379/0"
KEY = "key-limits-" + "z" * 20
BATCH_KEY = "key-batch-" + "q" * 20
PER_MIN = 1000  # tokens_per_minute of the limited tenant: a bucket 1000 deep, 16.7 tokens/s
BACKENDS = ["memory", "redis"]


async def _drop_keys(pattern: str) -> None:
    r = Redis.from_url(REDIS_URL)
    try:
        # count: a Redis that also holds other runs' keys (benchmarks) is walked in few calls
        keys = [k async for k in r.scan_iter(match=pattern, count=1000)]
        if keys:
            await r.delete(*keys)
    finally:
        await r.aclose()


@contextlib.asynccontextmanager
async def limited(backend: str, up: Upstream, **pool: Any) -> AsyncIterator[Rig]:
    """A gateway whose one tenant may use PER_MIN tokens a minute; Redis buckets dropped after."""
    tenant = f"lim-{uuid.uuid4().hex[:10]}"  # apart from every other run's shared buckets
    extra: dict[str, Any] = {
        "auth": "required",
        "tenants": [{"name": tenant, "api_keys": [KEY], "limits": {"tokens_per_minute": PER_MIN}}],
    }
    if backend == "redis":
        extra["ratelimit"] = {"backend": "redis", "redis_url": REDIS_URL}
    try:
        async with rig([up], pool={"max_inflight_per_replica": 1000, **pool}, extra=extra) as r:
            yield r
    finally:
        if backend == "redis":
            await _drop_keys(f"kvgw:rl:{{{tenant}}}:*")


async def post(
    h: aiohttp.ClientSession, r: Rig, max_tokens: int | None, stream: bool = False
) -> tuple[int, dict[str, str], bytes]:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if stream:
        body["stream"] = True
    hdrs = {"authorization": f"Bearer {KEY}"}
    async with h.post(r.url + "/v1/chat/completions", json=body, headers=hdrs) as res:
        return res.status, dict(res.headers), await res.read()


async def burst(r: Rig, n: int, max_tokens: int | None) -> list[tuple[int, dict[str, str], bytes]]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=n)) as h:
        return await asyncio.gather(*(post(h, r, max_tokens) for _ in range(n)))


class NoUsageStream(Upstream):
    """Streams an answer and never a usage chunk, whatever the request asks for."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("/completions"):
            await super().__call__(scope, receive, send)
            return
        while (await receive()).get("more_body"):
            pass
        self.calls += 1
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                 "choices": [{"index": 0, "delta": {"content": "w "}, "finish_reason": None}]}  # fmt: skip
        for body in (b"data: " + orjson.dumps(chunk) + b"\n\n", b"data: [DONE]\n\n"):
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def statuses(results: list[tuple[int, dict[str, str], bytes]]) -> list[int]:
    return [s for s, _, _ in results]


# --- token limits ------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
async def test_max_tokens_that_can_never_fit_is_refused_and_says_so(backend: str) -> None:
    up = Upstream("u")
    async with limited(backend, up) as r:
        results = await burst(r, 30, max_tokens=5000)
    assert statuses(results) == [429] * 30  # was 30 of 30 through: 27,150 tokens in a second
    assert up.calls == 0
    _, hd, raw = results[0]
    err = orjson.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["code"], err["param"]) == (
        "rate_limit_error",
        "request_exceeds_limit",
        "max_tokens",
    )
    msg = err["message"]
    assert "tokens/min" in msg and "1000" in msg and "5000" in msg and "max_tokens" in msg, msg
    assert "Retry-After" not in hd and "retry-after-ms" not in hd  # waiting cannot help
    assert hd["x-ratelimit-limit-tokens"] == "1000"


@pytest.mark.parametrize("backend", BACKENDS)
async def test_concurrent_bursts_never_overdraw_the_bucket(backend: str) -> None:
    """Every wave: 30 at once, each may use 905; the upstream uses 13 and is slow enough that
    the whole wave is decided before any refund. Admitted usage stays within the bucket."""
    up = Upstream("u", delay_s=0.3)  # reports 5 prompt + 8 completion tokens
    t0 = time.monotonic()
    async with limited(backend, up) as r:
        waves = [await burst(r, 30, max_tokens=900) for _ in range(3)]
    elapsed = time.monotonic() - t0
    for wave in waves:
        got = statuses(wave)
        assert got.count(200) == 1 and got.count(429) == 29, got  # 2 x 905 > 1000
        refused = next(hd for s, hd, _ in wave if s == 429)
        assert int(refused["Retry-After"]) >= 1  # this one can fit later
    used = 13 * up.calls
    assert up.calls == 3
    assert used <= PER_MIN + elapsed * PER_MIN / 60 + 13


@pytest.mark.parametrize("backend", BACKENDS)
async def test_tokens_used_hold_the_limit_over_many_waves(backend: str) -> None:
    """Usage close to max_tokens: what the upstream reports across all admitted requests never
    exceeds the bucket plus its refill by more than one request's usage."""
    up = Upstream("u", chunks=200)  # 205 tokens each
    t0 = time.monotonic()
    async with limited(backend, up) as r:
        for _ in range(5):
            await burst(r, 30, max_tokens=200)
    elapsed = time.monotonic() - t0
    used = 205 * up.calls
    assert up.calls >= 4  # the bucket is used, not refused outright
    assert used <= PER_MIN + elapsed * PER_MIN / 60 + 205, (used, elapsed)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_unreported_usage_keeps_its_charge(backend: str) -> None:
    """Streams with no usage: the gateway cannot know what was generated, so it gives nothing
    back (a refund of the whole max_tokens let every request through)."""
    up = NoUsageStream("u")
    async with limited(backend, up) as r, aiohttp.ClientSession() as h:
        got = [(await post(h, r, 400, stream=True))[0] for _ in range(6)]
    assert got[:2] == [200, 200] and got[2:] == [429] * 4, got
    assert up.calls == 2


@pytest.mark.parametrize("backend", BACKENDS)
async def test_negative_reported_usage_is_no_refund(backend: str) -> None:
    up = Upstream("u", chunks=-1_000_000)  # reports completion_tokens = -1,000,000
    async with limited(backend, up) as r, aiohttp.ClientSession() as h:
        got = [(await post(h, r, 400))[0] for _ in range(6)]
    assert got[:2] == [200, 200] and got[2:] == [429] * 4, got


def _limiter(backend: str) -> RateLimiter:
    if backend == "memory":
        return MemoryRateLimiter()
    return RedisRateLimiter(REDIS_URL, namespace=f"test:rl:{uuid.uuid4().hex}")


@pytest.mark.parametrize("backend", BACKENDS)
async def test_limiter_refuses_a_cost_above_the_depth_and_takes_nothing(backend: str) -> None:
    lim = _limiter(backend)
    tok = Rule("tokens/min", 10.0, 100.0, "tokens")
    req = Rule("requests/min", 1.0, 10.0)
    try:
        v = await lim.acquire("t", [req, tok], [1, 100.5])
        assert not v.allowed and v.blocked == ("tokens/min",)
        assert v.oversized == (("tokens/min", 100.5),)
        assert [round(s.remaining) for s in v.states] == [10, 100]  # nothing taken
        exc = rate_limited(v, "acme")
        assert exc.status == 429 and exc.code == "request_exceeds_limit"
        assert exc.retry_after is None and "retry-after" not in exc.headers()
        assert "retry-after-ms" not in exc.headers()
        assert "100.5" in exc.message and "100" in exc.message and "tokens/min" in exc.message
        v = await lim.acquire("t", [req, tok], [1, 100])  # exactly the depth fits
        assert v.allowed and v.oversized == ()
        assert [round(s.remaining) for s in v.states] == [9, 0]
    finally:
        await lim.aclose()
        if isinstance(lim, RedisRateLimiter):
            await _drop_keys(f"{lim.namespace}:*")


# --- issue 22 item 10b: the engine's priority is the gateway's to set ----------------------------


@pytest.mark.parametrize(("forward", "expected"), [(False, None), (True, 1)])
async def test_client_integer_priority_never_reaches_the_engine(
    forward: bool, expected: int | None
) -> None:
    up = Upstream("u")
    extra = {
        "auth": "required",
        "tenants": [{"name": "batchy", "api_keys": [BATCH_KEY], "priority": "batch"}],
        "admission": {"forward_priority": forward},
    }
    async with rig([up], extra=extra) as r, aiohttp.ClientSession() as h:
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "priority": -100}
        hdrs = {"authorization": f"Bearer {BATCH_KEY}"}
        async with h.post(r.url + "/v1/chat/completions", json=body, headers=hdrs) as res:
            assert res.status == 200
    sent = orjson.loads(up.bodies[0])
    assert sent.get("priority") == expected  # -100 would jump the engine's queue
    assert ("priority" in sent) == forward
    assert sent["messages"] == body["messages"]


# --- issue 22 item 10c: a 504 names the timeout that fired ---------------------------------------


async def _timed_out(r: Rig, stream: bool) -> dict[str, Any]:
    async with aiohttp.ClientSession() as h:
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": stream}
        async with h.post(r.url + "/v1/chat/completions", json=body) as res:
            assert res.status == 504, await res.read()
            err: dict[str, Any] = orjson.loads(await res.read())["error"]
            return err


async def test_504_names_first_byte_s() -> None:
    up = Upstream("slow", delay_s=1.5)
    timeouts = {"connect_s": 1, "first_byte_s": 0.3, "idle_s": 5, "total_s": 30}
    async with rig([up], pool={"timeouts": timeouts, "retries": 0}) as r:
        err = await _timed_out(r, stream=True)
    assert "first_byte_s" in err["message"] and "0.3 s" in err["message"], err
    assert "total_s" not in err["message"]


async def test_504_names_total_s() -> None:
    up = Upstream("slow", delay_s=1.5)
    timeouts = {"connect_s": 1, "first_byte_s": 5, "idle_s": 5, "total_s": 0.4}
    async with rig([up], pool={"timeouts": timeouts, "retries": 0}) as r:
        err = await _timed_out(r, stream=False)
    assert "total_s" in err["message"] and "0.4 s" in err["message"], err
    assert "first_byte_s" not in err["message"]


async def test_504_names_connect_s() -> None:
    """A listener whose accept queue is full drops new SYNs: connecting times out."""
    with socket.socket() as lsn:
        lsn.bind(("127.0.0.1", 0))
        lsn.listen(0)
        port = lsn.getsockname()[1]
        fillers = []
        for _ in range(4):  # fill the backlog; none is ever accepted
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(("127.0.0.1", port))
            fillers.append(s)
        await asyncio.sleep(0.1)
        timeouts = {"connect_s": 0.3, "first_byte_s": 5, "idle_s": 5, "total_s": 30}
        pool = {
            "replicas": [{"url": f"http://127.0.0.1:{port}", "name": "blackhole"}],
            "timeouts": timeouts,
            "retries": 0,
            "health": {"interval_s": 60, "timeout_s": 0.3, "failures_to_open": 5, "open_s": 1.0},
        }
        try:
            async with rig([], pool=pool) as r:
                err = await _timed_out(r, stream=False)
        finally:
            for s in fillers:
                s.close()
    assert "connect_s" in err["message"] and "0.3 s" in err["message"], err
