"""P/D benchmark: aggregated vs prefill/decode-disaggregated fleets at equal GPUs, in the DES.

Three seeded workloads (docs/pd.md): (a) long prompts (8-32K) with short outputs, (b) short
prompts with long outputs, (c) chat with 10 % 64K+ prompts. Each runs on 8 GPUs as 8 aggregated
replicas and as xPyD splits (simulator/pd_des.py: the KV crosses a 400 Gb/s link per decode
replica). Requests are routed by the gateway's production routing code (bench/routing_routers.py
DesRouter: the OpenAI body parsed, hashed, matched against the index and ranked by the policy):
over all replicas when aggregated, over the prefill replicas when disaggregated; the decode
replica is chosen by the gateway's decode-side ranking (policies/pd_decode.py: decode batch and
KV headroom). Printed per layout: TTFT and TPOT P50/P99, output tokens/s, goodput (requests/s
meeting TTFT <= 2 s and TPOT <= 50 ms), the share meeting the SLO; then the goals.

    .venv/bin/python -m bench.pd              # all three workloads, ~1 min
    .venv/bin/python -m bench.pd --quick      # 120 requests each, ~15 s
    .venv/bin/python -m bench.pd --workload chat_mix --policy prefix_aware
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench.routing_routers import GATEWAY_DEFAULT, DesRouter
from policies.pd_decode import rank_decode
from policies.types import ReplicaView, RoutedRequest
from simulator.des import ReplicaLoad, SimRequest
from simulator.engine import Engine
from simulator.plan_pd import Layout, PdWorkload, Slo, evaluate, table, verdict

MODEL, GPU, GPUS = "llama-3.1-70b", "h200", 8  # fp8 weights and KV: one GPU per replica
ENGINE: dict[str, Any] = {"weight_dtype": "fp8", "kv_cache_dtype": "fp8"}
WORKLOADS = {
    "long_prompt": (PdWorkload("long_prompt", (8192, 32768), (16, 64), rate=1.5, requests=200),
                    (Layout(4, 4), Layout(6, 2))),
    "long_output": (PdWorkload("long_output", (200, 800), (500, 1500), rate=6.0, requests=300),
                    (Layout(2, 6), Layout(4, 4), Layout(6, 2))),
    "chat_mix": (PdWorkload("chat_mix", (300, 2000), (100, 400), rate=4.0, requests=400,
                            long_share=0.1), (Layout(4, 4), Layout(6, 2), Layout(7, 1))),
}
QUICK = 120


def decode_picker(req: SimRequest, view: Sequence[ReplicaLoad], engines: Sequence[Engine]) -> int:
    """The gateway's decode-side ranking (policies/pd_decode.py) over the decode engines."""
    cfg = engines[0].config
    routed = RoutedRequest(req.id, "bench-model", "", "pd", len(req.prompt_tokens), (),
                           float(cfg.block_size), req.max_tokens)
    views = [ReplicaView(f"d{v.index}", max_inflight=cfg.max_num_seqs, waiting=v.waiting,
                         running=v.running, kv_usage=v.kv_usage, inflight=v.running + v.waiting)
             for v in view]
    kv = {f"d{i}": cfg.num_blocks * cfg.block_size for i in range(len(engines))}
    ranked = rank_decode(routed, views, kv).ranked
    return int(ranked[0][1:]) if ranked else min(view, key=lambda v: v.running).index


async def run_workload(name: str, policy: str, requests: int | None, seed: int,
                       ) -> dict[str, dict[str, float]]:
    w, splits = WORKLOADS[name]
    if requests is not None:
        w = PdWorkload(w.name, w.prompt, w.output, w.rate, requests, w.long_share,
                       w.long_prompt, w.long_output)
    trace = w.trace(seed)
    out: dict[str, dict[str, float]] = {}
    for lay in (Layout(0, GPUS), *splits):
        def router(n: int, kv: int) -> DesRouter:
            return DesRouter(policy, n, seed=seed, kv_tokens=kv)
        out[lay.name] = await evaluate(w, lay, model=MODEL, gpu=GPU, slo=Slo(), seed=seed,
                                       router=router, decode_picker=decode_picker,
                                       trace=trace, **ENGINE)
    return out


def goals(name: str, res: dict[str, dict[str, float]]) -> list[str]:
    agg = res[f"agg x{GPUS}"]
    split = max((n for n in res if not n.startswith("agg")), key=lambda n: res[n]["goodput"])
    s = res[split]
    lines = [f"  best split {split}: TPOT P99 {agg['tpot_p99'] / s['tpot_p99']:.1f}x lower, "
             f"goodput {s['goodput'] / agg['goodput']:.2f}x"]
    if name == "chat_mix":
        ok = agg["tpot_p99"] / s["tpot_p99"] >= 3 and s["goodput"] / agg["goodput"] >= 1.5
        lines.append(f"  goal (TPOT P99 >= 3x lower, goodput >= 1.5x): {'MET' if ok else 'MISSED'}")
    says = verdict(res)  # the planner's rule (gateway plan --pd)
    lines.append(f"  planner: {says}")
    if name == "long_output":
        ok = says.startswith("prefer aggregated")
        lines.append(f"  goal (the planner prefers aggregated): {'MET' if ok else 'MISSED'}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pd", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="all", choices=("all", *WORKLOADS))
    ap.add_argument("--policy", default=GATEWAY_DEFAULT, help="the prefill-side policy "
                    f"(default: the gateway's, {GATEWAY_DEFAULT})")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help=f"{QUICK} requests per workload")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    print(f"{MODEL} on {GPU} (fp8 weights and KV), {GPUS} GPUs, TP 1; SLO TTFT <= 2 s, "
          f"TPOT <= 50 ms; prefill policy {args.policy}, decode policy pd_decode")
    t0 = time.perf_counter()
    for name in names:
        w = WORKLOADS[name][0]
        res = asyncio.run(run_workload(name, args.policy, QUICK if args.quick else args.requests,
                                       args.seed))
        print(f"\n{name}: prompts {w.prompt[0]}-{w.prompt[1]}, outputs {w.output[0]}-"
              f"{w.output[1]}" + (f", {w.long_share:.0%} at {w.long_prompt[0]}+" if
                                  w.long_share else "") + f", {w.rate:g} req/s")
        print(table(res))
        print("\n".join(goals(name, res)))
    print(f"\ndone in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
