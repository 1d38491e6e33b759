"""`gateway plan`: capacity planning from the simulator's performance model and profiles.

For a model on a GPU kind it prints what one replica (one TP group) holds and how fast it runs:
KV bytes per token, KV capacity, concurrent sequences at the given lengths, the TPOT floor,
prefill time per 1K tokens, and, given a request rate and SLOs, the replicas needed. Every figure
comes from `PerfModel` as `EngineConfig` builds it, so the planner follows the model (and the
calibrated profiles) as they change; nothing here is a formula of its own except the TPOT floor
(bytes a decode step reads over the peak HBM bandwidth, the seeds' physical lower bound) and the
steady state of a replica at a fixed batch (below).

Steady state at batch b (continuous batching, chunked prefill): each of the b sequences decodes one
token per step, and the prompts of the requests that replace finished ones are prefilled beside
the decodes, b x P / O prompt tokens per step on average. So a step costs
`step_time(ceil(b P / O), b, b x context)`, that is the TPOT, and the replica completes
b / (O x TPOT) requests per second. TTFT at that load: the request latency outside the engine,
half a running step, then the steps that prefill its prompt. The largest b that fits the KV cache,
`max_num_seqs` and both SLOs sets the throughput of a replica; replicas = ceil(rate / that).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from simulator.config import EngineConfig, vllm_batch_defaults
from simulator.perf_model import TP_CHOICES, PerfModel
from simulator.profiles import get_gpu, get_model, load_gpus, load_models

__all__ = ["BatchPoint", "Plan", "PlanRequest", "main", "make_plan", "parse_duration", "render"]

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(ms|s)?\s*$")


def parse_duration(text: str) -> float:
    """Seconds from `2`, `2s`, `0.5 s` or `50ms`."""
    m = _DURATION.match(text)
    if m is None:
        raise ValueError(f"not a duration: {text!r} (use seconds, like 2 or 0.5s, or 50ms)")
    value = float(m.group(1))
    return value / 1000.0 if m.group(2) == "ms" else value


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """What the operator asked about; `None` fields were not given."""

    model: str
    gpu: str
    tp: int | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    rate: float | None = None  # requests per second, over the whole deployment
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    gpu_memory_utilization: float = 0.9
    overhead_gb: float | None = None  # the seeds' flat per-GPU overhead; None: the engine's rule
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "output_tokens", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < (0 if name == "prompt_tokens" else 1):
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("--rate must be a positive number of requests per second")
        for name in ("ttft_slo_s", "tpot_slo_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"--{name[:4]}-slo must be a positive duration")
        if self.rate is not None and (self.prompt_tokens is None or self.output_tokens is None):
            raise ValueError("--rate needs --prompt-tokens and --output-tokens")

    @property
    def seq_len(self) -> int | None:
        """Tokens one request holds at its end, when the lengths are given."""
        if self.prompt_tokens is None and self.output_tokens is None:
            return None
        return (self.prompt_tokens or 0) + (self.output_tokens or 0)


@dataclass(frozen=True, slots=True)
class BatchPoint:
    """One replica in steady state at `batch` running sequences."""

    batch: int
    tpot_floor_s: float  # the bytes of a decode step over peak HBM bandwidth
    tpot_s: float  # the modelled step, prefill of the arriving prompts included
    ttft_s: float
    requests_per_s: float
    output_tokens_per_s: float


@dataclass(frozen=True, slots=True)
class Plan:
    request: PlanRequest
    perf: PerfModel
    tp: int
    max_model_len: int
    max_num_seqs: int
    fits: bool  # the KV cache holds one max_model_len sequence
    context_tokens: float  # mean context of a decoding sequence
    concurrency: float  # sequences of seq_len the KV cache holds
    smallest_tp: int | None  # the smallest TP that fits; None: not even the largest
    points: list[BatchPoint] = field(default_factory=list)  # batch 1, 2, 4, ... up to the cap
    best: BatchPoint | None = None  # the largest batch meeting the SLOs
    replicas: int | None = None
    why_none: str = ""  # when no batch meets the SLOs

    @property
    def kv_bytes_per_token(self) -> float:
        return self.perf.kv_bytes_per_token

    @property
    def kv_capacity_bytes(self) -> float:
        return max(0.0, self.perf.kv_capacity_bytes)

    @property
    def prefill_s_per_1k(self) -> float:
        return self.perf.prefill_time(1000)

    @property
    def tpot_floor_s(self) -> float:
        """Batch 1 (the seeds' figure: weights over bandwidth, plus one sequence's KV)."""
        return tpot_floor(self.perf, 1, self.context_tokens)


def tpot_floor(pm: PerfModel, batch: int, context: float) -> float:
    """The physical lower bound of a decode step: every GPU of the group reads its share of the
    weights and of the batch's KV once, at its datasheet HBM bandwidth (no efficiency factor)."""
    read = pm.weight_bytes_per_gpu + batch * context * pm.kv_bytes_per_token_per_gpu
    return read / pm.gpu.hbm_bytes_per_s


