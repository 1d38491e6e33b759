"""`python -m bench.routing_http`: every prompt shape (bench.shapes) through the real gateway over HTTP.

Per shape and policy: a fresh `python -m simulator` fleet (a subprocess), the gateway app in
front of it (this process), and the shape's exact client bodies replayed at their arrival times,
streamed, with `x-gateway-explain: 1`; the decision header gives the predicted hit and the
replica, the last chunk's usage the replica's actual hit. Then one burst: 20 requests at once on
a new 4K-token document, and how many replicas prefilled it. Times are simulated seconds (wall x
speedup).

    .venv/bin/python -m bench.routing_http                   # 8 shapes x 3 policies, ~7.5 min
    .venv/bin/python -m bench.routing_http --quick           # ~3 min
    .venv/bin/python -m bench.routing_http --shapes system multi_turn --policies ttft round_robin
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import orjson

from bench.access_log import access_lines
from bench.harness import serving
from bench.routing_workloads import ENGINE, TRACE_ENGINE, profile
from bench.shapes import SHAPES, ShapedRequest, to_sim_requests
from gateway import Config, create_app, parse_config
from simulator.config import build_config
from simulator.des import SimRequest
from simulator.fleet import simulated_fleet
from simulator.kv_cache import block_hashes
from simulator.stats import percentile
from simulator.workloads import text

DEFAULT = "ttft"
BASELINES = ("sglang_cache_aware", "round_robin")
REPLICAS = 4
SPEEDUP = 5.0  # one core runs the fleet, the other the gateway and this client
BURST = 20  # requests at once on one new document
BURST_DOC_TOKENS = 4096


@dataclass(frozen=True, slots=True)
class ShapeRun:
    """How one shape is sized for 4 replicas: its arrival rate, request counts, parameters."""

    rate: float
    requests: int
    quick: int
    params: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=lambda: ENGINE)
    chained: bool = False  # a group's next request waits for the previous answer (a chat)


# Rates: about half of bench.routing's for the same workload on 8 replicas (shared_prompts 12/s,
# rag 12/s, multi_turn 30/s, trace 5.9/s); with no cache, system/doc/agent prefill would need
# about the whole fleet's compute.
RUNS: dict[str, ShapeRun] = {
    "system": ShapeRun(6.0, 360, 120),
    "doc_question": ShapeRun(6.0, 360, 120),
    "text_parts": ShapeRun(6.0, 360, 120),
    "multi_turn": ShapeRun(14.0, 320, 120, chained=True),
    "agent": ShapeRun(8.0, 360, 120, chained=True),
    "completion_text": ShapeRun(6.0, 360, 120),
    "completion_ids": ShapeRun(6.0, 360, 120),
    # the trace's first records, arrivals rescaled to 3/s: its prompts (12K tokens on average,
    # up to 191K) on H200s with the context raised; the first 800 reach 135K
    "trace": ShapeRun(3.0, 800, 200, engine=TRACE_ENGINE),
}


# --- one request ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Record:
    """One answered request: what the gateway predicted and what the replica did."""

    group: str
    first: bool
    replica: int  # index of ranked[0] (the pick)
    reason: str
    ttft_s: float  # simulated seconds
    tpot_s: float | None
    prompt_tokens: int
    cached_tokens: int  # the replica's hit (usage.prompt_tokens_details.cached_tokens)
    # the gateway's route receipt (its request log, when it runs in this process), else
    # predicted_hit_blocks x tokens per block (the decision header)
    predicted_tokens: float
    request_id: str = ""


def _content(chunk: dict[str, Any], kind: str) -> bool:
    choices = chunk.get("choices") or ()
    if not choices:
        return False
    c = choices[0]
    got = (c.get("delta") or {}).get("content") if kind == "chat" else c.get("text")
    return bool(got)


async def send(
    session: aiohttp.ClientSession, gw: str, req: ShapedRequest, speedup: float, tpb: float,
    rid: str = "",
) -> Record | str:
    """Stream one request through the gateway (`rid`: its x-request-id); a Record, or why it
    failed."""
    path = "/v1/chat/completions" if req.kind == "chat" else "/v1/completions"
    headers = {"content-type": "application/json", "x-gateway-explain": "1"}
    if rid:
        headers["x-request-id"] = rid
    t0 = time.perf_counter()
    first = last = None
    usage: dict[str, Any] | None = None
    try:
        async with session.post(gw + path, data=req.raw, headers=headers) as res:
            if res.status != 200:
                return f"HTTP {res.status}: {(await res.read())[:200]!r}"
            decision = orjson.loads(res.headers.get("x-gateway-decision", "{}"))
            async for line in res.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = orjson.loads(line[6:])
                if _content(chunk, req.kind):
                    last = time.perf_counter() - t0
                    if first is None:
                        first = last
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (TimeoutError, aiohttp.ClientError) as exc:
        return f"{type(exc).__name__}: {exc}"
    if first is None or last is None or usage is None:
        return "no content or no usage in the stream"
    out = int(usage.get("completion_tokens", 0))
    ranked = decision.get("ranked") or ["r-1"]
    return Record(
        req.group,
        req.first,
        int(str(ranked[0])[1:]),
        str(decision.get("reason", "")),
        first * speedup,
        (last - first) / (out - 1) * speedup if out > 1 else None,
        int(usage["prompt_tokens"]),
        int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
        int(decision.get("predicted_hit_blocks", 0)) * tpb,
        rid,
    )


# --- one run: a fresh fleet and gateway ----------------------------------------------------------
def simulator_args(speedup: float, seed: int, engine: dict[str, Any]) -> list[str]:
    args = [
        "--speedup", str(speedup), "--seed", str(seed),
        "--model", engine["model"], "--gpu", engine["gpu"],
        "--gpu-memory-utilization", str(engine.get("gpu_memory_utilization", 0.9)),
    ]  # fmt: skip
    if engine.get("max_model_len"):
        args += ["--max-model-len", str(engine["max_model_len"])]
    return args


def gateway_config(urls: Sequence[str], policy: str, speedup: float, kv_tokens: int) -> Config:
    """The gateway for a run: replicas r0..rN, scraped every simulated second, decisions shown."""
    return parse_config(
        {
            "server": {"expose_upstream_errors": True},
            "pools": {
                "bench": {
                    "replicas": [{"url": u, "name": f"r{i}"} for i, u in enumerate(urls)],
                    "policy": policy,
                    "capacity_blocks": kv_tokens // 16,  # index blocks of ~16 tokens
                    "scrape": {"interval_s": 1.0 / speedup, "stale_after_s": 5.0 / speedup},
                }
            },
        }
    )


@dataclass(slots=True)
class Run:
    records: list[Record]
    errors: list[str]
    stats: list[dict[str, Any]]  # GET /sim/stats per replica, after the run
    wall_s: float


async def drive(
    urls: Sequence[str],
    policy: str,
    shaped: Sequence[ShapedRequest],
    *,
    speedup: float,
    kv_tokens: int,
    chained: bool = False,
    config: Config | None = None,
    stats_path: str | None = "/sim/stats",
) -> Run:
    """A fresh gateway in front of the replicas at `urls` (any simulated fleet, `speedup` its
    clock), and `shaped` replayed through it at the arrival times; `chained`: a request also
    waits for the answer to the previous one of its group (a client's next turn). `config`:
    the gateway's (default: `gateway_config`'s); `stats_path`: what each replica is asked for
    its own figures after the run (None: nothing)."""
    config = config or gateway_config(urls, policy, speedup, kv_tokens)
    chunking = config.index.chunking
    # the decision header's blocks in tokens: bytes mode estimates ~4 bytes a token
    tpb = chunking.block_size if chunking.mode == "tokens" else chunking.block_bytes / 4
    records: list[Record] = []
    errors: list[str] = []
    with access_lines() as lines:
        wall, stats = await _replay(config, urls, shaped, speedup, chained, stats_path, tpb,
                                    records, errors)  # fmt: skip
    # each answered request's route receipt from the gateway's own request log (the server
    # stopped after its last request: every line is in)
    receipts = {line["request_id"]: line.get("predicted_cached_tokens") for line in lines}
    records = [
        r if receipts.get(r.request_id) is None
        else replace(r, predicted_tokens=float(receipts[r.request_id]))
        for r in records
    ]  # fmt: skip
    return Run(records, errors, stats, wall)


async def _replay(
    config: Config, urls: Sequence[str], shaped: Sequence[ShapedRequest], speedup: float,
    chained: bool, stats_path: str | None, tpb: float, records: list[Record], errors: list[str],
) -> tuple[float, list[dict[str, Any]]]:  # fmt: skip
    async with (
        serving(create_app(config), lifespan="on") as gw,
        aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_read=120),
        ) as session,
    ):
        start = time.perf_counter()

        async def fire(
            req: ShapedRequest, after: asyncio.Event | None, mine: asyncio.Event
        ) -> None:
            try:
                delay = req.arrival_s / speedup - (time.perf_counter() - start)
                if delay > 0:
                    await asyncio.sleep(delay)
                if after is not None:
                    await after.wait()
                got = await send(session, gw.url, req, speedup, tpb, f"q{ids[id(req)]}")
                if isinstance(got, Record):
                    records.append(got)
                else:
                    errors.append(got)
            finally:
                mine.set()

        ids = {id(req): i for i, req in enumerate(shaped)}
        tasks = []
        last: dict[str, asyncio.Event] = {}
        for req in shaped:
            mine = asyncio.Event()
            tasks.append(fire(req, last.get(req.group) if chained else None, mine))
            last[req.group] = mine
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
        stats = []
        for u in urls if stats_path else ():
            async with session.get(u + stats_path) as res:
                stats.append(await res.json())
    return wall, stats


def kv_tokens(engine: dict[str, Any]) -> int:
    cfg = build_config(**engine)
    return cfg.num_blocks * cfg.block_size


async def replay(
    policy: str, shaped: Sequence[ShapedRequest], run: ShapeRun, replicas: int, speedup: float,
    seed: int,
) -> Run:  # fmt: skip
    """`shaped` through a fresh gateway and a fresh `python -m simulator` fleet."""
    async with simulated_fleet(replicas, *simulator_args(speedup, seed, run.engine)) as urls:
        return await drive(urls, policy, shaped, speedup=speedup,
                           kv_tokens=kv_tokens(run.engine), chained=run.chained)  # fmt: skip


def burst_requests(seed: int, model: str) -> list[ShapedRequest]:
    """20 requests at once on one new 4K-token document: one user message each, the document
    then a different question."""
    doc = text(f"burst-doc-{seed}", BURST_DOC_TOKENS)
    return [
        ShapedRequest(
            0.0,
            "chat",
            {
                "model": model,
                "messages": [{"role": "user", "content": f"{doc}\nQuestion {i}: why?"}],
                "max_tokens": 8,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            "burst",
            i == 0,
        )
        for i in range(BURST)
    ]


async def burst(policy: str, replicas: int, speedup: float, seed: int) -> list[int]:
    """The burst through a fresh fleet: the prompt tokens each replica computed (not hit)."""
    async with simulated_fleet(replicas, *simulator_args(speedup, seed, ENGINE)) as urls:
        got = await drive(urls, policy, burst_requests(seed, ENGINE["model"]),
                          speedup=speedup, kv_tokens=kv_tokens(ENGINE))  # fmt: skip
    if got.errors:
        raise RuntimeError(f"burst: {got.errors[:3]}")
    return [int(s["prompt_tokens"]) - int(s["prefix_hit_tokens"]) for s in got.stats]


# --- figures -------------------------------------------------------------------------------------
def summarize(run: Run, oracle: float, replicas: int) -> dict[str, float]:
    """The figures of one run (NaN where a figure has no sample)."""
    recs = run.records
    prompt = sum(r.prompt_tokens for r in recs)
    hit = sum(r.cached_tokens for r in recs)
    sim_prompt = sum(int(s["prompt_tokens"]) for s in run.stats)
    sim_hit = sum(int(s["prefix_hit_tokens"]) for s in run.stats)
    repeats = [r for r in recs if not r.first]
    err = [abs(r.predicted_tokens - r.cached_tokens) for r in repeats]
    pct = [abs(r.predicted_tokens - r.cached_tokens) / r.cached_tokens * 100.0
           for r in repeats if r.cached_tokens > 0]  # fmt: skip
    new = Counter(r.replica for r in recs if r.first)
    per_replica = [new.get(i, 0) for i in range(replicas)]
    ttft = [r.ttft_s for r in recs]
    tpot = [r.tpot_s for r in recs if r.tpot_s is not None]
    nan = math.nan
    return {
        "requests": len(recs) + len(run.errors),
        "errors": len(run.errors),
        "hit_ratio": hit / prompt if prompt else 0.0,
        "sim_hit_ratio": sim_hit / sim_prompt if sim_prompt else 0.0,
        "hit_vs_oracle": (hit / prompt / oracle) if prompt and oracle else nan,
        "repeats": len(repeats),
        "predicted_share": (
            sum(1 for r in repeats if r.predicted_tokens > 0) / len(repeats) if repeats else nan
        ),
        "new_groups": sum(per_replica),
        "new_replicas": sum(1 for c in per_replica if c),
        "new_spread": (
            max(per_replica) / (sum(per_replica) / replicas) if sum(per_replica) else nan
        ),
        "err_p50": statistics.median(err) if err else nan,
        "err_mean": statistics.fmean(err) if err else nan,
        "err_pct_p50": statistics.median(pct) if pct else nan,
        "err_pct_mean": statistics.fmean(pct) if pct else nan,
        "ttft_mean": statistics.fmean(ttft) if ttft else nan,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "tpot_p50": percentile(tpot, 50),
        "wall_s": run.wall_s,
    }


@dataclass(slots=True)
class ShapeResult:
    shape: str
    requests: int
    skipped: int  # records over the engine's max_model_len
    oracle: float
    lru: float  # one LRU cache the size of the fleet's KV: the bound once the oracle's set spills
    mean_prompt: float
    rows: dict[str, dict[str, float]] = field(default_factory=dict)  # policy -> figures
    runs: dict[str, Run] = field(default_factory=dict)


def _f(x: float, fmt: str) -> str:
    return "-" if isinstance(x, float) and math.isnan(x) else format(x, fmt)


def _ratio(rows: dict[str, dict[str, float]], policy: str, ref: str, key: str) -> str:
    if ref not in rows or policy == ref or not rows[ref][key]:
        return "-"
    return f"{rows[policy][key] / rows[ref][key]:.2f}x"


def tables(results: Sequence[ShapeResult], policies: Sequence[str], replicas: int) -> str:
    lines = [
        "| shape | policy | hit | sim hit | hit/oracle | repeats predicted | new groups on | "
        "new spread | \\|pred-act\\| p50 (tok) | mean (tok) | p50 % | mean % | TTFT mean (s) | "
        "TTFT p50 (s) | TTFT p99 (s) | TPOT p50 (ms) | errors |",
        "| --- | --- |" + " ---: |" * 15,
    ]
    for res in results:
        for policy in policies:
            s = res.rows.get(policy)
            if s is None:
                continue
            lines.append(
                f"| {res.shape} | {policy} | {s['hit_ratio']:.3f} | {s['sim_hit_ratio']:.3f} | "
                f"{_f(s['hit_vs_oracle'], '.2f')} | {_f(s['predicted_share'] * 100, '.0f')}% | "
                f"{int(s['new_replicas'])}/{replicas} ({int(s['new_groups'])}) | "
                f"{_f(s['new_spread'], '.2f')} | {_f(s['err_p50'], '.0f')} | "
                f"{_f(s['err_mean'], '.0f')} | {_f(s['err_pct_p50'], '.1f')} | "
                f"{_f(s['err_pct_mean'], '.1f')} | {s['ttft_mean']:.3f} | {s['ttft_p50']:.3f} | "
                f"{s['ttft_p99']:.3f} | {_f(s['tpot_p50'] * 1e3, '.0f')} | {int(s['errors'])} |"
            )
    lines += [
        "",
        "| shape | policy | TTFT mean vs sglang | TTFT p99 vs sglang | TTFT mean vs rr | "
        "TTFT p99 vs rr |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for res in results:
        for policy in policies:
            if policy not in res.rows or policy in BASELINES:
                continue
            cells = [
                _ratio(res.rows, policy, ref, key)
                for ref in BASELINES
                for key in ("ttft_mean", "ttft_p99")
            ]
            lines.append(f"| {res.shape} | {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


Verdict = tuple[bool, str] | None
GoalCheck = Callable[[dict[str, dict[str, float]], str], Verdict]


def _goal(key: str, least: float | None = None, most: float | None = None,
          fmt: str = ".2f") -> GoalCheck:  # fmt: skip
    def check(rows: dict[str, dict[str, float]], policy: str) -> Verdict:
        v = rows[policy][key]
        if math.isnan(v):
            return None
        ok = (least is None or v >= least) and (most is None or v <= most)
        return ok, format(v, fmt)

    return check


def _vs_sglang(key: str, factor: float, higher: bool = False) -> GoalCheck:
    def check(rows: dict[str, dict[str, float]], policy: str) -> Verdict:
        ref = rows.get("sglang_cache_aware")
        if ref is None or not ref[key] or policy == "sglang_cache_aware":
            return None
        r = rows[policy][key] / ref[key]
        return (r >= factor if higher else r <= factor), f"{r:.2f}x"

    return check


GOALS: tuple[tuple[str, GoalCheck], ...] = (
    ("predicted hit on >= 90% of repeats", _goal("predicted_share", least=0.9)),
    ("hit >= 0.85 x oracle", _goal("hit_vs_oracle", least=0.85)),
    ("new groups on >= 3 of 4 replicas", _goal("new_replicas", least=3, fmt=".0f")),
    ("median \\|pred-actual\\| <= 10% of actual", _goal("err_pct_p50", most=10.0, fmt=".1f")),
    ("TTFT mean <= 0.75 x sglang_cache_aware", _vs_sglang("ttft_mean", 0.75)),
    ("TTFT p99 <= 0.75 x sglang_cache_aware", _vs_sglang("ttft_p99", 0.75)),
    ("hit ratio >= sglang_cache_aware", _vs_sglang("hit_ratio", 1.0, higher=True)),
    ("no errors", _goal("errors", most=0, fmt=".0f")),
)


def goal_table(results: Sequence[ShapeResult], policy: str) -> str:
    shown = [r for r in results if policy in r.rows]
    lines = [
        f"| goal ({policy}) | " + " | ".join(r.shape for r in shown) + " |",
        "| --- |" + " --- |" * len(shown),
    ]
    for text_, check in GOALS:
        cells = []
        for r in shown:
            v = check(r.rows, policy)
            cells.append("n/a" if v is None else f"{'PASS' if v[0] else 'FAIL'} {v[1]}")
        lines.append(f"| {text_} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def lru_hit_ratio(requests: Sequence[SimRequest], capacity_tokens: int, block_size: int) -> float:
    """Hit ratio of one LRU prefix cache of `capacity_tokens` fed the requests in arrival order
    (a request hits its leading cached full blocks, never its last token, as the oracle)."""
    cache: OrderedDict[int, None] = OrderedDict()
    cap = capacity_tokens // block_size
    hit = prompt = 0
    for r in requests:
        hashes = block_hashes(r.prompt_tokens, block_size)
        limit = (len(r.prompt_tokens) - 1) // block_size
        k = 0
        while k < limit and hashes[k] in cache:
            k += 1
        hit += k * block_size
        prompt += len(r.prompt_tokens)
        for h in hashes:
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > cap:
            cache.popitem(last=False)
    return hit / prompt if prompt else 0.0


# --- the command ---------------------------------------------------------------------------------
def build(shape: str, n: int, seed: int) -> tuple[list[ShapedRequest], list[SimRequest], int]:
    """The shape's first n requests in the engine's model name, as sent and as the engine
    tokenizes them, less any at or over the engine's max_model_len (and how many those were)."""
    run = RUNS[shape]
    shaped = SHAPES[shape](n, run.rate, seed, run.engine["model"], **run.params)
    limit = build_config(**run.engine).max_model_len
    pairs = [
        (s, q)
        for s, q in zip(shaped, to_sim_requests(shaped), strict=True)
        if len(q.prompt_tokens) < limit
    ]
    return [s for s, _ in pairs], [q for _, q in pairs], len(shaped) - len(pairs)


