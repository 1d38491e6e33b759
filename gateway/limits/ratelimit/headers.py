"""A verdict as the client sees it: OpenAI's `x-ratelimit-*` headers and the refusal's error."""

from __future__ import annotations

import math

from gateway.errors import RateLimited, RequestExceedsLimit
from gateway.limits.ratelimit.base import Verdict


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
    choices: int = 1,
) -> RateLimited:
    """The error for a refused verdict, carrying the header set (Retry-After included).

    A cost that can never fit gets `RequestExceedsLimit`, naming the limit and the numbers (the
    prompt estimate, the choices and max_tokens, when given), with no Retry-After.
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
            each = f"{choices} choices of " if choices > 1 else ""
            parts = f" (prompt ~{prompt_tokens} + {each}max_tokens {max_tokens or 0})"
        return RequestExceedsLimit(
            f"Request too large for tenant '{tenant}': {asked}{parts}. It can never fit, so "
            f"retrying will not help: lower {'n, ' if choices > 1 else ''}max_tokens or "
            "shorten the prompt",
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
