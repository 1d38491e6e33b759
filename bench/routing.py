"""Routing benchmark: every policy on seeded workloads in the discrete-event simulator, one table.

Every workload is the OpenAI bodies clients send, one prompt shape each (bench/shapes.py); the
gateway's own routing unit routes them inside the DES (bench/routing_routers.py: DesRouter, the
bodies parsed by the gateway's parser) in front of 8 simulated replicas; the goals are checked
per policy and the default is picked from them. docs/routing-benchmark.md has the workloads.

    .venv/bin/python -m bench.routing                      # everything, ~5 min
    .venv/bin/python -m bench.routing --quick              # small runs, ~30 s
    .venv/bin/python -m bench.routing --workload multi_turn --policies round_robin ttft
    .venv/bin/python -m bench.routing --http               # the real gateway over HTTP, per shape
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench import routing_workloads as wl
from bench import shapes
from bench.routing_routers import CANDIDATES, DEFAULT_ROUTERS, GATEWAY_DEFAULT, ROUTERS
from bench.routing_workloads import ENGINE, TRACE_ENGINE
from simulator.config import build_config
from simulator.des import Cluster, SimRequest, run
from simulator.stats import percentile

N_REPLICAS = 8
SCRAPE_S = 1.0  # the gateway's default scrape interval (gateway.config.ScrapeConfig)



def _shaped(name: str) -> wl.Generator:
    """A `bench.shapes` generator as a WorkloadSpec generator: the clients' bodies, rendered and
    tokenized by the engine's side (`to_sim_requests`); the router reads only the bodies."""
    gen = shapes.SHAPES[name]

    def build(n: int, rate: float, seed: int, **params: Any) -> list[SimRequest]:
        return shapes.to_sim_requests(gen(n, rate, seed, **params))

    build.__name__ = name
    return build


def _spec(name: str, title: str, rate: float, requests: int = 3000, **kw: Any) -> wl.WorkloadSpec:
    engine = kw.pop("engine", ENGINE)
    generate = kw.pop("generate", None) or _shaped(kw.pop("shape", name))
    return wl.WorkloadSpec(name, title, generate, rate, requests, engine=engine, **kw)


# Every workload is the OpenAI bodies clients send, one prompt shape each (bench/shapes.py).
SHAPE_WORKLOADS = (
    "system", "doc_question", "text_parts", "multi_turn", "agent", "completion_text",
    "completion_ids", "trace",
)  # fmt: skip
WORKLOADS: dict[str, wl.WorkloadSpec] = {
    s.name: s
    for s in (
        _spec("system", "(a) 24 system messages of 1-6K tokens, user question 20-120, 64 out", 12.0),
        _spec("doc_question", "(c) ONE user message = one of 200 documents of 2-4K tokens "
              "(Zipf 1.1) + a question of 20-80", 12.0),
        _spec("text_parts", "(c') as doc_question, the content as two text parts", 12.0),
        _spec("multi_turn", "(b) 8-turn chats, history resent each turn (4 system prompts of "
              "500, user 50-200, replies 100, think 2-10 s)", 30.0),
        _spec("agent", "agent transcripts: system 800, task, then tool calls and tool results "
              "of 200-800 tokens, 6 turns", 20.0),
        _spec("completion_text", "/v1/completions: 24 shared string prefixes of 1-6K tokens + "
              "a unique suffix", 12.0),
        _spec("completion_ids", "/v1/completions with token ids: 24 shared prefixes of 1-6K "
              "+ a unique tail", 12.0),
        _spec("hot_prefix", "(f) 16 system messages, message 0 10x the traffic of each other "
              "(40%), user turns 500-1500, 64 out", 14.0, shape="system",
              params={"k": 16, "hot_weight": 10.0, "user_tokens": (500, 1500)}, hot_group="sys0"),
        _spec("no_sharing", "(d) control: unique prompts of 500-3000 tokens (completions, "
              "token ids), 64 out", 18.0, generate=wl.no_sharing),
        _spec("trace", "(g) Mooncake FAST'25 trace, each record ONE user message (512 tokens "
              "per hash id), arrivals 1.5x faster than recorded", 5.9, 3993, engine=TRACE_ENGINE),
    )
}  # fmt: skip
QUICK_REQUESTS = 500


