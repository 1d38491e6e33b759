"""Seeded chat workloads for the demo, the simulator's report and the benchmarks' prompt shapes.

Each generator returns chat requests with arrival times. Text is made of 4-byte word pieces, so one
piece is one token for the simulator's tokenizer and ~one token of English for a real one.
`bench.shapes` sends the same shapes as OpenAI bodies, `bench.routing_workloads` adds token-level
ones; both draw arrivals from `arrivals`.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator
from dataclasses import dataclass

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True, slots=True)
class WorkItem:
    arrival_s: float
    messages: tuple[dict[str, str], ...]
    max_tokens: int
    group: str = ""  # which shared prefix (system prompt, document, conversation) it belongs to
    session: str | None = None


_TABLE = bytes(_LETTERS.encode()[i % 26] for i in range(256))


@functools.lru_cache(maxsize=65536)
def text(key: str, tokens: int) -> str:
    """`tokens` deterministic 4-byte pieces (" abc"); the same key always gives the same text."""
    letters = random.Random(key).randbytes(3 * tokens).translate(_TABLE)
    out = bytearray(4 * tokens)
    out[0::4] = b" " * tokens
    out[1::4] = letters[0::3]
    out[2::4] = letters[1::3]
    out[3::4] = letters[2::3]
    return out.decode("ascii")


def arrivals(rng: random.Random, n: int, rate: float) -> Iterator[float]:
    """`n` Poisson arrival times (seconds) at `rate` per second, drawn from `rng` as they go."""
    t = 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        yield t


def _sys_user(system: str, user: str) -> tuple[dict[str, str], ...]:
    return ({"role": "system", "content": system}, {"role": "user", "content": user})


def shared_prompts(
    n: int = 1000,
    *,
    k: int = 8,
    rate: float = 10.0,
    prompt_tokens: tuple[int, int] = (1000, 6000),
    user_tokens: tuple[int, int] = (20, 120),
    max_tokens: int = 64,
    hot_weight: float = 1.0,
    seed: int = 0,
) -> list[WorkItem]:
    """(a) K shared system prompts of 1-6K tokens with short user turns; with `hot_weight` > 1,
    (f) prompt 0 gets that many times the traffic of each other prompt (a hot prefix)."""
    rng = random.Random(seed)
    lengths = [rng.randint(*prompt_tokens) for _ in range(k)]
    weights = [hot_weight] + [1.0] * (k - 1)
    out = []
    for i, t in enumerate(arrivals(rng, n, rate)):
        g = rng.choices(range(k), weights)[0]
        system = text(f"sys-{seed}-{g}", lengths[g])
        user = text(f"user-{seed}-{i}", rng.randint(*user_tokens))
        out.append(WorkItem(t, _sys_user(system, user), max_tokens, group=f"sys{g}"))
    return out


def multi_turn(
    n_conversations: int = 100,
    *,
    turns: int = 8,
    rate: float = 2.0,
    system_tokens: int = 500,
    user_tokens: tuple[int, int] = (50, 200),
    reply_tokens: int = 100,
    think_s: tuple[float, float] = (2.0, 10.0),
    systems: int = 4,
    seed: int = 0,
) -> list[WorkItem]:
    """(b) Multi-turn chats: each turn resends the whole history plus a new user message.
    Conversations start at `rate` per second and share `systems` system prompts; the turns of
    one share their history's message dicts (do not change them)."""
    rng = random.Random(seed)
    out = []
    for c, start in enumerate(arrivals(rng, n_conversations, rate)):
        history: list[dict[str, str]] = [
            {"role": "system", "content": text(f"mt-sys-{seed}-{c % systems}", system_tokens)}
        ]
        t = start
        for turn in range(turns):
            history.append(
                {
                    "role": "user",
                    "content": text(f"mt-u-{seed}-{c}-{turn}", rng.randint(*user_tokens)),
                }
            )
            out.append(
                WorkItem(t, tuple(history), reply_tokens, group=f"conv{c}", session=f"conv{c}")
            )
            history.append(
                {"role": "assistant", "content": text(f"mt-a-{seed}-{c}-{turn}", reply_tokens)}
            )
            t += rng.uniform(*think_s)
    out.sort(key=lambda w: w.arrival_s)
    return out
