"""Token buckets: exact under concurrency (memory, Redis, two processes), refill, all-or-nothing,
debt, headers, and failing open through a Redis outage."""

from __future__ import annotations

import asyncio
import logging
import shutil
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.errors import RateLimited
from gateway.limits.ratelimit import (
    MemoryRateLimiter,
    RateLimitConfig,
    RateLimiter,
    RedisRateLimiter,
    Rule,
    Verdict,
    costs_for,
    format_reset,
    headers,
    open_rate_limiter,
    rate_limited,
)
from tests.support import at_once, free_port

REDIS_URL = "redis://127.0.0.1:6379/0"
ROOT = Path(__file__).resolve().parents[2]
PER_MIN_100 = Rule("requests/min", 100 / 60, 100)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
async def namespace() -> AsyncIterator[str]:
    """A unique key prefix; every key under it is deleted afterwards."""
    ns = f"test:rl:{uuid.uuid4().hex}"
    yield ns
    r = Redis.from_url(REDIS_URL)
    try:
        keys = [k async for k in r.scan_iter(match=f"{ns}:*")]
        if keys:
            await r.delete(*keys)
    finally:
        await r.aclose()


def admitted(verdicts: list[Verdict]) -> int:
    return sum(v.allowed for v in verdicts)


def exactly_100(n: int, t0: float) -> bool:
    """100 up front, plus what the 100/min bucket refilled while the test ran (Redis keeps time)."""
    return 100 <= n <= 100 + (time.monotonic() - t0) * PER_MIN_100.rate_per_s + 1


async def burst_of(limiter: RateLimiter, key: str, n: int, rules: list[Rule]) -> list[Verdict]:
    return await asyncio.gather(
        *(limiter.acquire(key, rules, [1.0] * len(rules)) for _ in range(n))
    )


# --- memory ----------------------------------------------------------------------------------


async def test_memory_exact_under_concurrency() -> None:
    lim = MemoryRateLimiter(clock=Clock())
    verdicts = await burst_of(lim, "t", 1000, [PER_MIN_100])
    assert admitted(verdicts) == 100
    refused = [v for v in verdicts if not v.allowed]
    assert refused[0].retry_after_s == pytest.approx(0.6)  # one request at 100/min
    assert refused[0].blocked == ("requests/min",)


async def test_memory_refill_with_injected_clock() -> None:
    clock = Clock()
    lim = MemoryRateLimiter(clock=clock)
    rule = Rule("rps", 2.0, 4.0)
    assert admitted(await burst_of(lim, "t", 10, [rule])) == 4
    clock.t += 1.0  # two tokens back
    assert admitted(await burst_of(lim, "t", 10, [rule])) == 2
    clock.t += 100.0  # capped at the burst
    assert admitted(await burst_of(lim, "t", 10, [rule])) == 4
    assert admitted(await burst_of(lim, "other", 10, [rule])) == 4  # keys are apart


async def test_memory_all_or_nothing_across_rules() -> None:
    clock = Clock()
    lim = MemoryRateLimiter(clock=clock)
    req = Rule("requests/min", 1.0, 10.0)
    tok = Rule("tokens/min", 10.0, 100.0, "tokens")
    v = await lim.acquire("t", [req, tok], [1, 80])
    assert v.allowed and [s.remaining for s in v.states] == [9, 20]
    v = await lim.acquire("t", [req, tok], [1, 50])  # tokens short: requests untouched
    assert not v.allowed and v.blocked == ("tokens/min",)
    assert v.retry_after_s == pytest.approx(3.0)
    assert [s.remaining for s in v.states] == [9, 20]
    v = await lim.acquire("t", [req, tok], [1, 20])
    assert v.allowed and [s.remaining for s in v.states] == [8, 0]


async def test_memory_oversized_cost_is_refused_and_takes_nothing() -> None:
    """A cost deeper than the bucket can never fit: refused at once, nothing taken (it used to
    be charged as the whole depth and let through, the token-limit bypass)."""
    clock = Clock()
    lim = MemoryRateLimiter(clock=clock)
    tok = Rule("tokens/min", 10.0, 100.0, "tokens")
    v = await lim.acquire("t", [tok], [500])
    assert not v.allowed and v.oversized == (("tokens/min", 500.0),)
    assert v.states[0].remaining == pytest.approx(100.0)
    assert (await lim.acquire("t", [tok], [100])).allowed  # a full-depth cost still fits