async def bench(
    shapes: Sequence[str],
    policies: Sequence[str],
    n: int | None,
    quick: bool,
    replicas: int,
    speedup: float,
    seed: int,
) -> list[ShapeResult]:
    results = []
    for shape in shapes:
        run = RUNS[shape]
        size = n if n is not None else (run.quick if quick else run.requests)
        shaped, sims, skipped = build(shape, size, seed)
        block = build_config(**run.engine).block_size
        prof = profile(sims, block)
        lru = lru_hit_ratio(sims, replicas * kv_tokens(run.engine), block)
        res = ShapeResult(shape, len(shaped), skipped, prof.oracle_hit_ratio, lru,
                          prof.prompt_tokens / max(1, prof.requests))  # fmt: skip
        for policy in policies:
            got = await replay(policy, shaped, run, replicas, speedup, seed)
            res.runs[policy] = got
            res.rows[policy] = s = summarize(got, res.oracle, replicas)
            log(
                f"{shape:<16} {policy:<20} {got.wall_s:5.1f}s wall  hit {s['hit_ratio']:.3f} "
                f"(oracle {res.oracle:.3f})  TTFT mean {s['ttft_mean']:.3f} "
                f"p99 {s['ttft_p99']:.3f}  errors {int(s['errors'])}"
            )
            for e in got.errors[:3]:
                log(f"    error: {e}")
        results.append(res)
    return results


