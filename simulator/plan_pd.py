"""Aggregated vs disaggregated (xPyD) at equal GPUs, predicted by the discrete-event mode.

`gateway plan --pd --gpus 8 ...` (simulator/plan.py) and bench/pd.py use this module: a
workload (prompt and output length ranges, a share of long prompts, a rate) becomes a seeded
open-loop trace; `evaluate` replays it on N aggregated replicas (`simulator.des.run`) or on x
prefill + y decode replicas (`simulator.pd_des.run_pd`) and condenses the records into TTFT and
TPOT P50/P99, output tokens/s and goodput (requests per second that meet both SLOs). The planner
routes with the simulator's own simple routers (least-loaded prefill, least-loaded decode); the
bench routes through the gateway's production routing code instead.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from simulator.des import Cluster, ReplicaLoad, SimRequest, run
from simulator.pd_des import DecodePicker, PdCluster, least_loaded_decode, run_pd
from simulator.results import RunResult
from simulator.stats import percentile


@dataclass(frozen=True, slots=True)
class PdWorkload:
    """Uniform prompt/output lengths; `long_share` of requests draw from the `long_*` ranges."""

    name: str
    prompt: tuple[int, int]
    output: tuple[int, int]
    rate: float  # requests per second (Poisson arrivals)
    requests: int = 400
    long_share: float = 0.0
    long_prompt: tuple[int, int] = (65536, 98304)
    long_output: tuple[int, int] = (16, 64)

    def trace(self, seed: int = 0) -> list[SimRequest]:
        rng = random.Random(seed)
        t, out = 0.0, []
        for i in range(self.requests):
            t += rng.expovariate(self.rate)
            long = rng.random() < self.long_share
            lo, hi = self.long_prompt if long else self.prompt
            olo, ohi = self.long_output if long else self.output
            n = rng.randint(lo, hi)
            prompt = [rng.randrange(16, 100_000) for _ in range(n)]
            out.append(SimRequest(f"r{i}", t, prompt, rng.randint(olo, ohi),
                                  meta={"long": long}))
        return out

    @property
    def max_len(self) -> int:
        hi = max(self.prompt[1] + self.output[1],
                 self.long_prompt[1] + self.long_output[1] if self.long_share else 0)
        return 1 << math.ceil(math.log2(hi))


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float = 2.0
    tpot_s: float = 0.050


@dataclass(frozen=True, slots=True)
class Layout:
    """`prefill == 0`: `decode` aggregated replicas; else a `prefill`P`decode`D split."""

    prefill: int
    decode: int

    @property
    def name(self) -> str:
        return f"agg x{self.decode}" if self.prefill == 0 else f"{self.prefill}P{self.decode}D"

    def replicas(self) -> int:
        return self.prefill + self.decode


def summarize(result: RunResult, slo: Slo) -> dict[str, float]:
    recs = result.records
    ttft = [r.ttft_s for r in recs]
    tpot = [r.tpot_s for r in recs if r.output_tokens > 1]
    span = max(r.finish_s for r in recs) - min(r.arrival_s for r in recs)
    good = sum(1 for r in recs if r.ttft_s <= slo.ttft_s
               and (r.output_tokens < 2 or r.tpot_s <= slo.tpot_s))
    return {"ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "tpot_p50": percentile(tpot, 50), "tpot_p99": percentile(tpot, 99),
            "tok_s": sum(r.output_tokens for r in recs) / span, "goodput": good / span,
            "slo_ok": good / len(recs), "preemptions": float(sum(r.preemptions for r in recs))}


class LeastLoaded:
    """The planner's prefill router: fewest waiting + running, then lowest KV usage."""

    def route(self, req: SimRequest, view: Sequence[ReplicaLoad]) -> int:
        return min(view, key=lambda v: (v.waiting + v.running, v.kv_usage, v.index)).index


RouterFactory = Callable[[int, int], Any]  # (replicas, kv tokens per replica) -> a DES Router


async def evaluate(w: PdWorkload, layout: Layout, *, model: str, gpu: str, tp: int = 1,
                   kv_link_gbps: float = 400.0, slo: Slo | None = None, seed: int = 0,
                   router: RouterFactory | None = None, decode_picker: DecodePicker | None = None,
                   trace: list[SimRequest] | None = None, **engine: Any) -> dict[str, float]:
    """One layout on one workload: the summary figures (see `summarize`)."""
    slo = slo or Slo()
    reqs = trace if trace is not None else w.trace(seed)
    reqs = [SimRequest(r.id, r.arrival_s, r.prompt_tokens, r.max_tokens, meta=dict(r.meta))
            for r in reqs]
    opts = {"tensor_parallel_size": tp, "max_model_len": w.max_len, **engine}
    make = router or (lambda n, kv: LeastLoaded())
    if layout.prefill == 0:
        cluster = Cluster(layout.decode, model, gpu, seed=seed, **opts)
        kv = cluster.config.num_blocks * cluster.config.block_size
        result = await run(reqs, cluster, make(layout.decode, kv), scrape_interval_s=0.0)
    else:
        pd = PdCluster(layout.prefill, layout.decode, model, gpu, seed=seed,
                       kv_link_gbps=kv_link_gbps, **opts)
        kv = pd.config.num_blocks * pd.config.block_size
        result = await run_pd(reqs, pd, make(layout.prefill, kv),
                              decode_picker or least_loaded_decode)
    return summarize(result, slo)


