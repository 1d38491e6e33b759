"""Fused decode runs: the discrete-event mode's shortcut through stretches of pure decode.

While every running request decodes and nothing can join, steps differ only in how much KV
they read, so a run of them can be priced at once and applied lazily; the result is the same
as stepping one by one (a test holds this), at a fraction of the per-token cost.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from simulator.engine import Engine, Step

MAX_RUN = 128  # steps priced ahead; longer runs are planned again, shorter waste less when cut


def _blocks_needed(engine: Engine, k: int) -> int:
    """Blocks the running sequences must still allocate to compute `k` more tokens each."""
    bs = engine.config.block_size
    need = 0
    for s in engine.scheduler.running:
        extra = -(-(s.num_computed + k) // bs) - len(s.blocks)
        if extra > 0:
            need += extra
    return need


def plan(engine: Engine, step: Step, kv_tokens: int) -> Step:
    """Extend a scheduled pure-decode `step` into a run, or return it unchanged.

    The run stops before anything a single step would do differently: a request finishing
    (only the last step may finish one), a possible admission (the queue must be empty or the
    batch full), or the cache running out of free blocks (no preemption inside a run).
    """
    sched, cfg = engine.scheduler, engine.config
    running = sched.running
    if len(sched.waiting) and len(running) < cfg.max_num_seqs:
        return step
    k_max = min(s.target_out - len(s.output) for s in running)
    if k_max < 2:
        return step
    free = engine.cache.num_free
    if _blocks_needed(engine, k_max) > free:
        lo, hi = 1, k_max  # the largest run whose blocks fit: need(k) grows with k
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _blocks_needed(engine, mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        k_max = lo
        if k_max < 2:
            return step
    # PerfModel.step_time(0.0, b, kv) inlined, with its float operations in the same order
    perf, b = engine.perf, len(running)
    over, weights, kv_s = perf.step_overhead_s + 0.0, perf.weight_read_s, perf.kv_read_s_per_token
    compute = b * perf.prefill_s_per_token
    durations = [step.duration_s]
    ends = [step.start_s + step.duration_s]
    t = ends[0]
    for i in range(2, min(k_max, MAX_RUN) + 1):
        memory = weights + (kv_tokens + b * (i - 1)) * kv_s
        d = over + (memory if memory >= compute else compute)
        t = t + d
        durations.append(d)
        ends.append(t)
    return replace(step, durations=durations, ends=ends)


def materialize(engine: Engine, step: Step, j: int) -> Step:
    """Apply the first `j` steps of a run; return the rest, whose first step then begins."""
    if j <= 0:
        return step
    filler, nf = engine.filler, len(engine.filler)
    ends, durations = step.ends, step.durations
    t = ends[j - 1]
    prev_end = ends[j - 2] if j >= 2 else None
    grow = engine.scheduler.grow
    for seq in step.items:
        out = seq.output
        k0 = len(out)
        base = seq.out_base
        out.extend([filler[(base + k) % nf] for k in range(k0, k0 + j)])
        seq.num_computed += j
        seq.last_itl = t - (prev_end if prev_end is not None else seq.last_token_s)  # type: ignore[operator]
        seq.last_token_s = t
        grow(seq, 1)  # what the next step's scheduling allocates and registers
    c = engine.counters
    c.steps += j
    for d in durations[:j]:
        c.busy_time_s += d
    c.generation_tokens += j * len(step.items)
    engine.now_s = t
    rest_d, rest_e = durations[j:], ends[j:]
    if len(rest_e) == 1:
        rest_d, rest_e = [], []
    return replace(step, start_s=t, duration_s=durations[j], durations=rest_d, ends=rest_e)