def reasons(results: Sequence[ShapeResult], policy: str) -> str:
    """Why a policy's repeat requests went where they did (x-gateway-decision reasons)."""
    lines = []
    for res in results:
        run = res.runs.get(policy)
        if run is None:
            continue
        c = Counter(r.reason for r in run.records if not r.first)
        missed = sum(1 for r in run.records if not r.first and r.predicted_tokens == 0)
        lines.append(
            f"- {res.shape}: repeats by reason "
            + ", ".join(f"{k} {v}" for k, v in c.most_common())
            + f"; with no predicted hit: {missed}"
        )
    return "\n".join(lines)


async def amain(args: argparse.Namespace) -> int:
    os.environ.setdefault("OTEL_TRACES_EXPORTER", "none")
    t = time.perf_counter()
    results = await bench(args.shapes, args.policies, args.requests, args.quick,
                          args.replicas, args.speedup, args.seed)  # fmt: skip
    bursts: dict[str, list[int]] = {}
    if not args.no_burst:
        for policy in args.policies:
            bursts[policy] = await burst(policy, args.replicas, args.speedup, args.seed)
            log(f"burst {policy:<20} computed tokens per replica {bursts[policy]}")
    print(
        f"Shapes over HTTP: python -m simulator ({args.replicas} replicas, speedup "
        f"{args.speedup:g}, seed {args.seed}) behind the gateway app; simulated seconds.\n"
    )
    print(
        "| shape | requests | skipped | mean prompt (tok) | oracle hit | fleet-LRU hit | "
        "KV/replica (tok) | engine |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for res in results:
        eng = RUNS[res.shape].engine
        print(
            f"| {res.shape} | {res.requests} | {res.skipped} | {res.mean_prompt:,.0f} | "
            f"{res.oracle:.3f} | {res.lru:.3f} | {kv_tokens(eng):,} | "
            f"{eng['model']} / {eng['gpu']} |"
        )
    print(
        "\noracle: one replica with an unlimited prefix cache; fleet-LRU: one LRU cache the "
        "size of the whole fleet's KV (no routing loss, but evictions); skipped: prompts over "
        "the engine's max_model_len."
    )
    print()
    print(tables(results, args.policies, args.replicas))
    default = args.policies[0]
    print(f"\nGoals for {default} (value: the figure, or the ratio to sglang_cache_aware):\n")
    print(goal_table(results, default))
    print(f"\n{default}: where repeats went (decision reasons):\n")
    print(reasons(results, default))
    if bursts:
        print(
            f"\nBurst: {BURST} requests at once sharing one new {BURST_DOC_TOKENS}-token "
            "document; replicas that prefilled it (computed >= 3000 tokens), goal <= 2:\n"
        )
        print("| policy | prefilled on | computed tokens per replica | goal |")
        print("| --- | ---: | --- | --- |")
        for policy, computed in bursts.items():
            k = sum(1 for c in computed if c >= 3000)
            print(
                f"| {policy} | {k} | {', '.join(f'{c:,}' for c in computed)} | "
                f"{'PASS' if k <= 2 else 'FAIL'} |"
            )
    log(f"done in {time.perf_counter() - t:.0f}s")
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.routing_http",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--shapes", nargs="+", default=list(RUNS), choices=list(RUNS), metavar="NAME",
                    help=f"shapes to run (default: all: {', '.join(RUNS)})")  # fmt: skip
    ap.add_argument("--policies", nargs="+", default=[DEFAULT, *BASELINES], metavar="NAME",
                    help="gateway policies, the first checked against the goals "
                    "(default: %(default)s)")  # fmt: skip
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per shape (default: each shape's own)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="fewer requests per shape")
    ap.add_argument("--replicas", type=int, default=REPLICAS)
    ap.add_argument("--speedup", type=float, default=SPEEDUP,
                    help="simulated seconds per wall second (default: %(default)s)")  # fmt: skip
    ap.add_argument("--no-burst", action="store_true", help="skip the burst check")
    ap.add_argument("--seed", type=int, default=0)
    return ap


# `python -m bench.routing --http --workload W`: the DES workload's shape
async def http_main(shapes: Sequence[str], args: argparse.Namespace) -> int:
    """`bench.routing --http`: these shapes, `--default` and the two baselines."""
    ns = parser().parse_args(["--shapes", *shapes, "--seed", str(args.seed)])
    ns.requests = args.requests
    ns.quick = args.quick
    ns.policies = [args.default, *BASELINES]
    return await amain(ns)


def main(argv: Sequence[str] | None = None) -> int:
    return asyncio.run(amain(parser().parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
