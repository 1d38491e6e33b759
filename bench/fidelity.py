"""Measured against simulated: every row of a calibration CSV replayed closed loop in the DES.

    python -m bench.fidelity DATA.csv [--profile P] [--split test] [--every N]
                                      [--request-latency infer]

Each row (the format of shared/calibration/: backend, model, gpu, precision, isl, osl,
concurrency, tp, ttft_ms, tpot_ms) is one closed-loop benchmark: `concurrency` clients, each
sending random `isl`-token prompts and receiving exactly `osl` tokens. The report prints
measured and simulated mean TTFT and TPOT per row and the mean absolute percentage error
(MAPE) overall, by TP size and by concurrency band. The CSV does not say how the KV cache was
stored: by default (`--kv-cache-dtype infer`) it is inferred per GPU from the file's calibration
half (`infer_kv_dtypes`). Nor does it say what the serving stack in front of the engine adds to
TTFT: `--request-latency infer` measures it from the file's lowest-concurrency rows
(`infer_request_latency`) and scores the others. The data sets: simulator/profiles/*.csv, whose
sources simulator/profiles/CALIBRATION.md names.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import math
import multiprocessing
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, fields, replace
from itertools import repeat
from pathlib import Path
from typing import Any

import yaml

from simulator.config import build_config, vllm_batch_defaults
from simulator.des import Cluster, RoundRobin, fixed_length_users, run
from simulator.perf_model import PerfModel
from simulator.profiles import (
    EngineProfile,
    GpuProfile,
    ModelProfile,
    load_engines,
    load_gpus,
    load_models,
)

GPU_ALIASES = {"h100_sxm": "h100", "h200_sxm": "h200", "a100_sxm": "a100-80g",
               "b200_sxm": "b200", "mi300x": "mi300x", "l40s": "l40s"}
REQUESTS_PER_CLIENT = 10  # the benchmark's requests per client (num_prompts = 10 x concurrency)
STEADY_ROUNDS = 3  # closed-loop rounds simulated for the spread-out part
WARMUP_ROUNDS = 0  # rounds of those not counted (a settling period; none by default)
BANDS = ((1, 8, "c<=8"), (9, 32, "c 9-32"), (33, 10**9, "c>32"))
# The KV cache dtype each GPU's benchmarks ran with, which the CSV does not record. Inferred
# by `python -m bench.calibrate` from the KV capacity the calibration half's saturated
# rows show (`infer_kv_dtypes`): only FP8 KV holds the H200 TP 1 sequences measured decoding
# at once; the H100 TP 2 rows saturate where a 16-bit cache would. "benchmark" picks it.
BENCHMARK_KV_CACHE_DTYPE = {"h100": "auto", "h200": "fp8"}


@dataclass(frozen=True, slots=True)
class Row:
    """One measured configuration."""

    model: str
    gpu: str
    precision: str
    isl: int
    osl: int
    concurrency: int
    tp: int
    ttft_ms: float
    tpot_ms: float

    @property
    def key(self) -> tuple[str, str, int, int, int, int]:
        return (self.gpu, self.model, self.tp, self.isl, self.osl, self.concurrency)


def read_rows(path: str | Path) -> list[Row]:
    with open(path, newline="", encoding="utf-8") as f:
        return [Row(r["model"], r["gpu"], r["precision"], int(r["isl"]), int(r["osl"]),
                    int(r["concurrency"]), int(r["tp"]), float(r["ttft_ms"]),
                    float(r["tpot_ms"])) for r in csv.DictReader(f)]


def split(rows: Sequence[Row], part: str) -> list[Row]:
    """The deterministic half split: rows in (gpu, model, tp, isl, osl, concurrency) order,
    even positions calibrate ("cal"), odd ones are held out ("test"); "all" keeps all."""
    ordered = sorted(rows, key=lambda r: r.key)
    if part == "all":
        return ordered
    if part not in ("cal", "test"):
        raise ValueError(f"split must be cal, test or all, not {part!r}")
    return ordered[0 if part == "cal" else 1::2]


@dataclass(frozen=True, slots=True)
class Profiles:
    """The model, GPU and engine profiles a report runs with."""

    models: dict[str, ModelProfile]
    gpus: dict[str, GpuProfile]
    engines: dict[str, EngineProfile]

    @classmethod
    def load(cls, path: str | Path | None = None) -> Profiles:
        """The shipped profiles, with a calibration profile file's entries over them (a YAML
        mapping with `gpus:` and `engines:` sections of fields to replace)."""
        p = cls(load_models(), load_gpus(), load_engines())
        if path is None:
            return p
        data = yaml.safe_load(Path(path).read_text("utf-8")) or {}
        return p.with_overrides(data.get("gpus", {}), data.get("engines", {}))

    def with_overrides(self, gpus: dict[str, dict[str, Any]],
                       engines: dict[str, dict[str, Any]]) -> Profiles:
        g = dict(self.gpus)
        for k, v in gpus.items():
            g[k] = _replace(g[k], v) if k in g else GpuProfile(key=k, **v)
        e = dict(self.engines)
        for k, v in engines.items():
            e[k] = _replace(e[k], v) if k in e else EngineProfile(name=k, **v)
        return Profiles(self.models, g, e)

    def model_for(self, name: str) -> ModelProfile:
        """The profile of a row's model: its name or Hugging Face id, with or without
        -Instruct, or a quantized re-release of it (`nvidia/Llama-3.1-8B-Instruct-FP8`: the
        row's precision says how its weights are stored)."""
        want = name.lower()
        bare = want.split("/")[-1].removesuffix("-fp8").removesuffix("-instruct")
        for m in self.models.values():
            hf = m.hf_name.lower()
            if want in (m.name, hf, hf.removesuffix("-instruct")):
                return m
        for m in self.models.values():
            if bare == m.hf_name.lower().split("/")[-1].removesuffix("-instruct"):
                return m
        raise ValueError(f"no model profile for {name!r}")

    def gpu_for(self, name: str) -> GpuProfile:
        key = GPU_ALIASES.get(name.lower(), name.lower())
        if key not in self.gpus:
            raise ValueError(f"no GPU profile for {name!r}")
        return self.gpus[key]


def _replace(obj: Any, values: dict[str, Any]) -> Any:
    known = {f.name for f in fields(obj)}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"unknown field(s) {sorted(unknown)} for {type(obj).__name__}")
    return replace(obj, **{k: float(v) if isinstance(v, int | float) and not isinstance(v, bool)
                           and isinstance(getattr(obj, k), float) else v
                           for k, v in values.items()})


