"""Token-bucket rate limits per tenant: an in-process backend and a Redis one shared by many gateways.

One `acquire` checks every rule of a key at once and takes from all buckets or from none. A cost
deeper than its bucket can never fit: it is refused at once (no Retry-After), never clamped, so
what a refund gives back is never more than what was taken.

`base` holds the interface (rules, verdicts, `RateLimiter`); `memory` and `redis` one backend each;
`headers` what a verdict looks like to the client.
"""

from __future__ import annotations

from gateway.limits.ratelimit.base import (
    Clock,
    RateLimitConfig,
    RateLimiter,
    Rule,
    RuleState,
    Unit,
    Verdict,
    costs_for,
)
from gateway.limits.ratelimit.headers import format_reset, headers, rate_limited
from gateway.limits.ratelimit.memory import MemoryRateLimiter
from gateway.limits.ratelimit.redis import RedisRateLimiter

__all__ = [
    "Clock",
    "MemoryRateLimiter",
    "RateLimitConfig",
    "RateLimiter",
    "RedisRateLimiter",
    "Rule",
    "RuleState",
    "Unit",
    "Verdict",
    "costs_for",
    "format_reset",
    "headers",
    "open_rate_limiter",
    "rate_limited",
]


def open_rate_limiter(backend: str, redis_url: str | None = None) -> RateLimiter:
    if backend == "memory":
        return MemoryRateLimiter()
    if backend == "redis":
        return RedisRateLimiter(redis_url or "redis://127.0.0.1:6379/0")
    raise ValueError(f"unknown rate limit backend {backend!r} (known: memory, redis)")