async def test_a_request_whose_choices_never_fit_says_so() -> None:
    """n=8 of max_tokens 150 (1,212 tokens) against a 1,000-token bucket can never fit: the error
    says why, with the numbers, and how to fix it (issue 39)."""
    tok = Rule("tokens/min", 1000 / 60, 1000.0, "tokens")
    v = await MemoryRateLimiter(clock=Clock()).acquire("t", [tok], costs_for([tok], 12, 150, 0, 8))
    exc = rate_limited(v, "acme", prompt_tokens=12, max_tokens=150, choices=8)
    assert exc.code == "request_exceeds_limit" and "retry-after" not in exc.headers()
    assert "the request may use 1212" in exc.message
    assert "(prompt ~12 + 8 choices of max_tokens 150)" in exc.message
    assert "lower n, max_tokens or shorten the prompt" in exc.message


async def test_memory_adjust_debt_and_refund() -> None:
    clock = Clock()
    lim = MemoryRateLimiter(clock=clock)
    tok = Rule("tokens/min", 10.0, 100.0, "tokens")
    assert (await lim.acquire("t", [tok], [50])).allowed
    await lim.adjust("t", tok, 80)  # used 80 more than estimated: 30 in debt
    v = await lim.acquire("t", [tok], [10])
    assert not v.allowed and v.retry_after_s == pytest.approx(4.0)
    assert v.states[0].remaining == 0 and v.states[0].reset_s == pytest.approx(13.0)
    await lim.adjust("t", tok, -1000)  # a refund never overfills
    v = await lim.acquire("t", [tok], [100])
    assert v.allowed and v.states[0].remaining == 0


async def test_memory_sweeps_full_buckets() -> None:
    clock = Clock()
    lim = MemoryRateLimiter(clock=clock, sweep_s=60)
    for i in range(50):
        await lim.acquire(f"t{i}", [Rule("rps", 1.0, 5.0)], [1])
    assert len(lim) == 50
    clock.t += 61
    await lim.acquire("x", [Rule("rps", 1.0, 5.0)], [1])
    assert len(lim) == 1


# --- headers ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.0201, "21ms"),
        (0.9999, "1s"),
        (1, "1s"),
        (1 + 1e-12, "1s"),
        (1.5, "1.5s"),
        (360, "6m0s"),
        (3723, "1h2m3s"),
    ],
)
def test_format_reset(seconds: float, text: str) -> None:
    assert format_reset(seconds) == text


async def test_headers_allowed_and_refused() -> None:
    clock = Clock()
    lim = MemoryRateLimiter(clock=clock)
    rules = [
        Rule("requests/s", 1, 1),
        Rule("requests/min", 1, 60),
        Rule("tokens/min", 100, 6000, "tokens"),
    ]
    v = await lim.acquire("t", rules, costs_for(rules, 100, 400))
    h = dict(headers(v))
    assert h[b"x-ratelimit-limit-requests"] == b"1"  # the tightest request bucket
    assert h[b"x-ratelimit-remaining-requests"] == b"0"
    assert h[b"x-ratelimit-reset-requests"] == b"1s"
    assert h[b"x-ratelimit-limit-tokens"] == b"6000"
    assert h[b"x-ratelimit-remaining-tokens"] == b"5500"
    assert h[b"x-ratelimit-reset-tokens"] == b"5s"
    assert b"retry-after" not in h
    v = await lim.acquire("t", rules, costs_for(rules, 10, None))
    h = dict(headers(v))
    assert h[b"retry-after"] == b"1" and h[b"retry-after-ms"] == b"1000"
    exc = rate_limited(v, "acme")
    assert isinstance(exc, RateLimited) and exc.status == 429
    assert "acme" in exc.message and "requests/s" in exc.message
    assert exc.headers()["retry-after"] == "1"
    assert exc.headers()["x-ratelimit-remaining-requests"] == "0"


def test_costs_and_config_defaults() -> None:
    rules = [Rule("r", 1, 1), Rule("t", 1, 1, "tokens")]
    assert costs_for(rules, 30, None) == [1.0, 30.0]
    assert costs_for(rules, 30, 70) == [1.0, 100.0]
    # no max_tokens: the answer's bound is charged, never past a bucket's depth (then the
    # request fits a full bucket); a prompt deeper than the bucket still never fits
    deep = [Rule("r", 1, 1), Rule("t", 10, 600, "tokens"), Rule("m", 1, 200, "tokens")]
    assert costs_for(deep, 30, None, 100) == [1.0, 130.0, 130.0]
    assert costs_for(deep, 30, None, 4000) == [1.0, 600.0, 200.0]
    assert costs_for(deep, 300, None, 4000) == [1.0, 600.0, 300.0]
    assert costs_for(deep, 30, 70, 4000) == [1.0, 100.0, 100.0]  # max_tokens set: as asked
    # every choice may use max_tokens (n, best_of, a batch of prompts): each is charged
    assert costs_for(deep, 30, 70, 4000, choices=8) == [1.0, 590.0, 590.0]
    assert costs_for(deep, 30, None, 20, choices=8) == [1.0, 190.0, 190.0]
    assert costs_for(deep, 30, None, 100, choices=8) == [1.0, 600.0, 200.0]  # still a full bucket