@dataclass(frozen=True, slots=True)
class Result:
    row: Row
    ttft_ms: float
    tpot_ms: float
    preemptions: int

    @property
    def ttft_err(self) -> float:
        return abs(self.ttft_ms - self.row.ttft_ms) / self.row.ttft_ms

    @property
    def tpot_err(self) -> float:
        return abs(self.tpot_ms - self.row.tpot_ms) / self.row.tpot_ms


# how the KV cache dtype of a replayed row is chosen: a dtype for every row, "benchmark" (the
# shipped data's, BENCHMARK_KV_CACHE_DTYPE) or a GPU -> dtype map (`infer_kv_dtypes` of a file)
KvChoice = str | Mapping[str, str]


def kv_dtype_for(row: Row, kv_cache_dtype: KvChoice) -> str:
    """`kv_cache_dtype`, or the one `row`'s GPU was measured with ("benchmark" or a map)."""
    if isinstance(kv_cache_dtype, str) and kv_cache_dtype != "benchmark":
        return kv_cache_dtype
    by_gpu = BENCHMARK_KV_CACHE_DTYPE if isinstance(kv_cache_dtype, str) else kv_cache_dtype
    return by_gpu.get(GPU_ALIASES.get(row.gpu.lower(), row.gpu.lower()), "auto")


def engine_options(row: Row, kv_cache_dtype: KvChoice = "benchmark") -> dict[str, Any]:
    """The engine a row's benchmark ran: `vllm serve` with TP and weights as the row says,
    vLLM's batch defaults for the GPU (`vllm_batch_defaults`), prefix caching on."""
    weight = {"fp8": "fp8", "bf16": "", "fp16": "", "int4": "int4", "awq": "int4",
              "w4a16": "int4", "mxfp4": "mxfp4"}.get(row.precision.lower(), "")
    return {"tensor_parallel_size": row.tp, "weight_dtype": weight,
            "kv_cache_dtype": kv_dtype_for(row, kv_cache_dtype), "max_model_len": row.isl + row.osl,
            "enable_prefix_caching": True, "prefill_attention": True,
            **vllm_batch_defaults(GPU_ALIASES.get(row.gpu.lower(), row.gpu.lower()))}