# --- one run -------------------------------------------------------------------------------------
@dataclass(slots=True)
class Row:
    workload: str
    router: str
    s: dict[str, float]
    busy: float  # mean share of the makespan the replicas spent in steps
    overflow: int  # requests the gateway would have held in admission (all replicas saturated)
    cpu_s: float
    hot: tuple[int, int] = (0, 0)  # the hot group's requests on its busiest replica, and in all
    pred: dict[str, float] | None = None  # the gateway's predicted vs the engines' cached tokens


@dataclass(slots=True)
class Prepared:
    spec: wl.WorkloadSpec
    requests: list[SimRequest]
    prof: wl.Profile
    kv_tokens: int  # per replica
    rho0: float  # no-cache prefill demand / fleet prefill compute
    rho_star: float  # the oracle's misses / fleet prefill compute
    rows: dict[str, Row] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.name


def prepare(spec: wl.WorkloadSpec, n: int, seed: int) -> Prepared:
    requests = spec.build(n, seed)
    cfg = build_config(**spec.engine)
    prof = wl.profile(requests, cfg.block_size)
    per_token = cfg.perf.prefill_s_per_token
    rho0 = prof.rate * prof.prompt_tokens / prof.requests * per_token / N_REPLICAS
    rho_star = rho0 * (1.0 - prof.oracle_hit_ratio)
    return Prepared(spec, requests, prof, cfg.num_blocks * cfg.block_size, rho0, rho_star)


async def run_one(p: Prepared, router_name: str, seed: int) -> Row:
    cluster = Cluster(N_REPLICAS, seed=seed, **p.spec.engine)
    router = ROUTERS[router_name].build(cluster, seed)
    cpu = time.process_time()
    result = await run(p.requests, cluster, router, scrape_interval_s=SCRAPE_S)
    cpu = time.process_time() - cpu
    s = result.summary()
    s["ttft_mean"] = sum(r.ttft_s for r in result.records) / max(1, len(result.records))
    busy = sum(result.busy_s) / len(result.busy_s) / s["makespan_s"] if s["makespan_s"] else 0.0
    hot = (0, 0)
    if p.spec.hot_group is not None:
        where = Counter(
            rec.replica
            for rec, req in zip(result.records, p.requests, strict=True)
            if req.meta.get("group") == p.spec.hot_group
        )
        hot = (max(where.values(), default=0), sum(where.values()))
    predicted = getattr(router, "predicted", None)
    pred = prediction(p.requests, result.records, predicted) if predicted is not None else None
    return Row(p.name, router_name, s, busy, getattr(router, "overflow", 0), cpu, hot, pred)


def prediction(
    requests: Sequence[SimRequest], records: Sequence[Any], predicted: dict[str, int]
) -> dict[str, float] | None:
    """Per request, the gateway's predicted cached tokens against what the engine had cached.

    repeats: requests after the first of their group; predicted: share of repeats with a
    predicted hit; err_*: |predicted - actual| tokens over repeats (median, mean), and as a
    share of the actual hit (median, repeats the engine hit); spread: replicas that got the
    first request of some group, of min(replicas, groups).
    """
    if not requests or "first" not in requests[0].meta:
        return None  # a token-level workload: no groups
    errs: list[float] = []
    rel: list[float] = []
    hit = 0
    firsts: set[int] = set()
    groups = 0
    for req, rec in zip(requests, records, strict=True):
        if req.meta["first"]:
            firsts.add(rec.replica)
            groups += 1
            continue
        guess = predicted[req.id]
        hit += guess > 0
        errs.append(abs(guess - rec.cached_tokens))
        if rec.cached_tokens:
            rel.append(abs(guess - rec.cached_tokens) / rec.cached_tokens)
    n = len(errs)
    return {
        "repeats": n,
        "predicted": hit / n if n else 1.0,
        "err_median": percentile(errs, 50) if errs else 0.0,
        "err_mean": sum(errs) / n if n else 0.0,
        "err_rel_median": percentile(rel, 50) if rel else 0.0,
        "spread": len(firsts) / min(N_REPLICAS, groups) if groups else 1.0,
    }


# --- goals ---------------------------------------------------------------------------------------
Verdict = tuple[bool, str] | None  # None: a reference row is missing
Check = Callable[[Prepared, Row], Verdict]


@dataclass(frozen=True, slots=True)
class Goal:
    workload: str
    text: str
    check: Check


def _hit_vs_oracle(least: float) -> Check:
    def check(p: Prepared, r: Row) -> Verdict:
        bound = p.prof.oracle_hit_ratio
        share = r.s["hit_ratio"] / bound if bound else 1.0
        return share >= least, f"{share:.2f}"

    return check


