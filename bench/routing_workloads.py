"""Token-level workloads for the routing benchmark, the public-trace replayer, and the oracle bound.

Same shapes as `simulator.workloads` (which builds chat text for the HTTP path), but prompts are
token ids made directly, so a DES run of thousands of multi-KB prompts spends no time on text.
"""

from __future__ import annotations

import functools
import json
import os
import random
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from simulator.des import SimRequest
from simulator.kv_cache import block_hashes

# the public trace lives beside the checkout (shared/traces/); KVGW_TRACE points elsewhere
TRACE = Path(
    os.environ.get("KVGW_TRACE")
    or Path(__file__).resolve().parents[2] / "shared" / "traces" / "synthetic_trace.jsonl"
)
TRACE_BLOCK_TOKENS = 512  # one Mooncake hash id stands for 512 tokens

# Token ids live in array("q"): 8 bytes each, the layout the simulator hashes without converting
# (5x faster than a list), and a quarter of the memory of a list of ints.
Tokens = array


VOCAB = 131_072  # token ids stay below a real vocabulary's size (the gateway checks their range)


@functools.lru_cache(maxsize=1 << 16)
def segment(key: str, n: int) -> Tokens:
    """`n` deterministic token ids in [0, VOCAB); the same key always gives the same ids."""
    ids = array("I")
    ids.frombytes(random.Random(key).randbytes(4 * n))
    return array("q", [i & (VOCAB - 1) for i in ids])


def _join(parts: Sequence[Tokens]) -> Tokens:
    out = array("q")
    for p in parts:
        out.extend(p)
    return out


def _arrivals(rng: random.Random, n: int, rate: float) -> Iterator[float]:
    t = 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        yield t


def _req(
    i: int, t: float, tokens: Tokens, max_tokens: int, group: str, session: str | None = None
) -> SimRequest:
    return SimRequest(f"q{i}", t, tokens, max_tokens, meta={"group": group, "session": session})


# --- the generators: (n, rate, seed, **params) -> requests in arrival order ---------------------
def shared_prompts(
    n: int,
    rate: float,
    seed: int,
    *,
    k: int = 24,
    prompt_tokens: tuple[int, int] = (1000, 6000),
    user_tokens: tuple[int, int] = (20, 120),
    max_tokens: int = 64,
    hot_weight: float = 1.0,
) -> list[SimRequest]:
    """(a) K system prompts of 1-6K tokens and a short unique user turn; (f) with hot_weight > 1
    prompt 0 gets that many times the traffic of each other prompt."""
    rng = random.Random(seed)
    lengths = [rng.randint(*prompt_tokens) for _ in range(k)]
    weights = [hot_weight] + [1.0] * (k - 1)
    out = []
    for i, t in enumerate(_arrivals(rng, n, rate)):
        g = rng.choices(range(k), weights)[0]
        user = segment(f"user-{seed}-{i}", rng.randint(*user_tokens))
        out.append(
            _req(i, t, _join([segment(f"sys-{seed}-{g}", lengths[g]), user]), max_tokens, f"sys{g}")
        )
    return out