async def _closed_loop(row: Row, profiles: Profiles, engine: str, kv_cache_dtype: KvChoice,
                       seed: int, rounds: int, staggered: bool,
                       warmup: int = 0) -> tuple[float, float, int]:
    cluster = Cluster(1, profiles.model_for(row.model), profiles.gpu_for(row.gpu), seed=seed,
                      engine=profiles.engines[engine], **engine_options(row, kv_cache_dtype))
    c = row.concurrency
    users = fixed_length_users(c, row.isl, row.osl, requests_per_user=rounds, seed=seed)
    if staggered:
        users.stagger_s = steady_cycle_s(row, cluster.config.perf) / c
    recs = [r for r in (await run(users, cluster, RoundRobin())).records
            if int(r.id.rsplit("-", 1)[1]) >= warmup]
    return (sum(r.ttft_s for r in recs) / len(recs), sum(r.tpot_s for r in recs) / len(recs),
            sum(r.preemptions for r in recs))


def steady_cycle_s(row: Row, perf: PerfModel) -> float:
    """How long one client's request takes once the clients run spread out: the engine
    decodes `osl` steps of `concurrency` sequences, and every client's prompt is prefilled
    once in that time beside them (each prefill stalls every decode). The clients of the
    spread-out rounds start this far apart over `concurrency`, so the engine meets the load it
    will carry; spreading them over the decode steps alone would start them too close
    together, with a queue the few simulated rounds never drain."""
    c = row.concurrency
    decode = perf.step_time(0, c, c * (row.isl + row.osl // 2))
    return row.osl * decode + c * perf.prefill_time(row.isl)


async def simulate(row: Row, profiles: Profiles, *, engine: str = "vllm",
                   requests_per_client: int = REQUESTS_PER_CLIENT,
                   kv_cache_dtype: KvChoice = "benchmark",
                   seed: int = 0, steady_rounds: int = STEADY_ROUNDS,
                   warmup_rounds: int = WARMUP_ROUNDS) -> Result:
    """`row`'s benchmark in the DES: mean TTFT and TPOT over its requests.

    The benchmark sends `requests_per_client` x concurrency requests: the first round leaves
    all at once (a burst: prompts queue for the step's token budget), the rest find the
    clients spread out (a closed loop with the clients' phases spread over one request,
    `steady_cycle_s`; its first `warmup_rounds` rounds settle the phases and are not
    counted). The two are simulated apart and weighted 1 : (requests_per_client - 1).
    """
    b_ttft, b_tpot, b_pre = await _closed_loop(row, profiles, engine, kv_cache_dtype, seed, 1,
                                               False)
    if requests_per_client <= 1:
        return Result(row, b_ttft * 1e3, b_tpot * 1e3, b_pre)
    s_ttft, s_tpot, s_pre = await _closed_loop(row, profiles, engine, kv_cache_dtype, seed,
                                               warmup_rounds + steady_rounds, True,
                                               warmup=warmup_rounds)
    w = 1.0 / requests_per_client
    return Result(row, 1e3 * (w * b_ttft + (1 - w) * s_ttft),
                  1e3 * (w * b_tpot + (1 - w) * s_tpot), b_pre + s_pre)


def perf_of(row: Row, profiles: Profiles, kv_cache_dtype: KvChoice) -> PerfModel:
    opts = engine_options(row, kv_cache_dtype)
    return build_config(profiles.model_for(row.model), profiles.gpu_for(row.gpu),
                        engine=profiles.engines["vllm"], **opts).perf


def fits_in_cache(row: Row, perf: PerfModel) -> bool:
    return row.concurrency * (row.isl + row.osl) <= perf.kv_capacity_tokens


def infer_kv_dtypes(rows: Sequence[Row], profiles: Profiles,
                    candidates: Sequence[str] = ("auto", "fp8")) -> dict[str, str]:
    """The KV cache dtype each GPU's benchmarks most likely ran with (the CSV does not say).

    Only the KV capacity tells them apart: for each GPU, the rows whose KV demand (clients x
    (isl + osl)) exceeds the cache under some candidate are replayed in the DES under each,
    and the candidate with the lowest mean TTFT error wins (a GPU with no such row keeps
    "auto")."""
    out: dict[str, str] = {}
    by_gpu: dict[str, list[Row]] = {}
    for r in rows:
        by_gpu.setdefault(profiles.gpu_for(r.gpu).key, []).append(r)
    for g, group in sorted(by_gpu.items()):
        telling = [r for r in group
                   if any(not fits_in_cache(r, perf_of(r, profiles, kv)) for kv in candidates)]
        if not telling:
            out[g] = "auto"
            continue
        err = {kv: sum(res.ttft_err for res in simulate_all(telling, profiles,
                                                             kv_cache_dtype=kv))
               for kv in candidates}
        out[g] = min(candidates, key=lambda kv: err[kv])
    return out


def probe_rows(rows: Sequence[Row]) -> list[Row]:
    """The rows at the file's lowest concurrency: the ones a single-client probe of the
    deployment would resemble most (queueing adds least to them)."""
    lo = min(r.concurrency for r in rows)
    return [r for r in rows if r.concurrency == lo]


def infer_request_latency(probes: Sequence[Row], profiles: Profiles, *, engine: str = "vllm",
                          kv_cache_dtype: KvChoice = "benchmark") -> dict[str, float]:
    """The benchmark's request path: `request_ms` and `request_us_per_token` such that the
    `probes` (its lowest-concurrency rows) replay at their measured TTFT.

    The time a request spends outside engine steps belongs to the serving stack in front of
    the engine (API server or another frontend, HTTP, tokenisation, the client), not to the
    model or the GPU, and a CSV does not record it. The probes are replayed with the current
    profile; their TTFT residuals are fitted as a + b x prompt tokens (least squares on
    relative error, b >= 0) and added to the engine profile's values."""
    res = simulate_all(probes, profiles, engine=engine, kv_cache_dtype=kv_cache_dtype)
    pts = [(r.row.isl, (r.row.ttft_ms - r.ttft_ms) * 1e-3, 1.0 / (r.row.ttft_ms * 1e-3) ** 2)
           for r in res]
    sw = sum(w for _, _, w in pts)
    sx = sum(w * x for x, _, w in pts)
    sy = sum(w * y for _, y, w in pts)
    sxx = sum(w * x * x for x, _, w in pts)
    sxy = sum(w * x * y for x, y, w in pts)
    det = sw * sxx - sx * sx
    b = (sw * sxy - sx * sy) / det if det > 1e-9 * sw * sxx else 0.0
    if b < 0:
        b = 0.0
    a = (sy - b * sx) / sw
    e = profiles.engines[engine]
    return {"request_ms": round(max(0.0, e.request_ms + a * 1e3), 2),
            "request_us_per_token": round(e.request_us_per_token + b * 1e6, 2)}


def simulate_all(rows: Iterable[Row], profiles: Profiles, **options: Any) -> list[Result]:
    """`simulate` for every row, in order. Each row's DES is seeded and independent of the
    others, so rows run in parallel worker processes, one per CPU (the same results as one
    after the other: each process replays whole rows)."""
    rows = list(rows)
    workers = min(len(rows), len(os.sched_getaffinity(0)))
    if workers < 2:
        return [_simulate_one(r, profiles, options) for r in rows]
    spawn = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads
    with ProcessPoolExecutor(workers, mp_context=spawn) as pool:
        return list(pool.map(_simulate_one, rows, repeat(profiles), repeat(options)))


def _simulate_one(row: Row, profiles: Profiles, options: dict[str, Any]) -> Result:
    return asyncio.run(simulate(row, profiles, **options))


def mape(values: Sequence[float]) -> float:
    return 100.0 * sum(values) / len(values) if values else math.nan


def groups(results: Sequence[Result]) -> dict[str, list[Result]]:
    """Results by TP size and by concurrency band (what the goal bounds)."""
    out: dict[str, list[Result]] = {}
    for r in results:
        out.setdefault(f"tp{r.row.tp}", []).append(r)
        for lo, hi, name in BANDS:
            if lo <= r.row.concurrency <= hi:
                out.setdefault(name, []).append(r)
    return dict(sorted(out.items()))


def summary(results: Sequence[Result]) -> dict[str, tuple[float, float, int]]:
    """{"all" | "tpN" | band: (TTFT MAPE %, TPOT MAPE %, rows)}."""
    table = {"all": list(results), **groups(results)}
    return {k: (mape([r.ttft_err for r in v]), mape([r.tpot_err for r in v]), len(v))
            for k, v in table.items()}


def report(results: Sequence[Result], out: Callable[[str], None] = print) -> None:
    out("| gpu | tp | isl | osl | conc | TTFT meas (ms) | TTFT sim (ms) | err | "
        "TPOT meas (ms) | TPOT sim (ms) | err | preempt |")
    out("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        w = r.row
        out(f"| {w.gpu} | {w.tp} | {w.isl} | {w.osl} | {w.concurrency} | {w.ttft_ms:.1f} | "
            f"{r.ttft_ms:.1f} | {100 * (r.ttft_ms / w.ttft_ms - 1):+.1f}% | {w.tpot_ms:.2f} | "
            f"{r.tpot_ms:.2f} | {100 * (r.tpot_ms / w.tpot_ms - 1):+.1f}% | {r.preemptions} |")
    out("")
    out("| rows | n | TTFT MAPE | TPOT MAPE |")
    out("| --- | ---: | ---: | ---: |")
    for k, (ttft, tpot, n) in summary(results).items():
        out(f"| {k} | {n} | {ttft:.1f}% | {tpot:.1f}% |")


def subset(rows: Sequence[Row], every: int) -> list[Row]:
    """Every `every`-th row (a reduced run for tests)."""
    return list(rows[::every]) if every > 1 else list(rows)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fidelity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", help="CSV of measured closed-loop benchmarks")
    ap.add_argument("--profile", default=None,
                    help="a calibration profile (YAML from bench.calibrate); default: the "
                         "shipped profiles")
    ap.add_argument("--split", choices=("all", "cal", "test"), default="all",
                    help="rows to run: all, or the calibration (even) / held-out (odd) half")
    ap.add_argument("--every", type=int, default=1, help="run every N-th selected row only")
    ap.add_argument("--engine", default="vllm")
    ap.add_argument("--kv-cache-dtype", default="infer",
                    help="auto, fp8, infer (default: per GPU, from the rows of the calibration "
                         "half that overflow the cache under some dtype) or benchmark (the "
                         "shipped data's, BENCHMARK_KV_CACHE_DTYPE)")
    ap.add_argument("--requests-per-client", type=int, default=REQUESTS_PER_CLIENT,
                    help="benchmark requests per client; the first round is a burst")
    ap.add_argument("--request-latency", choices=("profile", "infer"), default="profile",
                    help="the time a request spends outside the engine: the profile's (vLLM's "
                         "API server, as calibrated), or infer: fitted to the file's "
                         "lowest-concurrency rows (infer_request_latency), which the summary "
                         "then leaves out")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    every_row = read_rows(args.data)
    rows = subset(split(every_row, args.split), args.every)
    profiles = Profiles.load(args.profile)
    kv: KvChoice = args.kv_cache_dtype
    if kv == "infer":
        kv = infer_kv_dtypes(split(every_row, "cal"), profiles)
        print("KV cache dtype the benchmarks ran with (inferred from the calibration half): "
              + (", ".join(f"{g} {d}" for g, d in kv.items()) or "none"))
    probes: list[Row] = []
    if args.request_latency == "infer":
        probes = probe_rows(every_row)
        latency = infer_request_latency(probes, profiles, engine=args.engine, kv_cache_dtype=kv)
        profiles = profiles.with_overrides({}, {args.engine: latency})
        print(f"request path (inferred from the {len(probes)} rows at concurrency "
              f"{probes[0].concurrency}, left out of the summary): request_ms "
              f"{latency['request_ms']}, request_us_per_token "
              f"{latency['request_us_per_token']}")
    results = simulate_all(rows, profiles, engine=args.engine, kv_cache_dtype=kv,
                           requests_per_client=args.requests_per_client, seed=args.seed)
    print(f"{args.data}: {len(results)} rows ({args.split} split), profile "
          f"{args.profile or 'shipped'}, {args.requests_per_client} requests per client")
    probe_keys = {r.key for r in probes}
    report([r for r in results if r.row.key not in probe_keys])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
