"""`python -m simulator`: start N simulated replicas and serve until SIGINT or SIGTERM.

The only place in the package that parses argv, installs signal handlers or exits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import signal
import sys
from collections.abc import Sequence

from simulator.config import KV_EVENTS_ENCODINGS, OutputLengths
from simulator.fleet import Fleet
from simulator.lora import LoraConfig
from simulator.pd import PROTOCOLS, ROLES, PdOptions
from simulator.profiles import load_gpus, load_models
from simulator.tiers import SHARED_GBPS
from simulator.tokenizer import TokenizerJson


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m simulator",
                                description="Simulated vLLM replicas (no GPU needed).")
    p.add_argument("--replicas", type=int, default=1, help="how many replicas (default 1)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9001,
                   help="port of replica 0; replica i listens on port+i (0: ephemeral)")
    p.add_argument("--model", default="qwen2.5-14b", help=f"one of {sorted(load_models())}")
    p.add_argument("--gpu", default="a100-80g", help=f"one of {sorted(load_gpus())}")
    p.add_argument("--served-model-name", default=None,
                   help="model name clients send (default: the profile name)")
    p.add_argument("--speedup", type=float, default=1.0,
                   help="simulated seconds per wall second (default 1: real time)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="most prompt tokens one request gets in a step (vLLM's; 0: no cap)")
    p.add_argument("--max-num-partial-prefills", type=int, default=1,
                   help="vLLM's: above 1, an unset threshold becomes 4%% of max_model_len")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context window (default: the model profile's)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="GPUs per replica (default: the fewest that fit the model)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True)
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs")
    p.add_argument("--output-len", default=str(OutputLengths()),
                   help="output length when a request sets no max_tokens: fixed:N, "
                        "uniform:LO:HI or exponential:MEAN (default %(default)s)")
    p.add_argument("--step-overhead-ms", type=float, default=None,
                   help="fixed cost per engine step (default: the GPU and engine profiles')")
    p.add_argument("--weight-dtype", default="", help="bf16, fp8, int4 or mxfp4 weights "
                   "(default: the model profile's)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (16-bit) or fp8")
    p.add_argument("--prefill-attention", action="store_true",
                   help="add attention FLOPs (quadratic in context) to prefill time")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="a local tokenizer.json, or a tokenizer directory whose chat template "
                        "renders chats (default: the built-in byte tokenizer)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="with --tokenizer: a .jinja chat template to use instead of the "
                        "tokenizer's own (as vLLM's --chat-template)")
    p.add_argument("--kv-events-port", type=int, default=None, metavar="BASE",
                   help="publish KV cache events: replica i on tcp://HOST:BASE+2i, replay on "
                        "BASE+2i+1 (needs pyzmq and msgspec)")
    p.add_argument("--kv-events-encoding", choices=KV_EVENTS_ENCODINGS, default="map",
                   help="map: vLLM >= 0.24 events (default); legacy: positional arrays")
    p.add_argument("--cpu-kv-gb", type=float, default=0.0,
                   help="a host-memory KV tier per replica: GPU evictions spill there, prefixes "
                        "found there load at --cpu-kv-gbps (docs/tiers.md; default: none)")
    p.add_argument("--cpu-kv-gbps", type=float, default=50.0)
    p.add_argument("--shared-kv-gb", type=float, default=0.0,
                   help="one KV store of G GB shared by all replicas (LMCache / Mooncake "
                        "style): every computed block is written through, any replica loads "
                        "from it at --shared-kv-gbps (docs/tiers.md; default: none)")
    p.add_argument("--shared-kv-gbps", type=float, default=SHARED_GBPS)
    p.add_argument("--lora-modules", nargs="*", default=None, metavar="NAME",
                   help="serve these LoRA adapters (enables LoRA; /v1/models lists them)")
    p.add_argument("--max-loras", type=int, default=1, help="GPU adapter slots (vLLM's default 1)")
    p.add_argument("--max-cpu-loras", type=int, default=None)
    p.add_argument("--lora-load-ms", type=float, default=250.0,
                   help="time an adapter load from disk adds to the step that needs it")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower()
                   in ("1", "true"),
                   help="the /v1/load_lora_adapter and /v1/unload_lora_adapter routes "
                   "(also VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)")
    g = p.add_argument_group("prefill/decode disaggregation (docs/pd.md)")
    g.add_argument("--role", choices=ROLES, default="both",
                   help="prefill, decode, or both (default: an aggregated replica)")
    g.add_argument("--pd-protocol", choices=PROTOCOLS, default="vllm-nixl")
    g.add_argument("--kv-link-gbps", type=float, default=400.0,
                   help="P->D link bandwidth in Gb/s (default 400)")
    g.add_argument("--pd-side-channel-port", type=int, default=0, metavar="BASE",
                   help="prefill replica i's NIXL side channel / SGLang bootstrap port BASE+i "
                        "(default 0: ephemeral)")
    g.add_argument("--kv-lease-s", type=float, default=30.0,
                   help="seconds a prefill replica keeps unread KV (vLLM kv_lease_duration)")
    g.add_argument("--kv-load-failure-policy", choices=("fail", "recompute"), default="fail")
    g.add_argument("--pd-bootstrap-timeout-s", type=float, default=300.0)
    g.add_argument("--pd-waiting-timeout-s", type=float, default=300.0)
    return p


def pd_from_args(args: argparse.Namespace) -> PdOptions | None:
    if args.role == "both" and args.pd_protocol == "vllm-nixl":
        return None
    return PdOptions(args.role, args.pd_protocol, kv_link_gbps=args.kv_link_gbps,
                     side_channel_port=args.pd_side_channel_port, lease_s=args.kv_lease_s,
                     load_failure_policy=args.kv_load_failure_policy,
                     bootstrap_timeout_s=args.pd_bootstrap_timeout_s,
                     waiting_timeout_s=args.pd_waiting_timeout_s)


def lora_from_args(args: argparse.Namespace) -> LoraConfig | None:
    if args.lora_modules is None and not args.allow_runtime_lora_updating:
        return None
    return LoraConfig(tuple(args.lora_modules or ()), max_loras=args.max_loras,
                      max_cpu_loras=args.max_cpu_loras, load_s=args.lora_load_ms / 1000.0,
                      runtime_updating=args.allow_runtime_lora_updating)


def fleet_from_args(args: argparse.Namespace) -> Fleet:
    if args.chat_template and not args.tokenizer:
        raise ValueError("--chat-template needs --tokenizer")
    return Fleet(
        n=args.replicas, model=args.model, gpu=args.gpu, speedup=args.speedup, seed=args.seed,
        base_port=args.port, host=args.host, served_model_name=args.served_model_name,
        block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_num_partial_prefills=args.max_num_partial_prefills,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        output_lengths=OutputLengths.parse(args.output_len),
        step_overhead_s=None if args.step_overhead_ms is None else args.step_overhead_ms / 1000.0,
        weight_dtype=args.weight_dtype, kv_cache_dtype=args.kv_cache_dtype,
        prefill_attention=args.prefill_attention,
        tokenizer=(TokenizerJson(args.tokenizer, chat_template=args.chat_template)
                   if args.tokenizer else None),
        kv_events_port=args.kv_events_port,
        kv_events_encoding=args.kv_events_encoding,
        cpu_kv_gb=args.cpu_kv_gb or None, cpu_kv_gbps=args.cpu_kv_gbps,
        lora=lora_from_args(args), pd=pd_from_args(args),
        shared_kv_gb=args.shared_kv_gb or None, shared_kv_gbps=args.shared_kv_gbps,
    )


async def serve(fleet: Fleet) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with fleet:
        cfg = fleet.config
        for i, r in enumerate(fleet.replicas):
            print(f"replica {i} {r.url} model={r.model_name} gpu={cfg.gpu.key} "
                  f"tp={cfg.tensor_parallel_size} kv_blocks={cfg.num_blocks} "
                  f"block_size={cfg.block_size} speedup={fleet.speedup:g}", flush=True)
            if r.pd is not None and r.pd.opts.role != "decode":
                print(f"replica {i} role={r.pd.opts.role} protocol={r.pd.opts.protocol} "
                      f"side_channel={r.host}:{r.pd.port}", flush=True)
            if r.kv_events is not None:
                print(f"replica {i} kv_events={r.kv_events.endpoint} "
                      f"replay={r.kv_events.replay_endpoint} "
                      f"encoding={r.kv_events.options.encoding}", flush=True)
        if fleet.shared is not None:
            print(f"shared kv store blocks={fleet.shared.capacity} "
                  f"gbps={fleet.shared.gbps:g}", flush=True)
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.kv_events_port is not None:
        missing = [m for m in ("zmq", "msgspec") if importlib.util.find_spec(m) is None]
        if missing:
            print(f"error: --kv-events-port needs {' and '.join(missing)} "
                  "(pip install 'kvgateway[events]')", file=sys.stderr)
            return 2
    try:
        fleet = fleet_from_args(args)
    except (ValueError, OSError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop
        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover - uvloop is a dependency where it builds
        runner = asyncio.Runner()
    with runner, contextlib.suppress(KeyboardInterrupt):
        runner.run(serve(fleet))
    return 0
