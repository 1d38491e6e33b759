"""Token-bucket rate limits per tenant: an in-process backend and a Redis one shared by many gateways.

One `acquire` checks every rule of a key at once and takes from all buckets or from none. A cost
deeper than its bucket can never fit: it is refused at once (no Retry-After), never clamped, so
what a refund gives back is never more than what was taken.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from .errors import RateLimited, RequestExceedsLimit

log = logging.getLogger("gateway.ratelimit")

Unit = Literal["requests", "tokens"]
Clock = Callable[[], float]

_EPS = 1e-9  # float slack so an exactly refilled bucket counts as holding the token


@dataclass(frozen=True, slots=True)
class Rule:
    """One bucket: refills at `rate_per_s`, holds at most `burst`; `unit` picks the header trio."""

    name: str
    rate_per_s: float
    burst: float
    unit: Unit = "requests"

    def __post_init__(self) -> None:
        if not self.rate_per_s > 0 or not self.burst > 0:
            raise ValueError(f"rule {self.name!r}: rate_per_s and burst must be > 0")


@dataclass(frozen=True, slots=True)
class RuleState:
    """A bucket after the decision: what the `x-ratelimit-*` headers report."""

    rule: Rule
    limit: float  # bucket depth
    remaining: float  # tokens left (0 while in debt)
    reset_s: float  # until the bucket is full again


@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool
    retry_after_s: float  # 0 when allowed; else until every short bucket holds the cost
    states: tuple[RuleState, ...] = ()
    blocked: tuple[str, ...] = ()  # names of the rules whose bucket lacked the cost
    degraded: bool = False  # the backend was unreachable and the request was let through
    oversized: tuple[tuple[str, float], ...] = ()  # (rule, cost) deeper than the bucket: never fits


class RateLimiter(Protocol):
    """All-or-nothing across `rules`: when any bucket lacks its cost, nothing is taken.

    A cost above a bucket's depth can never fit: it is refused whatever the level, nothing is
    taken, its rule is in both `blocked` and `oversized`, and it adds nothing to the wait. An
    allowed verdict took exactly `costs`. `adjust` takes `delta` more from one bucket (a negative
    delta gives back) once the real usage is known; it may leave the bucket in debt, and never
    fills it past its depth.
    """

    async def acquire(self, key: str, rules: Sequence[Rule], costs: Sequence[float]) -> Verdict: ...

    async def adjust(self, key: str, rule: Rule, delta: float) -> None: ...

    async def aclose(self) -> None: ...


class RateLimitConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"


def open_rate_limiter(backend: str, redis_url: str | None = None) -> RateLimiter:
    if backend == "memory":
        return MemoryRateLimiter()
    if backend == "redis":
        return RedisRateLimiter(redis_url or "redis://127.0.0.1:6379/0")
    raise ValueError(f"unknown rate limit backend {backend!r} (known: memory, redis)")


def costs_for(rules: Sequence[Rule], prompt_tokens: int, max_tokens: int | None) -> list[float]:
    """Requests cost 1; tokens cost the prompt estimate plus max_tokens (0 when unset)."""
    tokens = float(prompt_tokens + (max_tokens or 0))
    return [1.0 if r.unit == "requests" else tokens for r in rules]


def _state(rule: Rule, level: float) -> RuleState:
    return RuleState(
        rule, rule.burst, max(0.0, level), max(0.0, (rule.burst - level) / rule.rate_per_s)
    )


def _check(rules: Sequence[Rule], costs: Sequence[float]) -> None:
    if len(rules) != len(costs):
        raise ValueError(f"{len(rules)} rules but {len(costs)} costs")


# --- headers ---------------------------------------------------------------------------------


def format_reset(seconds: float) -> str:
    """Go-style duration as OpenAI sends it: "20ms", "1s", "1.5s", "6m0s", "1h2m3s"."""
    if seconds <= 0:
        return "0s"
    ms = math.ceil(seconds * 1000 - 1e-6)  # float noise must not add a millisecond
    if ms < 1000:
        return f"{ms}ms"
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s = f"{ms / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if h:
        return f"{h}h{m}m{s}"
    if m:
        return f"{m}m{s}"
    return s


def headers(verdict: Verdict) -> list[tuple[bytes, bytes]]:
    """OpenAI's `x-ratelimit-*` trio for requests and for tokens (the tightest bucket of each).

    Plus `retry-after` (whole seconds, at least 1) and `retry-after-ms` when refused, except when
    a cost can never fit (waiting cannot help). None when the verdict is degraded (the backend
    was down, so the numbers are unknown).
    """
    out: list[tuple[bytes, bytes]] = []
    if verdict.degraded:
        return out
    for unit in ("requests", "tokens"):
        states = [s for s in verdict.states if s.rule.unit == unit]
        if not states:
            continue
        tight = min(states, key=lambda s: (s.remaining, -s.reset_s))
        out += [
            (f"x-ratelimit-limit-{unit}".encode(), str(int(tight.limit)).encode()),
            (f"x-ratelimit-remaining-{unit}".encode(), str(int(tight.remaining)).encode()),
            (f"x-ratelimit-reset-{unit}".encode(), format_reset(tight.reset_s).encode()),
        ]
    if not verdict.allowed and not verdict.oversized:
        out.append((b"retry-after", str(max(1, math.ceil(verdict.retry_after_s))).encode()))
        out.append((b"retry-after-ms", str(math.ceil(verdict.retry_after_s * 1000)).encode()))
    return out


def rate_limited(
    verdict: Verdict,
    tenant: str,
    *,
    prompt_tokens: int | None = None,
    max_tokens: int | None = None,
) -> RateLimited:
    """The error for a refused verdict, carrying the header set (Retry-After included).

    A cost that can never fit gets `RequestExceedsLimit`, naming the limit and the numbers (the
    prompt estimate and max_tokens, when given), with no Retry-After.
    """
    extra = {k.decode(): v.decode() for k, v in headers(verdict) if k != b"retry-after"}
    if verdict.oversized:
        asked = "; ".join(
            f"the {name} limit holds at most {_num(_depth(verdict, name))} tokens, "
            f"the request may use {_num(cost)}"
            for name, cost in verdict.oversized
        )
        parts = ""
        if prompt_tokens is not None:
            parts = f" (prompt ~{prompt_tokens} + max_tokens {max_tokens or 0})"
        return RequestExceedsLimit(
            f"Request too large for tenant '{tenant}': {asked}{parts}. It can never fit, so "
            "retrying will not help: lower max_tokens or shorten the prompt",
            param="max_tokens" if max_tokens else None,
            headers=extra,
        )
    what = ", ".join(verdict.blocked) or "rate"
    return RateLimited(
        f"Rate limit reached for tenant '{tenant}' ({what}); "
        f"retry in {verdict.retry_after_s:.2f} s",
        retry_after=verdict.retry_after_s,
        headers=extra,
    )


def _depth(verdict: Verdict, name: str) -> float:
    return next((s.limit for s in verdict.states if s.rule.name == name), 0.0)


def _num(x: float) -> str:
    return f"{x:.0f}" if x == int(x) else f"{x:g}"


# --- memory ----------------------------------------------------------------------------------


class MemoryRateLimiter:
    """Buckets in a dict, for one gateway process; full buckets are swept once a minute."""

    def __init__(self, clock: Clock = time.monotonic, sweep_s: float = 60.0) -> None:
        self._clock = clock
        self._sweep_s = sweep_s
        self._swept = clock()
        # (key, rule name) -> [level, time of level, rate, burst]
        self._buckets: dict[tuple[str, str], list[float]] = {}

    def __len__(self) -> int:
        return len(self._buckets)

    def _level(self, key: str, rule: Rule, now: float) -> float:
        b = self._buckets.get((key, rule.name))
        if b is None:
            return rule.burst
        return min(rule.burst, b[0] + max(0.0, now - b[1]) * rule.rate_per_s)

    async def acquire(self, key: str, rules: Sequence[Rule], costs: Sequence[float]) -> Verdict:
        _check(rules, costs)
        now = self._clock()
        self._maybe_sweep(now)
        levels = [self._level(key, r, now) for r in rules]
        needs = [max(0.0, c) for c in costs]
        wait = 0.0
        blocked: list[str] = []
        oversized: list[tuple[str, float]] = []
        for r, level, need in zip(rules, levels, needs, strict=True):
            if need > r.burst + _EPS:  # never fits: refused, and no wait would help
                blocked.append(r.name)
                oversized.append((r.name, need))
            elif level + _EPS < need:
                wait = max(wait, (need - level) / r.rate_per_s)
                blocked.append(r.name)
        allowed = not blocked
        if allowed:
            for i, (r, need) in enumerate(zip(rules, needs, strict=True)):
                levels[i] -= need
                self._buckets[(key, r.name)] = [levels[i], now, r.rate_per_s, r.burst]
        states = tuple(_state(r, lv) for r, lv in zip(rules, levels, strict=True))
        return Verdict(allowed, wait, states, tuple(blocked), oversized=tuple(oversized))

    async def adjust(self, key: str, rule: Rule, delta: float) -> None:
        now = self._clock()
        level = min(rule.burst, self._level(key, rule, now) - delta)
        self._buckets[(key, rule.name)] = [level, now, rule.rate_per_s, rule.burst]

    def _maybe_sweep(self, now: float) -> None:
        if now - self._swept < self._sweep_s:
            return
        self._swept = now
        full = [
            k
            for k, (level, t, rate, burst) in self._buckets.items()
            if level + (now - t) * rate >= burst
        ]
        for k in full:
            del self._buckets[k]

    async def aclose(self) -> None:
        self._buckets.clear()


# --- redis -----------------------------------------------------------------------------------

# KEYS: one hash per rule {v: level, t: seconds}; ARGV: rate, burst, cost per key. Redis TIME is
# the clock, so every gateway process agrees. Returns {allowed, wait, flags per rule ("0" fits,
# "1" short now, "2" deeper than the bucket: never fits), level after, ...} as strings (Lua
# numbers would be truncated to integers on the way out). A cost is taken whole or not at all.
_ACQUIRE = """
local function s(x) return string.format('%.17g', x) end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local n = #KEYS
local levels, needs = {}, {}
local wait = 0
local short = ''
for i = 1, n do
  local rate, burst = tonumber(ARGV[3*i-2]), tonumber(ARGV[3*i-1])
  local cost = math.max(0, tonumber(ARGV[3*i]))
  local b = redis.call('HMGET', KEYS[i], 'v', 't')
  local v = tonumber(b[1])
  if v == nil then
    v = burst
  else
    v = math.min(burst, v + math.max(0, now - tonumber(b[2])) * rate)
  end
  if cost > burst + 1e-9 then
    short = short .. '2'
  elseif v + 1e-9 < cost then
    wait = math.max(wait, (cost - v) / rate)
    short = short .. '1'
  else
    short = short .. '0'
  end
  levels[i], needs[i] = v, cost
