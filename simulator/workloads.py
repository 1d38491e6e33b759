"""Seeded, documented request workloads for the routing benchmark and the demo.

Each generator returns chat requests with arrival times. Text is made of 4-byte word pieces, so one
piece is one token for the simulator's tokenizer and ~one token of English for a real one.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def _arrivals(rng: random.Random, n: int, rate: float) -> Iterator[float]:
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
    for i, t in enumerate(_arrivals(rng, n, rate)):
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
    seed: int = 0,
) -> list[WorkItem]:
    """(b) Multi-turn chats: each turn resends the whole history plus a new user message."""
    rng = random.Random(seed)
    out = []
    for c, start in enumerate(_arrivals(rng, n_conversations, rate)):
        history: list[dict[str, str]] = [
            {"role": "system", "content": text(f"mt-sys-{seed}-{c % 4}", system_tokens)}
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


def rag(
    n: int = 1000,
    *,
    docs: int = 200,
    rate: float = 10.0,
    doc_tokens: tuple[int, int] = (2000, 4000),
    zipf_s: float = 1.1,
    question_tokens: tuple[int, int] = (20, 80),
    max_tokens: int = 64,
    seed: int = 0,
) -> list[WorkItem]:
    """(c) RAG: a Zipf-popular set of long documents, each request one document plus a question."""
    rng = random.Random(seed)
    lengths = [rng.randint(*doc_tokens) for _ in range(docs)]
    weights = [1.0 / (r + 1) ** zipf_s for r in range(docs)]
    instruction = "Answer the question from the document."
    out = []
    for i, t in enumerate(_arrivals(rng, n, rate)):
        d = rng.choices(range(docs), weights)[0]
        doc = text(f"doc-{seed}-{d}", lengths[d])
        q = text(f"q-{seed}-{i}", rng.randint(*question_tokens))
        out.append(
            WorkItem(
                t, _sys_user(instruction, doc + "\n\nQuestion:" + q), max_tokens, group=f"doc{d}"
            )
        )
    return out


def no_sharing(
    n: int = 1000,
    *,
    rate: float = 10.0,
    prompt_tokens: tuple[int, int] = (500, 3000),
    max_tokens: int = 64,
    seed: int = 0,
) -> list[WorkItem]:
    """(d) The control: every prompt unique from its first token."""
    rng = random.Random(seed)
    return [
        WorkItem(
            t,
            ({"role": "user", "content": text(f"ns-{seed}-{i}", rng.randint(*prompt_tokens))},),
            max_tokens,
        )
        for i, t in enumerate(_arrivals(rng, n, rate))
    ]


def mixed_long(
    n: int = 1000,
    *,
    long_share: float = 0.1,
    rate: float = 10.0,
    long_tokens: tuple[int, int] = (8192, 16000),
    seed: int = 0,
    **short: Any,
) -> list[WorkItem]:
    """(e) Shared-prompt traffic with a share of 8K+ token prompts mixed in."""
    rng = random.Random(seed + 1)
    base = shared_prompts(n, rate=rate, seed=seed, **short)
    out = []
    for i, w in enumerate(base):
        if rng.random() < long_share:
            body = text(f"long-{seed}-{i}", rng.randint(*long_tokens))
            w = WorkItem(
                w.arrival_s, ({"role": "user", "content": body},), w.max_tokens, group="long"
            )
        out.append(w)
    return out


def trace(
    path: str | Path,
    *,
    limit: int | None = None,
    block_tokens: int = 512,
    time_scale: float = 1.0,
    max_output: int | None = None,
) -> list[WorkItem]:
    """Replay a JSONL trace of {timestamp (ms), input_length, output_length, hash_ids}.

    Each hash id stands for `block_tokens` tokens of deterministic text, so equal ids give equal
    prefixes; the last block is cut to make the prompt `input_length` tokens long.
    """
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                break
            rec = json.loads(line)
            ids = rec["hash_ids"]
            tail = rec["input_length"] - block_tokens * (len(ids) - 1)
            parts = [text(f"trace-{h}", block_tokens) for h in ids[:-1]]
            parts.append(text(f"trace-{ids[-1]}", block_tokens)[: 4 * max(tail, 1)])
            out_len = max(1, rec["output_length"])
            if max_output is not None:
                out_len = min(out_len, max_output)
            out.append(
                WorkItem(
                    rec["timestamp"] / 1000.0 * time_scale,
                    ({"role": "user", "content": "".join(parts)},),
                    out_len,
                    group=f"h{ids[0]}",
                )
            )
    return out


WORKLOADS = {
    "shared_prompts": shared_prompts,
    "multi_turn": multi_turn,
    "rag": rag,
    "no_sharing": no_sharing,
    "mixed_long": mixed_long,
    "hot_prefix": functools.partial(shared_prompts, hot_weight=10.0),
}