def multi_turn(
    n: int,
    rate: float,
    seed: int,
    *,
    turns: int = 8,
    system_tokens: int = 500,
    systems: int = 4,
    user_tokens: tuple[int, int] = (50, 200),
    reply_tokens: int = 100,
    think_s: tuple[float, float] = (2.0, 10.0),
) -> list[SimRequest]:
    """(b) Chats whose history grows turn by turn: each turn resends the whole history plus a new
    user message. `rate` is requests/s in steady state (conversations start at rate / turns)."""
    rng = random.Random(seed)
    items: list[tuple[float, Tokens, str]] = []
    for c, start in enumerate(_arrivals(rng, max(1, n // turns), rate / turns)):
        history = [segment(f"mt-sys-{seed}-{c % systems}", system_tokens)]
        t = start
        for turn in range(turns):
            history.append(segment(f"mt-u-{seed}-{c}-{turn}", rng.randint(*user_tokens)))
            items.append((t, _join(history), f"conv{c}"))
            history.append(segment(f"mt-a-{seed}-{c}-{turn}", reply_tokens))
            t += rng.uniform(*think_s)
    items.sort(key=lambda x: x[0])
    return [_req(i, t, tok, reply_tokens, g, session=g) for i, (t, tok, g) in enumerate(items)]


def rag(
    n: int,
    rate: float,
    seed: int,
    *,
    docs: int = 200,
    doc_tokens: tuple[int, int] = (2000, 4000),
    zipf_s: float = 1.1,
    question_tokens: tuple[int, int] = (20, 80),
    max_tokens: int = 64,
) -> list[SimRequest]:
    """(c) RAG: one of `docs` long documents, drawn Zipf(s) by popularity, then a question."""
    rng = random.Random(seed)
    lengths = [rng.randint(*doc_tokens) for _ in range(docs)]
    weights = [1.0 / (r + 1) ** zipf_s for r in range(docs)]
    head = segment(f"rag-instr-{seed}", 16)
    out = []
    for i, t in enumerate(_arrivals(rng, n, rate)):
        d = rng.choices(range(docs), weights)[0]
        q = segment(f"q-{seed}-{i}", rng.randint(*question_tokens))
        out.append(
            _req(
                i,
                t,
                _join([head, segment(f"doc-{seed}-{d}", lengths[d]), q]),
                max_tokens,
                f"doc{d}",
            )
        )
    return out


def no_sharing(
    n: int,
    rate: float,
    seed: int,
    *,
    prompt_tokens: tuple[int, int] = (500, 3000),
    max_tokens: int = 64,
) -> list[SimRequest]:
    """(d) The control: every prompt unique from its first token."""
    rng = random.Random(seed)
    return [
        _req(i, t, segment(f"ns-{seed}-{i}", rng.randint(*prompt_tokens)), max_tokens, "")
        for i, t in enumerate(_arrivals(rng, n, rate))
    ]


def mixed_long(
    n: int,
    rate: float,
    seed: int,
    *,
    long_share: float = 0.1,
    long_tokens: tuple[int, int] = (8192, 16000),
    **short: Any,
) -> list[SimRequest]:
    """(e) Shared-prompt traffic (a) with a share of unique 8K+ token prompts mixed in."""
    rng = random.Random(seed + 1)
    out = []
    for r in shared_prompts(n, rate, seed, **short):
        if rng.random() < long_share:
            r = _req(
                int(r.id[1:]),
                r.arrival_s,
                segment(f"long-{seed}-{r.id}", rng.randint(*long_tokens)),
                r.max_tokens,
                "long",
            )
        out.append(r)
    return out


def trace(
    n: int,
    rate: float,
    seed: int,
    *,
    path: Path = TRACE,
    block_tokens: int = TRACE_BLOCK_TOKENS,
    max_output: int | None = None,
) -> list[SimRequest]:
    """(g) Replay a JSONL trace of {timestamp ms, input_length, output_length, hash_ids}.

    Each hash id becomes `block_tokens` deterministic token ids (equal ids, equal prefixes); the
    last block is cut so the prompt is `input_length` tokens. Timestamps are rescaled so the
    mean arrival rate is `rate` (0: as recorded). `seed` is unused: the trace is the trace.
    """
    out = []
    for i, (t, rec, out_len) in enumerate(trace_arrivals(n, rate, path, max_output)):
        ids = rec["hash_ids"]
        tail = rec["input_length"] - block_tokens * (len(ids) - 1)
        parts = [segment(f"trace-{h}", block_tokens) for h in ids[:-1]]
        parts.append(segment(f"trace-{ids[-1]}", block_tokens)[: max(tail, 1)])
        out.append(_req(i, t, _join(parts), out_len, f"h{ids[0]}"))
    return out


def trace_arrivals(
    n: int, rate: float, path: Path = TRACE, max_output: int | None = None
) -> list[tuple[float, dict[str, Any], int]]:
    """The trace's first `n` records as (arrival s, record, output tokens): timestamps rescaled
    so the mean arrival rate is `rate` (0: as recorded), outputs at least 1 and capped at
    `max_output`. Both trace replayers (token ids here, one user message in bench/shapes.py)."""
    recs = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            recs.append(json.loads(line))
            if len(recs) >= n:
                break
    span = (recs[-1]["timestamp"] - recs[0]["timestamp"]) / 1000.0
    scale = (len(recs) - 1) / span / rate if rate > 0 and span > 0 else 1.0
    t0 = recs[0]["timestamp"]
    cap = max_output if max_output is not None else 1 << 62
    return [
        ((r["timestamp"] - t0) / 1000.0 * scale, r, min(max(1, r["output_length"]), cap))
        for r in recs
    ]


def trace_records(path: Path = TRACE) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for _ in f)


# --- what a workload offers, router-independent --------------------------------------------------
@dataclass(slots=True)
class Profile:
    """Facts of a request sequence at the engine's block size, with no routing in them."""

    requests: int
    prompt_tokens: int
    output_tokens: int
    oracle_hit_tokens: int  # one replica with an unlimited prefix cache
    peak_live_tokens: int  # most reusable prefix tokens alive at once (seen, and seen again later)
    duration_s: float
    rate: float  # arrivals/s between the 25th and 75th percentile arrival: the steady state
    max_prompt: int

    @property
    def oracle_hit_ratio(self) -> float:
        return self.oracle_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def profile(requests: Sequence[SimRequest], block_size: int) -> Profile:
    """The oracle bound and the live working set.

    Oracle: requests in arrival order on one replica whose cache never evicts; a request hits
    the longest prefix of full blocks any earlier prompt had, never its last token (as vLLM).
    Live working set: a block is live from its first use to its last; the peak number of live
    blocks is the cache that placement must hold to keep every reuse.
    """
    seen: set[int] = set()
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    hit = prompt = out = 0
    for r in requests:
        toks = r.prompt_tokens
        hashes = block_hashes(toks, block_size)
        limit = (len(toks) - 1) // block_size
        k = 0
        while k < limit and hashes[k] in seen:
            k += 1
        hit += k * block_size
        prompt += len(toks)
        out += r.max_tokens
        t = r.arrival_s
        for h in hashes:
            if h not in seen:
                seen.add(h)
                first[h] = t
            last[h] = t
    events: list[tuple[float, int]] = []
    for h, t0 in first.items():
        t1 = last[h]
        if t1 > t0:
            events.append((t0, 1))
            events.append((t1, -1))
    events.sort()
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    n = len(requests)
    span = requests[-1].arrival_s - requests[0].arrival_s if requests else 0.0
    lo, hi = n // 4, 3 * n // 4
    mid = requests[hi].arrival_s - requests[lo].arrival_s if n >= 4 else 0.0
    return Profile(
        n,
        prompt,
        out,
        hit,
        peak * block_size,
        span,
        (hi - lo) / mid if mid > 0 else (n / span if span > 0 else 0.0),
        max((len(r.prompt_tokens) for r in requests), default=0),
    )


# --- the named workloads -------------------------------------------------------------------------
Generator = Callable[..., list[SimRequest]]


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """A generator, its parameters, the arrival rate, and the engine it runs on."""

    name: str
    title: str
    generate: Generator
    rate: float  # requests/s
    requests: int  # default size of a full run
    params: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)  # Cluster(**engine)
    hot_group: str | None = None  # a group whose spread over replicas the report shows

    def build(self, n: int, seed: int) -> list[SimRequest]:
        return self.generate(n, self.rate, seed, **self.params)
