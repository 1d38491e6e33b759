"""Fit the performance model's free parameters to measured closed-loop benchmarks.

    python -m simulator.calibrate DATA.csv [--split cal] [--out PROFILE.yaml]

Fits, by weighted least squares on relative error (no per-row terms, nothing looked up):

- per GPU in the data: `mbu`, the share of HBM bandwidth weight and KV reads reach;
- shared by the GPUs in the data (same tensor cores, launch path and NVLink): `mfu`,
  `layer_us` (the per-layer kernel floor of a step) and `allreduce_us` (one all-reduce's
  latency under TP);
- for the engine: `request_ms` and `request_us_per_token` (the time a request spends outside
  engine steps). `step_us_per_seq` is kept at the profile's value: with one model in the
  data it is collinear with the KV read and drives MBU to 1.

TPOT of a closed loop of c clients is one decode step of c sequences (fixed costs, weights and
KV over bandwidth) plus the prefills the others interleave (c x prefill compute / osl);
TTFT at low concurrency is the request latency plus its prefill (plus the burst of the
benchmark's first round, shared over its rounds) plus half a decode step of waiting. Both are
linear in the unknowns (1/mbu, 1/mfu, the latencies), so alternating the two fits converges in
a few rounds. Rows whose KV demand exceeds the cache (queueing, preemption) are left out of
the fit. The profile written is a YAML of `gpus:` and `engines:` fields that
`python -m simulator.fidelity --profile` and `Profiles.load` put over the shipped ones.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from simulator.config import build_config
from simulator.fidelity import (
    REQUESTS_PER_CLIENT,
    Profiles,
    Row,
    engine_options,
    read_rows,
    report,
    simulate_all,
    split,
)
from simulator.perf_model import PerfModel


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


def _perf(row: Row, profiles: Profiles, kv_cache_dtype: str) -> PerfModel:
    opts = engine_options(row, kv_cache_dtype)
    return build_config(profiles.model_for(row.model), profiles.gpu_for(row.gpu),
                        engine=profiles.engines["vllm"], **opts).perf


def fits_in_cache(row: Row, perf: PerfModel) -> bool:
    return row.concurrency * (row.isl + row.osl) <= perf.kv_capacity_tokens


def fit(rows: Sequence[Row], profiles: Profiles, *, kv_cache_dtype: str = "auto",
        rounds: int = REQUESTS_PER_CLIENT, iterations: int = 6) -> Fit:
    gpus = sorted({profiles.gpu_for(r.gpu).key for r in rows})
    first = profiles.gpus[gpus[0]]
    cur = Fit(first.mfu, {g: profiles.gpus[g].mbu for g in gpus}, first.layer_us,
              first.allreduce_us, profiles.engines["vllm"].request_ms,
              profiles.engines["vllm"].request_us_per_token,
              profiles.engines["vllm"].step_us_per_seq)
    for _ in range(iterations):
        p = profiles.with_overrides(*cur.overrides(profiles))
        perfs = [(r, _perf(r, p, kv_cache_dtype)) for r in rows]
        usable = [(r, pm) for r, pm in perfs if fits_in_cache(r, pm)]
        # TPOT: x = [layer floor (s per layer), all-reduce latency (s), 1/mbu per GPU]
        a, b, w = [], [], []
        for r, pm in usable:
            m, c = pm.model, r.concurrency
            bw = pm.gpu.hbm_bytes_per_s * pm.tp  # at MBU 1
            kv = c * (r.isl + r.osl / 2) * pm.kv_bytes_per_token_per_gpu * pm.tp
            read = pm.weight_bytes_read + kv
            prefill = c * pm.prefill_time(r.isl) / r.osl  # interleaved prefills
            known = pm.engine.step_ms * 1e-3 + prefill + c * pm.comm_s_per_token
            known += c * pm.seq_s  # the per-sequence CPU cost is not fitted (collinear with KV)
            row = [float(m.layers), 2.0 * m.layers if pm.tp > 1 else 0.0]
            row += [read / bw if pm.gpu.key == g else 0.0 for g in gpus]
            a.append(row)
            b.append(r.tpot_ms * 1e-3 - known)
            w.append(1.0 / (r.tpot_ms * 1e-3) ** 2)
        x = _solve(a, b, w)
        layer_s, ar_s = max(0.0, x[0]), max(0.0, x[1])
        mbu = {g: min(1.0, max(0.3, 1.0 / x[2 + i])) if x[2 + i] > 0 else cur.mbu[g]
               for i, g in enumerate(gpus)}
        cur = Fit(cur.mfu, mbu, layer_s * 1e6, ar_s * 1e6, cur.request_ms,
                  cur.request_us_per_token, cur.step_us_per_seq)
        p = profiles.with_overrides(*cur.overrides(profiles))
        # TTFT at low concurrency: x = [fixed latency (s), per token (s), 1/mfu]
        a, b, w = [], [], []
        for r, _ in usable:
            if r.concurrency > 8:
                continue
            pm = _perf(r, p, kv_cache_dtype)
            c = r.concurrency
            compute = pm.prefill_time(r.isl) * pm.gpu.mfu  # at MFU 1
            burst = 1.0 + (c - 1) / rounds  # the first round's prompts share one step
            decode = pm.step_time(0, c, c * (r.isl + r.osl // 2))
            known = 0.5 * decode + pm.step_overhead_s + c * pm.kv_read_s_per_token * r.isl
            a.append([1.0, float(r.isl), compute * burst])
            b.append(r.ttft_ms * 1e-3 - known)
            w.append(1.0 / (r.ttft_ms * 1e-3) ** 2)
        if a:
            y = _solve(a, b, w)
            mfu = min(1.0, max(0.1, 1.0 / y[2])) if y[2] > 0 else cur.mfu
            cur = Fit(mfu, cur.mbu, cur.layer_us, cur.allreduce_us, max(0.0, y[0] * 1e3),
                      max(0.0, y[1] * 1e6), cur.step_us_per_seq)
    return cur


def write_profile(path: str | Path, result: Fit, profiles: Profiles, source: str,
                  part: str) -> None:
    gpus, engines = result.overrides(profiles)
    header = (f"# Fitted by `python -m simulator.calibrate {source} --split {part}`.\n"
              "# Load with `python -m simulator.fidelity DATA.csv --profile THIS_FILE`.\n")
    Path(path).write_text(header + yaml.safe_dump({"gpus": gpus, "engines": engines},
                                                  sort_keys=True), "utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m simulator.calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", help="CSV of measured closed-loop benchmarks")
    ap.add_argument("--split", choices=("all", "cal", "test"), default="cal",
                    help="rows to fit on (default: the calibration half, even positions)")
    ap.add_argument("--out", default="calibrated_profile.yaml", help="profile file to write")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--check", action="store_true",
                    help="then replay the fitted rows in the DES and print the report")
    args = ap.parse_args(argv)
    profiles = Profiles.load()
    rows = split(read_rows(args.data), args.split)
    result = fit(rows, profiles, kv_cache_dtype=args.kv_cache_dtype)
    write_profile(args.out, result, profiles, args.data, args.split)
    print(f"fitted on {len(rows)} rows ({args.split} split): mfu {result.mfu:.3f}, "
          + ", ".join(f"mbu[{g}] {v:.3f}" for g, v in result.mbu.items())
          + f", layer_us {result.layer_us:.1f}, allreduce_us {result.allreduce_us:.2f}, "
          f"request_ms {result.request_ms:.1f}, request_us_per_token "
          f"{result.request_us_per_token:.2f}, step_us_per_seq {result.step_us_per_seq:.1f}")
    print(f"wrote {args.out}")
    if args.check:
        report(simulate_all(rows, Profiles.load(args.out),
                            kv_cache_dtype=args.kv_cache_dtype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
