"""The limiter's interface: rules, verdicts, the `RateLimiter` protocol every backend implements."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict

Unit = Literal["requests", "tokens"]
Clock = Callable[[], float]

EPS = 1e-9  # float slack so an exactly refilled bucket counts as holding the token


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


def costs_for(
    rules: Sequence[Rule],
    prompt_tokens: int,
    max_tokens: int | None,
    unset: int = 0,
    choices: int = 1,
) -> list[float]:
    """Requests cost 1; tokens cost the prompt estimate plus `choices` answers of max_tokens
    (`n`, or `best_of`, per prompt: each choice is generated, and counted in the usage).

    Without max_tokens, each answer is charged `unset` (the caller's bound on it: the engine's
    context less the prompt, or the pool's default), but the whole charge never goes past a
    bucket's depth: such a request fits a full bucket, so it is refused only until the bucket
    refills (with a Retry-After), never as one that can never fit (its prompt alone still can
    be). The answer's usage settles the charge either way.
    """
    answers = max(1, choices)
    if max_tokens is not None or not unset:
        tokens = float(prompt_tokens + answers * (max_tokens or 0))
        return [1.0 if r.unit == "requests" else tokens for r in rules]
    out = []
    for r in rules:
        room = max(0, int(r.burst) - prompt_tokens)
        out.append(1.0 if r.unit == "requests" else float(prompt_tokens + min(answers * unset, room)))
    return out


def rule_state(rule: Rule, level: float) -> RuleState:
    """What the headers report of a bucket at `level`."""
    return RuleState(
        rule, rule.burst, max(0.0, level), max(0.0, (rule.burst - level) / rule.rate_per_s)
    )


def check_costs(rules: Sequence[Rule], costs: Sequence[float]) -> None:
    if len(rules) != len(costs):
        raise ValueError(f"{len(rules)} rules but {len(costs)} costs")