def _engine(req: PlanRequest, tp: int, max_model_len: int) -> EngineConfig:
    """`vllm serve` on this GPU: its batch defaults (`vllm_batch_defaults`: 8,192 tokens and
    1,024 sequences on H100/H200/B200/MI300X, 2,048 and 256 on A100 and L40S)."""
    batch = vllm_batch_defaults(req.gpu)
    return EngineConfig(
        model=get_model(req.model),
        gpu=get_gpu(req.gpu),
        tensor_parallel_size=tp,
        max_model_len=max_model_len,
        gpu_memory_utilization=req.gpu_memory_utilization,
        overhead_gb=req.overhead_gb,
        max_num_batched_tokens=batch["max_num_batched_tokens"],
        max_num_seqs=batch["max_num_seqs"],
    )


def _point(
    pm: PerfModel, batch: int, prompt: int, output: int, context: float, chunk: int
) -> BatchPoint:
    kv = int(batch * context)
    arriving = math.ceil(batch * prompt / output) if prompt else 0
    tpot = pm.step_time(arriving, batch, kv)
    steps = max(1, math.ceil(prompt / chunk)) if prompt else 1
    own = pm.step_time(min(prompt, chunk), batch, kv)
    ttft = pm.request_latency_s(prompt) + 0.5 * tpot + steps * own
    rps = batch / (output * tpot)
    return BatchPoint(batch, tpot_floor(pm, batch, context), tpot, ttft, rps, rps * output)


def _batches(cap: int) -> list[int]:
    out = [1]
    while out[-1] * 2 < cap:
        out.append(out[-1] * 2)
    return sorted({*out, cap}) if cap >= 1 else []


def make_plan(req: PlanRequest) -> Plan:
    model = get_model(req.model)
    get_gpu(req.gpu)  # an unknown name fails here, naming the known ones
    max_len = req.max_model_len or req.seq_len or model.max_model_len
    smallest = next(  # the smallest group whose KV cache holds one max_model_len sequence
        (t for t in TP_CHOICES if _engine(req, t, max_len).perf.kv_capacity_tokens >= max_len),
        None,
    )
    tp = req.tp or smallest or TP_CHOICES[-1]
    engine = _engine(req, tp, max_len)
    pm = engine.perf
    fits = pm.kv_capacity_tokens >= max_len
    seq = req.seq_len or max_len
    prompt, output = req.prompt_tokens or 0, req.output_tokens or 0
    context = prompt + output / 2 if req.seq_len else 0.0
    concurrency = pm.max_concurrency(seq) if fits else 0.0
    plan = Plan(req, pm, tp, max_len, engine.max_num_seqs, fits, context, concurrency, smallest)
    if not fits or not output:
        return plan
    cap = min(int(concurrency), engine.max_num_seqs)
    chunk = max(1, engine.max_num_batched_tokens - 1)
    every = [_point(pm, b, prompt, output, context, chunk) for b in range(1, cap + 1)]
    shown = set(_batches(cap))
    meets = [
        p
        for p in every
        if (req.tpot_slo_s is None or p.tpot_s <= req.tpot_slo_s)
        and (req.ttft_slo_s is None or p.ttft_s <= req.ttft_slo_s)
    ]
    best = meets[-1] if meets else None
    why = ""
    if best is None and every:
        one = every[0]
        why = (
            f"even one sequence misses the SLOs (TTFT {_ms(one.ttft_s)}, TPOT {_ms(one.tpot_s)}): "
            "raise --tp, pick a faster GPU, or shorten the prompts"
        )
    elif not every:
        why = "the KV cache holds no whole sequence of these lengths"
    if best is not None:
        shown.add(best.batch)
    replicas = None
    if best is not None and req.rate is not None:
        replicas = max(1, math.ceil(req.rate / best.requests_per_s - 1e-9))
    return Plan(
        req, pm, tp, max_len, engine.max_num_seqs, fits, context, concurrency, smallest,
        [p for p in every if p.batch in shown], best, replicas, why,
    )  # fmt: skip


