"""Token-level workloads for the routing benchmark, the public-trace replayer, and the oracle bound.

Prompts are token ids made directly (the no-sharing control and the trace), so a DES run of
thousands of multi-KB prompts spends no time on text; every other shape is the OpenAI bodies of
`bench.shapes`. `profile` is the oracle bound of any request sequence.
"""

from __future__ import annotations

import functools
import json
import os
import random
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from simulator.des import SimRequest
from simulator.kv_cache import block_hashes
from simulator.workloads import arrivals

# the public trace lives beside the checkout (shared/traces/); KVGW_TRACE points elsewhere
TRACE = Path(
    os.environ.get("KVGW_TRACE")
    or Path(__file__).resolve().parents[2] / "shared" / "traces" / "synthetic_trace.jsonl"
)
TRACE_BLOCK_TOKENS = 512  # one Mooncake hash id stands for 512 tokens

# Token ids live in array("q"): 8 bytes each, the layout the simulator hashes without converting
# (5x faster than a list), and a quarter of the memory of a list of ints.
Tokens = array


# qwen2.5-14b on one A100-80G at gpu_memory_utilization 0.52: 64,108 tokens of KV per replica
# (`gateway plan`; 512,864 for the fleet): below the shared-prompt and multi-turn working sets,
# which fit the fleet; the same setting `gateway demo` uses.
ENGINE: dict[str, Any] = {"model": "qwen2.5-14b", "gpu": "a100-80g", "gpu_memory_utilization": 0.52}
# The trace's longest prompt is 191,378 tokens: H200s (464,672 tokens of KV each), context raised.
TRACE_ENGINE: dict[str, Any] = {"model": "qwen2.5-14b", "gpu": "h200", "max_model_len": 196_608}
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


def _req(i: int, t: float, tokens: Tokens, max_tokens: int, group: str) -> SimRequest:
    return SimRequest(f"q{i}", t, tokens, max_tokens, meta={"group": group, "session": None})


# --- the generators: (n, rate, seed, **params) -> requests in arrival order ---------------------
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
        for i, t in enumerate(arrivals(rng, n, rate))
    ]


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