end
local allowed = not string.find(short, '[12]')
local out = {allowed and '1' or '0', s(wait), short}
for i = 1, n do
  if allowed then
    local rate, burst = tonumber(ARGV[3*i-2]), tonumber(ARGV[3*i-1])
    levels[i] = levels[i] - needs[i]
    redis.call('HSET', KEYS[i], 'v', s(levels[i]), 't', s(now))
    redis.call('PEXPIRE', KEYS[i], math.ceil((burst - levels[i]) / rate * 1000) + 1000)
  end
  out[#out+1] = s(levels[i])
end
return out
"""

# KEYS[1]: one bucket; ARGV: rate, burst, delta (taken; negative gives back).
_ADJUST = """
local function s(x) return string.format('%.17g', x) end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate, burst, delta = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local b = redis.call('HMGET', KEYS[1], 'v', 't')
local v = tonumber(b[1])
if v == nil then
  v = burst
else
  v = math.min(burst, v + math.max(0, now - tonumber(b[2])) * rate)
end
v = math.min(burst, v - delta)
redis.call('HSET', KEYS[1], 'v', s(v), 't', s(now))
redis.call('PEXPIRE', KEYS[1], math.ceil((burst - v) / rate * 1000) + 1000)
return s(v)
"""


def _safe_url(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}:{parts.port or 6379}{parts.path}"


class RedisRateLimiter:
    """Buckets in Redis, shared by every gateway process; one script call (one round trip) each.

    Keys are `<namespace>:{<key>}:<rule>` hashes with a TTL of their refill time, so idle buckets
    vanish. When Redis is unreachable the limiter fails open: it allows, warns once per outage,
    skips Redis for `probe_s`, then probes again and recovers by itself. At most
    `max_connections` calls are in flight; the rest wait their turn in a gate (a queue, not an
    outage) and skip Redis at once if it went down meanwhile.
    """

    def __init__(
        self,
        url: str,
        namespace: str = "kvgw:rl",
        *,
        timeout_s: float = 0.25,
        probe_s: float = 1.0,
        max_connections: int = 32,
        clock: Clock = time.monotonic,
    ) -> None:
        self.namespace = namespace
        self._where = _safe_url(url)
        self._timeout_s = timeout_s
        self._probe_s = probe_s
        self._clock = clock
        pool = ConnectionPool.from_url(
            url,
            max_connections=max_connections,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
        self._redis = Redis.from_pool(pool)
        self._gate = asyncio.Semaphore(max_connections)
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._adjust = self._redis.register_script(_ADJUST)
        self._down = False
        self._next_probe = 0.0

    def bucket_key(self, key: str, rule: Rule) -> str:
        return f"{self.namespace}:{{{key}}}:{rule.name}"

    async def acquire(self, key: str, rules: Sequence[Rule], costs: Sequence[float]) -> Verdict:
        _check(rules, costs)
        if not rules:
            return Verdict(True, 0.0)
        args: list[float] = []
        for r, c in zip(rules, costs, strict=True):
            args += [r.rate_per_s, r.burst, c]
        keys = [self.bucket_key(key, r) for r in rules]
        reply = await self._call(self._acquire, keys, args)
        if reply is None:
            states = tuple(RuleState(r, r.burst, r.burst, 0.0) for r in rules)
            return Verdict(True, 0.0, states, degraded=True)
        levels = [float(x) for x in reply[3:]]
        states = tuple(_state(r, lv) for r, lv in zip(rules, levels, strict=True))
        flags = reply[2].decode()
        blocked = tuple(r.name for r, flag in zip(rules, flags, strict=True) if flag != "0")
        oversized = tuple(
            (r.name, max(0.0, float(c)))
            for r, c, flag in zip(rules, costs, flags, strict=True)
            if flag == "2"
        )
        return Verdict(reply[0] == b"1", float(reply[1]), states, blocked, oversized=oversized)

    async def adjust(self, key: str, rule: Rule, delta: float) -> None:
        await self._call(
            self._adjust, [self.bucket_key(key, rule)], [rule.rate_per_s, rule.burst, delta]
        )

    async def _call(self, script: object, keys: list[str], args: list[float]) -> list[bytes] | None:
        """The script's reply, or None when Redis is down (or was, and the probe is not due)."""
        async with self._gate:
            probing = self._down
            if probing:
                now = self._clock()
                if now < self._next_probe:
                    return None
                self._next_probe = now + self._probe_s  # one probe per interval, not per request
            try:
                async with asyncio.timeout(self._timeout_s * 4):  # connect + one retry, bounded
                    reply = await script(keys=keys, args=args)  # type: ignore[operator]
            except (RedisError, OSError, TimeoutError) as exc:
                if not self._down:
                    self._down = True
                    self._next_probe = self._clock() + self._probe_s
                    log.warning(
                        "rate limit Redis at %s unreachable (%s: %s); allowing requests "
                        "unlimited until it answers again",
                        self._where,
                        type(exc).__name__,
                        exc,
                    )
                return None
            if probing and self._down:
                self._down = False
                log.info("rate limit Redis at %s answers again; limits apply", self._where)
            return reply  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        await self._redis.aclose()