# --- the text ------------------------------------------------------------------------------------


def _ms(s: float) -> str:
    return f"{s * 1000:.1f} ms" if s < 10 else f"{s:.1f} s"


def _gb(b: float) -> str:
    return f"{b / 1e9:.1f} GB"


def render(plan: Plan) -> str:
    req, pm = plan.request, plan.perf
    g = pm.gpu
    lines = [
        f"{pm.model.name} on {plan.tp} x {g.key} ({g.name or g.key}), max_model_len {plan.max_model_len:,}",
        f"  weights                   {_gb(pm.weight_bytes_per_gpu)} per GPU",
        f"  KV bytes per token        {pm.kv_bytes_per_token:,.0f} B ({pm.kv_bytes_per_token / 1024:,.1f} KiB)"
        + (f", {pm.kv_bytes_per_token_per_gpu:,.0f} B per GPU" if plan.tp > 1 else ""),
    ]  # fmt: skip
    if plan.fits:
        lines.append(
            f"  KV capacity               {_gb(plan.kv_capacity_bytes)} ({pm.kv_capacity_tokens:,} tokens)"
        )
        seq = req.seq_len or plan.max_model_len
        lengths = (
            f"prompt {req.prompt_tokens or 0:,} + output {req.output_tokens or 0:,}"
            if req.seq_len
            else "max_model_len"
        )
        lines.append(
            f"  max concurrent sequences  {plan.concurrency:.1f} of {seq:,} tokens ({lengths}); "
            f"max_num_seqs {plan.max_num_seqs}"
        )
    else:
        usable = pm.gpu.memory_bytes * req.gpu_memory_utilization
        lines.append(
            f"  does not fit: {_gb(pm.weight_bytes_per_gpu)} of weights per GPU in {_gb(usable)} "
            f"usable leave {_gb(pm.kv_capacity_bytes_per_gpu)} for KV, short of one "
            f"{plan.max_model_len:,}-token sequence; "
            + (f"--tp {plan.smallest_tp} fits" if plan.smallest_tp else "no TP size fits")
        )
    lines.append(f"  prefill                   {_ms(plan.prefill_s_per_1k)} per 1K prompt tokens")
    context = (
        f"{plan.context_tokens:,.0f} tokens of context" if plan.context_tokens else "empty context"
    )
    lines.append(
        f"  TPOT floor                {_ms(plan.tpot_floor_s)} at batch 1, {context} "
        "(weights + KV read at peak HBM bandwidth)"
    )
    if plan.points:
        lines += [
            "",
            "  steady state of one replica at a batch (model: mean TPOT with the arriving prompts'",
            "  prefill; TTFT without queueing)",
            "  batch  TPOT floor  TPOT model  TTFT model  req/s/replica  output tok/s",
        ]
        for p in plan.points:
            mark = (
                "  <- the SLOs' largest batch" if plan.best is not None and p is plan.best else ""
            )
            lines.append(
                f"  {p.batch:5d}  {_ms(p.tpot_floor_s):>10}  {_ms(p.tpot_s):>10}  "
                f"{_ms(p.ttft_s):>10}  {p.requests_per_s:13.2f}  {p.output_tokens_per_s:12.0f}{mark}"
            )
    lines += _verdict(plan)
    return "\n".join(lines) + "\n"


