"""Fit the performance model's free parameters to measured closed-loop benchmarks.

    python -m bench.calibrate DATA.csv [--split cal] [--out PROFILE.yaml]

Fits, by weighted least squares on relative error (no per-row terms, nothing looked up):

- per GPU in the data: `mbu`, the share of HBM bandwidth weight and KV reads reach;
- shared by the GPUs in the data (same tensor cores, launch path and NVLink): `mfu`,
  `layer_us` (the per-layer kernel floor of a step) and `allreduce_us` (one all-reduce's
  latency under TP);
- for the engine: `step_us_per_seq` (CPU time per running sequence and step), `request_ms`
  and `request_us_per_token` (the time a request spends outside engine steps).

TPOT of a closed loop of c clients is one decode step of c sequences (fixed costs, weights and
KV over bandwidth, the per-sequence cost) plus the prefills the others interleave (c x prefill
compute / osl); TTFT at low concurrency is the request latency plus its prefill (plus the burst
of the benchmark's first round, shared over its rounds) plus half a decode step of waiting.
Both are linear in the unknowns (1/mbu, 1/mfu, the latencies) and are fitted together. Then
`--des-passes` passes replay the rows in the DES and refit with what the DES adds beyond the
closed forms (queueing, mixed steps, jitter), so the values are those of the simulator. Rows
whose KV demand exceeds the cache (queueing, preemption) are left out of the fit.

The KV cache dtype the benchmarks ran with is not in the CSV: `infer_kv_dtypes` picks it per
GPU from the rows that overflow the cache under some candidate (replayed under each).

The profile written is a YAML of `gpus:` and `engines:` fields that
`python -m bench.fidelity --profile` and `Profiles.load` put over the shipped ones.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.fidelity import (
    REQUESTS_PER_CLIENT,
    KvChoice,
    Profiles,
    Row,
    fits_in_cache,
    infer_kv_dtypes,
    perf_of,
    read_rows,
    report,
    simulate_all,
    split,
)
from simulator.perf_model import PerfModel

DES_PASSES = 3  # refits against the DES (each replays the rows once: ~10 s)


def _solve(a: list[list[float]], b: list[float], w: list[float]) -> list[float]:
    """Weighted least squares: minimise sum w_i (a_i . x - b_i)^2 (normal equations)."""
    n = len(a[0])
    m = [[sum(wi * ai[r] * ai[c] for ai, wi in zip(a, w, strict=True)) for c in range(n)]
         for r in range(n)]
    v = [sum(wi * ai[r] * bi for ai, bi, wi in zip(a, b, w, strict=True)) for r in range(n)]
    for r in range(n):
        m[r][r] += 1e-12  # keeps a column the rows do not excite solvable
    for col in range(n):  # Gaussian elimination with partial pivoting
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[piv], v[col], v[piv] = m[piv], m[col], v[piv], v[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n):
                m[r][c] -= f * m[col][c]
            v[r] -= f * v[col]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (v[r] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


@dataclass
class Fit:
    """The fitted values (what the profile file gets)."""

    mfu: float
    mbu: dict[str, float]
    layer_us: float
    allreduce_us: float
    request_ms: float
    request_us_per_token: float
    step_us_per_seq: float

    def overrides(self, profiles: Profiles) -> tuple[dict[str, dict[str, float]],
                                                     dict[str, dict[str, float]]]:
        gpus = {g: {"mfu": round(self.mfu, 4), "mbu": round(mbu, 4),
                    "layer_us": round(self.layer_us, 2),
                    "allreduce_us": round(self.allreduce_us, 2)}
                for g, mbu in self.mbu.items()}
        engines = {"vllm": {"request_ms": round(self.request_ms, 2),
                            "request_us_per_token": round(self.request_us_per_token, 3),
                            "step_us_per_seq": round(self.step_us_per_seq, 2)}}
        return gpus, engines


def _vector(f: Fit, gpus: Sequence[str]) -> list[float]:
    """The fit as the unknowns of the least squares."""
    return ([f.layer_us * 1e-6, f.allreduce_us * 1e-6] + [1.0 / f.mbu[g] for g in gpus]
            + [f.step_us_per_seq * 1e-6, 1.0 / f.mfu, f.request_ms * 1e-3,
               f.request_us_per_token * 1e-6])


def _equations(r: Row, pm: PerfModel, gpus: Sequence[str], rounds: int
               ) -> list[tuple[str, list[float], float, float]]:
    """("tpot" | "ttft", coefficients, known seconds, measured seconds) of one row.

    x = [layer floor (s), all-reduce (s), 1/mbu per GPU, s per sequence, 1/mfu, request
    latency (s), request latency per prompt token (s)]."""
    m, c, g = pm.model, r.concurrency, pm.gpu
    bw = g.hbm_bytes_per_s * pm.tp  # at MBU 1
    kv = c * (r.isl + r.osl / 2) * pm.kv_read_bytes_per_token_per_gpu * pm.tp
    compute = pm.prefill_time(r.isl) * g.mfu  # one prompt's prefill at MFU 1
    # TPOT: one decode step of c sequences + the c prefills interleaved per osl steps
    tpot = [float(m.layers), 2.0 * m.layers if pm.tp > 1 else 0.0]
    tpot += [(pm.weight_bytes_read + kv) / bw if g.key == k else 0.0 for k in gpus]
    tpot += [float(c), c * compute / r.osl, 0.0, 0.0]
    out = [("tpot", tpot, pm.engine.step_ms * 1e-3 + c * pm.comm_s_per_token,
            r.tpot_ms * 1e-3)]
    if c <= 8:
        # TTFT: latency + prefill (the first round's burst queues its prompts) + the wait
        # for the decode step in flight
        burst = 1.0 + (c - 1) / rounds
        decode = pm.step_time(0, c, c * (r.isl + r.osl // 2))
        ttft = [0.0] * (2 + len(gpus)) + [0.0, compute * burst, 1.0, float(r.isl)]
        out.append(("ttft", ttft, 0.5 * decode + pm.step_overhead_s, r.ttft_ms * 1e-3))
    return out


def fit(rows: Sequence[Row], profiles: Profiles, *, kv_cache_dtype: KvChoice = "benchmark",
        rounds: int = REQUESTS_PER_CLIENT, iterations: int = 6, des_passes: int = 0) -> Fit:
    """One weighted least-squares fit of TPOT (every row that fits in the cache) and TTFT
    (rows of at most 8 clients) together; the terms that depend on the fit itself (the wait
    for a decode step) are refreshed over a few iterations.

    With `des_passes`, each pass then replays the rows in the DES with the fit so far and
    adds what the DES gives beyond the closed-form terms (queueing between clients, mixed
    steps, jitter) to the known part of each equation before fitting again, so the fit is
    that of the simulator the fidelity report runs."""
    gpus = sorted({profiles.gpu_for(r.gpu).key for r in rows})
    first, eng = profiles.gpus[gpus[0]], profiles.engines["vllm"]
    cur = Fit(first.mfu, {g: profiles.gpus[g].mbu for g in gpus}, first.layer_us,
              first.allreduce_us, eng.request_ms, eng.request_us_per_token, eng.step_us_per_seq)
    n_g = len(gpus)
    extra: dict[tuple[Any, ...], dict[str, float]] = {}  # DES minus closed form, per row
    for pass_no in range(des_passes + 1):
        for _ in range(iterations):
            p = profiles.with_overrides(*cur.overrides(profiles))
            a, b, w = [], [], []
            for r in rows:
                pm = perf_of(r, p, kv_cache_dtype)
                if not fits_in_cache(r, pm):
                    continue  # queueing and preemption: not a closed form
                for kind, coef, known, measured in _equations(r, pm, gpus, rounds):
                    a.append(coef)
                    b.append(measured - known - extra.get(r.key, {}).get(kind, 0.0))
                    w.append(1.0 / measured ** 2)
            x = _solve(a, b, w)
            inv_mfu = x[3 + n_g]
            cur = Fit(min(1.0, max(0.1, 1.0 / inv_mfu)) if inv_mfu > 0 else cur.mfu,
                      {k: min(1.0, max(0.3, 1.0 / x[2 + i])) if x[2 + i] > 0 else cur.mbu[k]
                       for i, k in enumerate(gpus)},
                      max(0.0, x[0]) * 1e6, max(0.0, x[1]) * 1e6, max(0.0, x[4 + n_g]) * 1e3,
                      max(0.0, x[5 + n_g]) * 1e6, max(0.0, x[2 + n_g]) * 1e6)
        if pass_no == des_passes:
            break
        p = profiles.with_overrides(*cur.overrides(profiles))
        fitting = [r for r in rows if fits_in_cache(r, perf_of(r, p, kv_cache_dtype))]
        xv = _vector(cur, gpus)
        for res in simulate_all(fitting, p, kv_cache_dtype=kv_cache_dtype):
            r = res.row
            sim = {"tpot": res.tpot_ms * 1e-3, "ttft": res.ttft_ms * 1e-3}
            eqs = _equations(r, perf_of(r, p, kv_cache_dtype), gpus, rounds)
            extra[r.key] = {kind: sim[kind] - known
                            - sum(ci * xi for ci, xi in zip(coef, xv, strict=True))
                            for kind, coef, known, _ in eqs}
    return cur


def write_profile(path: str | Path, result: Fit, profiles: Profiles, source: str,
                  part: str) -> None:
    gpus, engines = result.overrides(profiles)
    header = (f"# Fitted by `python -m bench.calibrate {source} --split {part}`.\n"
              "# Load with `python -m bench.fidelity DATA.csv --profile THIS_FILE`.\n")
    Path(path).write_text(header + yaml.safe_dump({"gpus": gpus, "engines": engines},
                                                  sort_keys=True), "utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", help="CSV of measured closed-loop benchmarks")
    ap.add_argument("--split", choices=("all", "cal", "test"), default="cal",
                    help="rows to fit on (default: the calibration half, even positions)")
    ap.add_argument("--out", default="calibrated_profile.yaml", help="profile file to write")
    ap.add_argument("--kv-cache-dtype", default="infer",
                    help="auto, fp8, infer (default: per GPU, from the rows fitted on that "
                         "overflow the cache under some dtype) or benchmark (the shipped data's)")
    ap.add_argument("--des-passes", type=int, default=DES_PASSES,
                    help="passes that refit against the DES's replay of the rows (0: closed "
                         "form only)")
    ap.add_argument("--check", action="store_true",
                    help="then replay the fitted rows in the DES and print the report")
    args = ap.parse_args(argv)
    profiles = Profiles.load()
    rows = split(read_rows(args.data), args.split)
    kv: KvChoice = args.kv_cache_dtype
    if kv == "infer":
        kv = infer_kv_dtypes(rows, profiles)
        print("KV cache dtype the benchmarks ran with (inferred): "
              + (", ".join(f"{g} {d}" for g, d in kv.items()) or "none"))
    result = fit(rows, profiles, kv_cache_dtype=kv,
                 des_passes=args.des_passes)
    write_profile(args.out, result, profiles, args.data, args.split)
    print(f"fitted on {len(rows)} rows ({args.split} split): mfu {result.mfu:.3f}, "
          + ", ".join(f"mbu[{g}] {v:.3f}" for g, v in result.mbu.items())
          + f", layer_us {result.layer_us:.1f}, allreduce_us {result.allreduce_us:.2f}, "
          f"request_ms {result.request_ms:.1f}, request_us_per_token "
          f"{result.request_us_per_token:.2f}, step_us_per_seq {result.step_us_per_seq:.1f}")
    print(f"wrote {args.out}")
    if args.check:
        report(simulate_all(rows, Profiles.load(args.out),
                            kv_cache_dtype=kv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