def _vs(ref: str, key: str, factor: float, *, higher: bool = False) -> Check:
    def check(p: Prepared, r: Row) -> Verdict:
        base = p.rows.get(ref)
        if base is None or base is r:  # a router held to itself: not a goal it can meet or miss
            return None
        ratio = r.s[key] / base.s[key] if base.s[key] else math.inf
        shown = f"{ratio:.3f}x" if higher else f"{ratio:.2f}x"  # throughput ties are close
        return (ratio >= factor if higher else ratio <= factor), shown

    return check


def _imbalance(most: float) -> Check:
    def check(p: Prepared, r: Row) -> Verdict:
        return r.s["imbalance"] <= most, f"{r.s['imbalance']:.2f}"

    return check


LOWER = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "imbalance")
HIGHER = ("hit_ratio", "throughput_tok_s")


def _within(ref: str, pct: float) -> Check:
    """No figure more than `pct` % worse than `ref`'s (better is fine); shows the worst one."""

    def check(p: Prepared, r: Row) -> Verdict:
        base = p.rows.get(ref)
        if base is None:
            return None
        worst, name = 0.0, "all"
        for key in (*LOWER, *HIGHER):
            a, b = r.s[key], base.s[key]
            if key == "hit_ratio":
                worse = (b - a) * 100.0  # points: both are 0 on the control
            elif key in LOWER:
                worse = (a / b - 1.0) * 100.0 if b else 0.0
            else:
                worse = (1.0 - a / b) * 100.0 if b else 0.0
            if worse > worst:
                worst, name = worse, key
        return worst <= pct, f"{name} +{worst:.0f}%" if worst > 0 else "none worse"

    return check


def _pred_at_least(key: str, least: float) -> Check:
    def check(p: Prepared, r: Row) -> Verdict:
        if r.pred is None:
            return None
        return r.pred[key] >= least, f"{r.pred[key]:.2f}"

    return check


BASELINE = "sglang_cache_aware"  # the public cache-aware router the default must beat
GOALS: tuple[Goal, ...] = (
    *(
        g
        for w in SHAPE_WORKLOADS
        for g in (
            Goal(w, "hit ratio >= 0.85 x oracle", _hit_vs_oracle(0.85)),
            Goal(w, "predicted hit on >= 90% of repeats", _pred_at_least("predicted", 0.9)),
            Goal(w, f"hit ratio >= {BASELINE}", _vs(BASELINE, "hit_ratio", 1.0, higher=True)),
            Goal(w, f"TTFT mean <= 0.75 x {BASELINE}", _vs(BASELINE, "ttft_mean", 0.75)),
            Goal(w, f"TTFT P99 <= 0.75 x {BASELINE}", _vs(BASELINE, "ttft_p99", 0.75)),
        )
    ),
    *(
        g
        for w in ("system", "multi_turn")
        for g in (
            Goal(w, "TTFT P99 <= 0.5 x round_robin", _vs("round_robin", "ttft_p99", 0.5)),
            Goal(
                w,
                "throughput >= round_robin",
                _vs("round_robin", "throughput_tok_s", 1.0, higher=True),
            ),
            Goal(w, "imbalance <= 1.3", _imbalance(1.3)),
        )
    ),
    Goal("hot_prefix", "imbalance <= 1.3", _imbalance(1.3)),
    Goal("hot_prefix", "TTFT P99 <= 0.5 x round_robin", _vs("round_robin", "ttft_p99", 0.5)),
    Goal("no_sharing", "every figure within 5% of least_loaded", _within("least_loaded", 5.0)),
    Goal("trace", "TTFT P99 <= 1.2 x clairvoyant", _vs("clairvoyant", "ttft_p99", 1.2)),
)


def evaluate(runs: dict[str, Prepared], routers: Sequence[str]) -> dict[str, list[Verdict]]:
    out: dict[str, list[Verdict]] = {}
    for name in routers:
        verdicts: list[Verdict] = []
        for g in GOALS:
            p = runs.get(g.workload)
            row = p.rows.get(name) if p is not None else None
            verdicts.append(None if row is None or p is None else g.check(p, row))
        out[name] = verdicts
    return out


def ttft_p99_score(runs: dict[str, Prepared], name: str) -> float:
    """Geometric mean over workloads of TTFT P99 / round robin's (lower is better)."""
    logs = [
        math.log(p.rows[name].s["ttft_p99"] / p.rows["round_robin"].s["ttft_p99"])
        for p in runs.values()
        if name in p.rows and "round_robin" in p.rows
    ]
    return math.exp(sum(logs) / len(logs)) if logs else math.nan