def _verdict(plan: Plan) -> list[str]:
    req = plan.request
    slos = [
        f"{name} <= {_ms(v)}"
        for name, v in (("TTFT", req.ttft_slo_s), ("TPOT", req.tpot_slo_s))
        if v
    ]
    under = f" under {', '.join(slos)}" if slos else ""
    if not plan.fits:
        return []
    if plan.best is None:
        return ["", f"  no batch meets the SLOs: {plan.why_none}"] if plan.why_none else []
    b = plan.best
    out = [
        "",
        f"  per replica{under}: batch {b.batch}, {b.requests_per_s:.2f} req/s, "
        f"TPOT {_ms(b.tpot_s)}, TTFT {_ms(b.ttft_s)}",
    ]
    if plan.replicas is not None and req.rate is not None:
        out.append(
            f"  replicas for {req.rate:g} req/s: {plan.replicas} ({plan.replicas * plan.tp} GPUs); "
            "at that load each runs at its limit, so add headroom for bursts"
        )
    return out


# --- the command ---------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gateway plan",
        description="Capacity planning from the simulator's performance model: what one replica "
        "of a model on a GPU holds, how fast it runs, and how many replicas a rate needs.",
    )
    p.add_argument("--model", required=True, help=f"one of {', '.join(sorted(load_models()))}")
    p.add_argument("--gpu", required=True, help=f"one of {', '.join(sorted(load_gpus()))}")
    p.add_argument("--tp", type=int, choices=TP_CHOICES, help="tensor parallel size (default: "
                   "the smallest that holds one max_model_len sequence)")  # fmt: skip
    p.add_argument("--prompt-tokens", type=int, help="prompt length of a request")
    p.add_argument("--output-tokens", type=int, help="output length of a request")
    p.add_argument("--rate", type=float, help="requests per second over all replicas")
    p.add_argument("--ttft-slo", type=parse_duration, help="e.g. 1s or 500ms")
    p.add_argument("--tpot-slo", type=parse_duration, help="e.g. 50ms")
    p.add_argument("--max-model-len", type=int, help="default: prompt + output, else the model's")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--overhead-gb", type=float, help="flat per-GPU overhead in GB (the seeds' "
                   "rule: memory x utilisation - weights - overhead); default: the engine's rule")  # fmt: skip
    g = p.add_argument_group("aggregated vs prefill/decode splits (simulator/plan_pd.py, docs/pd.md)")
    g.add_argument("--pd", action="store_true", help="replay the workload in the DES on --gpus "
                   "GPUs, aggregated and as every xPyD split; print the best of each")
    g.add_argument("--gpus", type=int, default=8, help="GPU budget for --pd (default 8)")
    g.add_argument("--prompt-range", metavar="LO:HI", help="--pd: uniform prompt lengths "
                   "(default: --prompt-tokens)")
    g.add_argument("--output-range", metavar="LO:HI", help="--pd: uniform output lengths")
    g.add_argument("--long-share", type=float, default=0.0,
                   help="--pd: share of requests with --long-prompt-range prompts")
    g.add_argument("--long-prompt-range", metavar="LO:HI", default="65536:98304")
    g.add_argument("--requests", type=int, default=400, help="--pd: trace length")
    g.add_argument("--kv-link-gbps", type=float, default=400.0)
    g.add_argument("--weight-dtype", default="", help="--pd: fp8 / int4 / mxfp4 weights")
    g.add_argument("--kv-cache-dtype", default="auto", help="--pd: auto or fp8")
    g.add_argument("--seed", type=int, default=0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.pd:
        from simulator.plan_pd import cli_main

        return cli_main(args)
    try:
        req = PlanRequest(
            args.model, args.gpu, args.tp, args.prompt_tokens, args.output_tokens, args.rate,
            args.ttft_slo, args.tpot_slo, args.gpu_memory_utilization, args.overhead_gb,
            args.max_model_len,
        )  # fmt: skip
        plan = make_plan(req)
    except ValueError as exc:
        print(f"gateway plan: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(render(plan))
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
