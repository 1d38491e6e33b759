"""Fused decode runs: the discrete-event mode's shortcut through stretches of pure decode.

While every running request decodes and nothing can join, steps differ only in how much KV
they read, so a run of them can be priced at once and applied lazily; the result is the same
as stepping one by one (a test holds this), at a fraction of the per-token cost.

Pure arithmetic on the running sequences and the performance model: the engine decides when a
run may start (`Engine.begin_step`) and applies it (`Engine.sync`, `Engine.end_step`).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from simulator.perf_model import PerfModel, jitter_factor
from simulator.sequence import Sequence

MAX_RUN = 128  # steps priced ahead; longer runs are planned again, shorter waste less when cut


def _blocks_needed(running: Seq[Sequence], k: int, block_size: int) -> int:
    """Blocks the running sequences must still allocate to compute `k` more tokens each."""
    need = 0
    for s in running:
        extra = -(-(s.num_computed + k) // block_size) - len(s.blocks)
        if extra > 0:
            need += extra
    return need


def run_length(running: Seq[Sequence], free_blocks: int, block_size: int) -> int:
    """How many pure-decode steps `running` can take as one run (under 2: no run).

    The run stops before anything a single step would do differently: a request finishing
    (only the last step may finish one) or the cache running out of free blocks (no
    preemption inside a run). Whether a request could join is the engine's check.
    """
    k_max = min(s.target_out - len(s.output) for s in running)
    if k_max < 2:
        return k_max
    if _blocks_needed(running, k_max, block_size) > free_blocks:
        lo, hi = 1, k_max  # the largest run whose blocks fit: need(k) grows with k
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _blocks_needed(running, mid, block_size) <= free_blocks:
                lo = mid
            else:
                hi = mid - 1
        k_max = lo
    return min(k_max, MAX_RUN)


def run_times(perf: PerfModel, start_s: float, first_s: float, batch: int, kv_tokens: int,
              steps: int, *, seed: int = 0, step_no: int = 0) -> tuple[list[float], list[float]]:
    """The durations and end times of `steps` decode steps of `batch` sequences, the first
    starting at `start_s`, lasting `first_s` and reading `kv_tokens` of KV; the first is step
    number `step_no` of the engine seeded `seed` (its jitter key)."""
    # PerfModel.step_time(0, b, kv) inlined, with its float operations in the same order
    over = perf.step_overhead_s + batch * perf.comm_s_per_token + batch * perf.seq_s
    weights = perf.weight_read_time(batch)
    compute = batch * perf.prefill_s_per_token
    gemm = weights if weights >= compute else compute
    kv_s, cv = perf.kv_read_s_per_token, perf.jitter
    durations = [first_s]
    ends = [start_s + first_s]
    t = ends[0]
    for i in range(2, steps + 1):
        d = over + gemm + (kv_tokens + batch * (i - 1)) * kv_s + 0.0
        if cv:
            d *= jitter_factor(seed, step_no + i - 1, cv)
        t = t + d
        durations.append(d)
        ends.append(t)
    return durations, ends