def pick_default(
    runs: dict[str, Prepared],
    verdicts: dict[str, list[Verdict]],
) -> list[tuple[str, int, int, float]]:
    """Candidates ranked: most goals met, then the best TTFT P99 overall."""
    ranked = []
    for name, vs in verdicts.items():
        met = sum(1 for v in vs if v is not None and v[0])
        known = sum(1 for v in vs if v is not None)
        ranked.append((name, met, known, ttft_p99_score(runs, name)))
    ranked.sort(key=lambda x: (-x[1], x[3] if not math.isnan(x[3]) else math.inf))
    return ranked


# --- printing ------------------------------------------------------------------------------------
def describe(p: Prepared) -> str:
    cfg = build_config(**p.spec.engine)
    return (
        f"| {p.name} | {p.prof.requests} | {p.prof.rate:.1f} | {p.rho0:.2f} | {p.rho_star:.2f} | "
        f"{p.prof.prompt_tokens / p.prof.requests:,.0f} | {p.prof.oracle_hit_ratio:.3f} | "
        f"{p.prof.peak_live_tokens:,} | {p.kv_tokens:,} | "
        f"{cfg.model.name} / {cfg.gpu.key} |"
    )


def workload_table(runs: dict[str, Prepared]) -> str:
    head = (
        "| workload | requests | req/s | rho0 | rho* | mean prompt | oracle hit | "
        "live set (tok) | KV/replica (tok) | engine |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
    )
    return "\n".join([head, *(describe(p) for p in runs.values())])