@pytest.mark.parametrize(
    ("kind", "fields", "choices", "tokens"),
    [
        ("chat", {"messages": [{"role": "user", "content": "x" * 40}]}, 1, None),
        ("chat", {"messages": [{"role": "user", "content": "x" * 40}], "n": 8}, 8, None),
        ("completions", {"prompt": "x" * 40, "n": 2, "best_of": 5}, 5, 10),
        ("completions", {"prompt": ["x" * 40, "y" * 80, "z" * 4], "n": 3}, 9, 10 + 20 + 1),
        ("completions", {"prompt": [[1, 2, 3], [4, 5]], "best_of": 2}, 4, 5),
        ("completions", {"prompt": [1, 2, 3], "n": 2}, 2, 3),
    ],
)
def test_choices_count_n_best_of_and_a_batch(
    kind: str, fields: dict[str, object], choices: int, tokens: int | None
) -> None:
    """What a request is charged for: `n` (or `best_of`, the answers generated) per prompt, and
    a batch's prompts all estimated."""
    import orjson

    from gateway.api.kinds import KINDS
    from prefix_index.chunking import make_chunker

    row = KINDS[kind]
    req = row.parse(orjson.dumps({"model": "m", **fields}), None)
    assert req.choices == choices
    if tokens is not None:
        assert row.prompt(req, make_chunker("bytes"))[1] == tokens
    cfg = RateLimitConfig()
    assert (cfg.backend, cfg.redis_url) == ("memory", REDIS_URL)
    with pytest.raises(ValueError, match="unknown rate limit backend 'etcd'"):
        open_rate_limiter("etcd", None)
    with pytest.raises(ValueError, match="must be > 0"):
        Rule("x", 0, 1)


# --- redis -----------------------------------------------------------------------------------


async def test_redis_exact_under_concurrency(namespace: str) -> None:
    lim = open_rate_limiter("redis", REDIS_URL)
    assert isinstance(lim, RedisRateLimiter)
    lim.namespace = namespace
    try:
        t0 = time.monotonic()
        assert exactly_100(admitted(await burst_of(lim, "t", 1000, [PER_MIN_100])), t0)
    finally:
        await lim.aclose()


async def test_redis_two_limiters_share_buckets(namespace: str) -> None:
    a = RedisRateLimiter(REDIS_URL, namespace=namespace)
    b = RedisRateLimiter(REDIS_URL, namespace=namespace)
    try:
        t0 = time.monotonic()
        va, vb = await asyncio.gather(
            burst_of(a, "t", 1000, [PER_MIN_100]), burst_of(b, "t", 1000, [PER_MIN_100])
        )
        assert exactly_100(admitted(va) + admitted(vb), t0)
        assert admitted(va) > 0 and admitted(vb) > 0
    finally:
        await a.aclose()
        await b.aclose()


CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from gateway.limits.ratelimit import RedisRateLimiter, Rule

    async def main() -> None:
        lim = RedisRateLimiter(sys.argv[1], namespace=sys.argv[2])
        rule = Rule("requests/min", 100 / 60, 100)
        sys.stdout.write("ready\\n")
        sys.stdout.flush()
        sys.stdin.readline()
        vs = await asyncio.gather(*(lim.acquire("t", [rule], [1]) for _ in range(1000)))
        await lim.aclose()
        print(sum(v.allowed for v in vs))

    asyncio.run(main())
    """
)


async def test_redis_second_process_shares_buckets(namespace: str) -> None:
    root = ROOT
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, REDIS_URL, namespace,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdin is not None
    lim = RedisRateLimiter(REDIS_URL, namespace=namespace)
    try:
        assert await asyncio.wait_for(proc.stdout.readline(), 30) == b"ready\n"
        t0 = time.monotonic()
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
        mine = admitted(await burst_of(lim, "t", 1000, [PER_MIN_100]))
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
        theirs = int(out)
        assert exactly_100(mine + theirs, t0)  # separate buckets would admit ~200
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await lim.aclose()


async def test_redis_all_or_nothing_adjust_headers_and_ttl(namespace: str) -> None:
    lim = RedisRateLimiter(REDIS_URL, namespace=namespace)
    r = Redis.from_url(REDIS_URL)
    req = Rule("requests/min", 1.0, 10.0)
    tok = Rule("tokens/min", 10.0, 100.0, "tokens")
    try:
        v = await lim.acquire("t", [req, tok], [1, 80])
        assert v.allowed and [round(s.remaining) for s in v.states] == [9, 20]
        v = await lim.acquire("t", [req, tok], [1, 50])
        assert not v.allowed and v.blocked == ("tokens/min",)
        assert v.retry_after_s == pytest.approx(3.0, abs=0.05)
        assert [int(s.remaining) for s in v.states] == [9, 20]
        await lim.adjust("t", tok, 120)  # now in debt
        v = await lim.acquire("t", [tok], [10])
        assert not v.allowed and v.states[0].remaining == 0
        assert v.retry_after_s == pytest.approx(11.0, abs=0.05)
        assert dict(headers(v))[b"retry-after"] == b"11"
        ttl = await r.pttl(lim.bucket_key("t", tok))
        assert 10_000 < ttl <= 22_000  # refill time (20 s) plus a second: idle buckets vanish
    finally:
        await r.aclose()
        await lim.aclose()


async def test_redis_refill_over_real_time(namespace: str) -> None:
    lim = RedisRateLimiter(REDIS_URL, namespace=namespace)
    rule = Rule("fast", 5.0, 2.0)

    def bounded(n: int, t0: float) -> bool:  # the bucket refills while a slow Redis answers
        return 2 <= n <= 2 + (time.monotonic() - t0) * rule.rate_per_s

    try:
        t0 = time.monotonic()
        assert bounded(admitted(await burst_of(lim, "t", 5, [rule])), t0)
        v = await lim.acquire("t", [rule], [1])
        assert not v.allowed and 0 < v.retry_after_s <= 0.2 + 1e-6
        await asyncio.sleep(0.45)  # two tokens back: full again
        t0 = time.monotonic()
        assert bounded(admitted(await burst_of(lim, "t", 5, [rule])), t0)
    finally:
        await lim.aclose()


async def _start_redis(port: int) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        shutil.which("redis-server") or "redis-server", "--port", str(port),
        "--save", "", "--appendonly", "no", "--bind", "127.0.0.1",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    probe = Redis(port=port, socket_connect_timeout=0.2)
    try:
        for _ in range(200):
            try:
                if await probe.ping():
                    return proc
            except (OSError, RedisError):  # still starting
                pass
            await asyncio.sleep(0.02)
    finally:
        await probe.aclose()
    proc.kill()
    await proc.wait()
    raise RuntimeError("redis-server did not start")


async def _until(check: Callable[[], Awaitable[bool]]) -> None:
    for _ in range(250):  # poll, up to ~5 s
        if await check():
            return
        await asyncio.sleep(0.02)
    pytest.fail("condition not reached")


class ProbeClock:
    """The limiter's clock for its probes: real time, or held still (no probe comes due)."""

    def __init__(self) -> None:
        self.held: float | None = None

    def __call__(self) -> float:
        return time.monotonic() if self.held is None else self.held

    def hold(self) -> None:
        self.held = time.monotonic()

    def run(self) -> None:
        self.held = None


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
async def test_redis_outage_fails_open_warns_once_and_recovers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.ratelimit")
    port = free_port()
    server = await _start_redis(port)
    clock = ProbeClock()
    lim = RedisRateLimiter(f"redis://127.0.0.1:{port}/0", namespace="o", probe_s=0.1, clock=clock)
    rule = Rule("rpm", 1 / 60, 3.0)
    try:
        assert admitted(await burst_of(lim, "t", 5, [rule])) == 3
        server.kill()
        await server.wait()
        clock.hold()  # no probe comes due until the clock runs again
        verdicts = await burst_of(lim, "t", 20, [rule])  # these find Redis gone
        # an outage does not stall requests: until the next probe, a verdict is decided on
        # its first step, without waiting on Redis or anything else
        verdicts += [at_once(lim.acquire("t", [rule], [1])) for _ in range(20)]
        clock.run()
        for _ in range(5):  # probes come due again, and fail
            verdicts += await burst_of(lim, "t", 5, [rule])
            await asyncio.sleep(0.03)
        assert all(v.allowed for v in verdicts) and any(v.degraded for v in verdicts)
        assert headers(verdicts[-1]) == []  # unknown while Redis is away
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "unreachable" in warnings[0].getMessage()
        server = await _start_redis(port)

        async def limiting_again() -> bool:
            return not (await lim.acquire("t", [rule], [1])).degraded

        await _until(limiting_again)  # the fresh server's bucket now holds 2
        assert admitted(await burst_of(lim, "t", 5, [rule])) == 2
        assert any("answers again" in r.getMessage() for r in caplog.records)
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    finally:
        await lim.aclose()
        if server.returncode is None:
            server.kill()
            await server.wait()