def layouts(replicas: int) -> list[Layout]:
    """Aggregated, then every xPyD split of the same replica count."""
    return [Layout(0, replicas), *(Layout(x, replicas - x) for x in range(1, replicas))]


async def plan_pd(w: PdWorkload, gpus: int, *, model: str, gpu: str, tp: int = 1,
                  kv_link_gbps: float = 400.0, slo: Slo | None = None, seed: int = 0,
                  splits: Sequence[Layout] | None = None) -> dict[str, dict[str, float]]:
    """Every layout of `gpus // tp` replicas (or `splits`), by name."""
    out: dict[str, dict[str, float]] = {}
    trace = w.trace(seed)
    for lay in splits or layouts(gpus // tp):
        out[lay.name] = await evaluate(w, lay, model=model, gpu=gpu, tp=tp, slo=slo, seed=seed,
                                       kv_link_gbps=kv_link_gbps, trace=trace)
    return out


def best(results: dict[str, dict[str, float]]) -> tuple[str, str]:
    """(best aggregated, best split) by goodput, then by TPOT P99."""
    def key(name: str) -> tuple[float, float]:
        r = results[name]
        return (-r["goodput"], r["tpot_p99"])
    agg = min((n for n in results if n.startswith("agg")), key=key)
    split = min((n for n in results if not n.startswith("agg")), key=key)
    return agg, split


def table(results: dict[str, dict[str, float]]) -> str:
    rows = [f"  {'layout':<9} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
            f"{'tok/s':>8} {'goodput':>8} {'SLO ok':>7}"]
    for name, r in results.items():
        rows.append(f"  {name:<9} {r['ttft_p50']:>8.2f}s {r['ttft_p99']:>8.2f}s "
                    f"{r['tpot_p50'] * 1e3:>7.1f}ms {r['tpot_p99'] * 1e3:>7.1f}ms "
                    f"{r['tok_s']:>8.0f} {r['goodput']:>7.2f}/s {r['slo_ok']:>6.0%}")
    return "\n".join(rows)


def _range(text: str | None, fallback: int | None, flag: str) -> tuple[int, int]:
    if text is None:
        if fallback is None:
            raise ValueError(f"--pd needs {flag} LO:HI (or a fixed length)")
        return fallback, fallback
    lo, _, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"{flag} wants LO:HI, got {text!r}") from None
    if not 1 <= a <= b:
        raise ValueError(f"{flag} wants 1 <= LO <= HI, got {text!r}")
    return a, b


PD_MARGIN = 1.05  # a split must beat aggregated goodput by 5 % to be worth its moving parts


def verdict(results: dict[str, dict[str, float]]) -> str:
    agg, split = best(results)
    a, s = results[agg], results[split]
    if s["goodput"] > PD_MARGIN * a["goodput"]:
        return (f"prefer {split}: goodput {s['goodput'] / a['goodput']:.2f}x {agg}, TPOT P99 "
                f"{a['tpot_p99'] / s['tpot_p99']:.1f}x lower")
    return (f"prefer aggregated ({agg}): the best split {split} reaches "
            f"{s['goodput'] / max(a['goodput'], 1e-9):.2f}x its goodput")


def cli_main(args: Any) -> int:
    """`gateway plan --pd ...` (the arguments of simulator/plan.py's parser)."""
    import asyncio
    import sys

    try:
        prompt = _range(args.prompt_range, args.prompt_tokens, "--prompt-range")
        output = _range(args.output_range, args.output_tokens, "--output-range")
        long_prompt = _range(args.long_prompt_range, None, "--long-prompt-range")
        if args.rate is None or args.rate <= 0:
            raise ValueError("--pd needs --rate (requests per second)")
        tp = args.tp or 1
        if args.gpus < 2 * tp:
            raise ValueError("--pd needs --gpus for at least two replicas")
        w = PdWorkload("workload", prompt, output, args.rate, args.requests,
                       args.long_share, long_prompt)
        slo = Slo(args.ttft_slo or 2.0, args.tpot_slo or 0.050)
        engine = {"weight_dtype": args.weight_dtype, "kv_cache_dtype": args.kv_cache_dtype,
                  "gpu_memory_utilization": args.gpu_memory_utilization}
        results = asyncio.run(_plan_all(w, args, tp, slo, engine))
    except ValueError as exc:
        print(f"gateway plan: {exc}", file=sys.stderr)
        return 2
    agg, split = best(results)
    print(f"{args.model} on {args.gpu}, {args.gpus} GPUs (TP {tp}), {args.rate:g} req/s, "
          f"prompts {prompt[0]}-{prompt[1]}, outputs {output[0]}-{output[1]}"
          + (f", {args.long_share:.0%} long ({long_prompt[0]}-{long_prompt[1]})"
             if args.long_share else "")
          + f"; SLO TTFT <= {slo.ttft_s:g} s, TPOT <= {slo.tpot_s * 1e3:g} ms "
          f"(DES, {args.requests} requests)")
    print(table(results))
    print(f"  best aggregated: {agg}; best split: {split}")
    print(f"  {verdict(results)}")
    return 0


async def _plan_all(w: PdWorkload, args: Any, tp: int, slo: Slo,
                    engine: dict[str, Any]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    trace = w.trace(args.seed)
    for lay in layouts(args.gpus // tp):
        out[lay.name] = await evaluate(w, lay, model=args.model, gpu=args.gpu, tp=tp, slo=slo,
                                       seed=args.seed, kv_link_gbps=args.kv_link_gbps,
                                       trace=trace, **engine)
    return out