def result_table(runs: dict[str, Prepared]) -> str:
    lines = [
        "| workload | router | hit | hit/oracle | TTFT mean (s) | TTFT p50 (s) | TTFT p99 (s) | "
        "TPOT p50 (ms) | TPOT p99 (ms) | out tok/s | imbalance | busy |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in runs.values():
        bound = p.prof.oracle_hit_ratio
        for r in p.rows.values():
            s = r.s
            share = f"{s['hit_ratio'] / bound:.2f}" if bound else "-"
            mark = "*" if r.overflow else ""
            lines.append(
                f"| {p.name} | {r.router}{mark} | {s['hit_ratio']:.3f} | {share} | "
                f"{s['ttft_mean']:.3f} | {s['ttft_p50']:.3f} | {s['ttft_p99']:.3f} | {s['tpot_p50'] * 1e3:.0f} | "
                f"{s['tpot_p99'] * 1e3:.0f} | {s['throughput_tok_s']:.0f} | "
                f"{s['imbalance']:.2f} | {r.busy:.2f} |"
            )
    return "\n".join(lines)


def prediction_table(runs: dict[str, Prepared]) -> str:
    lines = [
        "| workload | router | repeats with a predicted hit | median abs err (tok) | "
        "mean abs err (tok) | median rel err | new groups' replicas / possible |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in runs.values():
        for r in p.rows.values():
            q = r.pred
            if q is None:
                continue
            lines.append(
                f"| {p.name} | {r.router} | {q['predicted']:.2f} | {q['err_median']:.0f} | "
                f"{q['err_mean']:.0f} | {q['err_rel_median']:.3f} | {q['spread']:.2f} |"
            )
    return "\n".join(lines)


def goal_table(verdicts: dict[str, list[Verdict]]) -> str:
    names = list(verdicts)
    lines = ["| goal | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for i, g in enumerate(GOALS):
        if all(verdicts[n][i] is None for n in names):
            continue  # its workload (or reference) was not run
        cells = []
        for n in names:
            v = verdicts[n][i]
            cells.append("n/a" if v is None else f"{'PASS' if v[0] else 'FAIL'} {v[1]}")
        lines.append(f"| {g.workload}: {g.text} | " + " | ".join(cells) + " |")
    totals = [
        f"{sum(1 for v in verdicts[n] if v and v[0])}/{sum(1 for v in verdicts[n] if v)}"
        for n in names
    ]
    lines.append("| goals met | " + " | ".join(totals) + " |")
    return "\n".join(lines)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- the command ---------------------------------------------------------------------------------
async def bench(
    names: Sequence[str], routers: Sequence[str], n: int | None, seed: int, quick: bool
) -> dict[str, Prepared]:
    runs: dict[str, Prepared] = {}
    for name in names:
        spec = WORKLOADS[name]
        size = n if n is not None else (QUICK_REQUESTS if quick else spec.requests)
        if name == "trace":
            size = min(size, wl.trace_records())
        t = time.perf_counter()
        p = prepare(spec, size, seed)
        log(f"{name}: {len(p.requests)} requests prepared in {time.perf_counter() - t:.1f}s")
        for router in routers:
            row = await run_one(p, router, seed)
            p.rows[router] = row
            log(
                f"  {router:<20} {row.cpu_s:5.1f}s cpu  TTFT p99 {row.s['ttft_p99']:.3f}s  "
                f"hit {row.s['hit_ratio']:.3f}"
            )
        runs[name] = p
    return runs


def report(runs: dict[str, Prepared], routers: Sequence[str], args: argparse.Namespace) -> None:
    print(
        f"Routing benchmark: {N_REPLICAS} replicas, seed {args.seed}, scrape every "
        f"{SCRAPE_S:g} s; times in simulated seconds.\n"
    )
    print(workload_table(runs))
    print(
        "\nreq/s: steady-state arrivals (between the 25th and 75th percentile arrival); rho0: "
        "prefill demand with no prefix cache / fleet prefill compute; rho*: the same for the "
        "oracle's misses; live set: most reusable prefix tokens alive at once.\n"
    )
    print(result_table(runs))
    print(
        "\nPredicted vs actual cached tokens per request (the gateway's predicted hit x tokens "
        "per block against the engine's own count; repeats = requests after their group's "
        "first):\n"
    )
    print(prediction_table(runs))
    for p in runs.values():
        if p.spec.hot_group is not None:
            spread = ", ".join(
                f"{r.router} {r.hot[0]}/{r.hot[1]}" for r in p.rows.values() if r.hot[1]
            )
            print(f"\n{p.name}: the hot prompt's requests on its busiest replica: {spread}")
    if any(r.overflow for p in runs.values() for r in p.rows.values()):
        print(
            "\n* every replica was saturated for some requests (the gateway would have held "
            "them in admission); they went to the replica with the fewest in flight."
        )
    candidates = [r for r in routers if r in CANDIDATES]
    if not candidates:
        return
    verdicts = evaluate(runs, candidates)
    print("\nGoals (value: hit share of the oracle, ratio to the reference, or the figure):\n")
    print(goal_table(verdicts))
    ranked = pick_default(runs, verdicts)
    best = ranked[0]
    print(
        f"\nDefault: {best[0]}: meets {best[1]} of {best[2]} goals; TTFT P99 "
        f"{best[3]:.2f} x round robin's (geometric mean over workloads)."
    )
    for name, met, known, score in ranked[1:]:
        print(f"  then {name}: {met}/{known} goals, TTFT P99 {score:.2f} x round robin's")
    if best[0] != GATEWAY_DEFAULT:
        print(f"(the gateway's configured default is {GATEWAY_DEFAULT})")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.routing",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--workload",
        default="all",
        choices=("all", *WORKLOADS),
        help="one workload, or all (default)",
    )
    ap.add_argument(
        "--policies",
        nargs="+",
        default=list(DEFAULT_ROUTERS),
        metavar="NAME",
        choices=list(ROUTERS),
        help=f"routers to run (default: all: {', '.join(DEFAULT_ROUTERS)})",
    )
    ap.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests per workload (default: each workload's own; the trace is "
        "capped at its length)",
    )
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_REQUESTS} requests per workload")
    ap.add_argument(
        "--http",
        action="store_true",
        help="instead: the real gateway over HTTP against 4 simulated replicas, the default "
        "vs sglang_cache_aware and round_robin, per prompt shape (bench/routing_http.py)",
    )
    ap.add_argument(
        "--default",
        default="ttft",
        help="the policy --http compares with the baselines (default: ttft)",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.http:
        from bench.routing_http import http_main

        if args.workload not in ("all", *SHAPE_WORKLOADS):
            raise SystemExit(f"--http runs the prompt shapes: {', '.join(SHAPE_WORKLOADS)}")
        shapes = SHAPE_WORKLOADS if args.workload == "all" else (args.workload,)
        return asyncio.run(http_main(shapes, args))
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    t = time.perf_counter()
    runs = asyncio.run(bench(names, args.policies, args.requests, args.seed, args.quick))
    report(runs, args.policies, args)
    log(f"done in {time.perf_counter() - t:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
