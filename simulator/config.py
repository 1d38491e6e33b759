"""Engine configuration: vLLM-like knobs with vLLM-like defaults, validated once.

`build_config(model, gpu, **overrides)` is the one way in; the CLI, Fleet and Cluster use it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from simulator.lora import LoraConfig
from simulator.perf_model import PerfModel, auto_tp
from simulator.profiles import (
    EngineProfile,
    GpuProfile,
    ModelProfile,
    get_engine,
    get_gpu,
    get_model,
)

Scheduling = Literal["fcfs", "priority"]
KvEventsEncoding = Literal["legacy", "map"]
KV_EVENTS_ENCODINGS: tuple[str, ...] = ("legacy", "map")
DEFAULT_KV_EVENTS_BUFFER = 10_000  # vLLM's buffer_steps: batches kept for replay


@dataclass(frozen=True, slots=True)
class KvEventsOptions:
    """Where and how one replica publishes KV events (port 0: an ephemeral port).

    `legacy`: events are positional arrays (vLLM <= 0.23) and replay replies carry no topic
    frame (vLLM <= 0.25). `map`: events are maps with "type" (vLLM >= 0.24) and replay replies
    carry the topic frame (vLLM >= 0.26).
    """

    port: int = 0
    replay_port: int = 0
    encoding: KvEventsEncoding = "map"
    topic: str = ""
    buffer_steps: int = DEFAULT_KV_EVENTS_BUFFER
    tier_placeholders: bool = False  # CPU-tier events as vLLM's legacy placeholders (no tokens)

    def __post_init__(self) -> None:
        if self.encoding not in KV_EVENTS_ENCODINGS:
            raise ValueError(
                f"kv events encoding must be one of {', '.join(KV_EVENTS_ENCODINGS)}, "
                f"got {self.encoding!r}")
        if self.buffer_steps < 1:
            raise ValueError("the kv events replay buffer must hold at least one batch")
        for p in (self.port, self.replay_port):
            if not 0 <= p < 65536:
                raise ValueError(f"kv events port {p} is out of range")


@dataclass(frozen=True, slots=True)
class OutputLengths:
    """How many tokens a request generates when it does not set max_tokens.

    Spec strings: `fixed:N`, `uniform:LO:HI` (inclusive), `exponential:MEAN` (at least 1).
    """

    kind: Literal["fixed", "uniform", "exponential"] = "uniform"
    a: float = 32
    b: float = 512

    @classmethod
    def parse(cls, spec: str) -> OutputLengths:
        kind, _, rest = spec.partition(":")
        try:
            args = [float(x) for x in rest.split(":")] if rest else []
        except ValueError:
            raise ValueError(f"bad output length spec {spec!r}") from None
        if kind == "fixed" and len(args) == 1 and args[0] >= 1:
            return cls("fixed", args[0], args[0])
        if kind == "uniform" and len(args) == 2 and 1 <= args[0] <= args[1]:
            return cls("uniform", args[0], args[1])
        if kind == "exponential" and len(args) == 1 and args[0] >= 1:
            return cls("exponential", args[0], 0)
        raise ValueError(
            f"bad output length spec {spec!r}: use fixed:N, uniform:LO:HI or exponential:MEAN"
        )

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(rng.expovariate(1.0 / self.a)))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        if self.kind == "uniform":
            return f"uniform:{int(self.a)}:{int(self.b)}"
        return f"exponential:{self.a:g}"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything one simulated replica needs; `perf` is derived from the other fields."""

    model: ModelProfile
    gpu: GpuProfile
    tensor_parallel_size: int
    max_model_len: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # vLLM's cap on the prompt tokens one request gets in a step (0: none; the budget caps
    # it); with max_num_partial_prefills > 1 and no threshold given, vLLM derives 4 % of
    # max_model_len (`effective_long_prefill_token_threshold`)
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    scheduling_policy: Scheduling = "fcfs"
    output_lengths: OutputLengths = field(default_factory=OutputLengths)
    step_overhead_s: float | None = None  # None: the profiles' fixed step cost
    prefill_attention: bool = False
    overhead_gb: float | None = None
    num_gpu_blocks: int | None = None  # override the computed KV capacity (tests, what-ifs)
    engine: EngineProfile | None = None  # None: the shipped "vllm" profile
    weight_dtype: str = ""  # "": the model's; fp8 / int4 / mxfp4 for a quantized checkpoint
    kv_cache_dtype: str = "auto"  # auto (the model's 16 bits) or fp8
    jitter_cv: float | None = None  # None: the engine profile's
    lora: LoraConfig | None = None  # multi-LoRA (simulator/lora.py); None: off
    cpu_kv_gb: float = 0.0  # host-memory KV tier per replica (simulator/tiers.py); 0: none
    cpu_kv_gbps: float = 50.0  # its load bandwidth (PCIe Gen5 DMA, one direction)

    @property
    def perf(self) -> PerfModel:
        return PerfModel(
            self.model, self.gpu, tp=self.tensor_parallel_size,
            gpu_memory_utilization=self.gpu_memory_utilization, overhead_gb=self.overhead_gb,
            fixed_step_s=self.step_overhead_s, prefill_attention=self.prefill_attention,
            engine=self.engine or get_engine("vllm"), weight_dtype=self.weight_dtype,
            kv_cache_dtype=self.kv_cache_dtype,
            max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
            jitter_cv=self.jitter_cv,
        )

    @property
    def effective_long_prefill_token_threshold(self) -> int:
        """The per-request prompt-token cap of a step, as vLLM's SchedulerConfig derives it:
        the threshold given, else int(max_model_len x 0.04) when more than one partial prefill
        may run, else 0 (no cap)."""
        if self.long_prefill_token_threshold or self.max_num_partial_prefills <= 1:
            return self.long_prefill_token_threshold
        return int(self.max_model_len * 0.04)

    @property
    def num_blocks(self) -> int:
        if self.num_gpu_blocks is not None:
            return self.num_gpu_blocks
        return self.perf.num_blocks(self.block_size)

    def validate(self) -> EngineConfig:
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.long_prefill_token_threshold < 0 or self.max_num_partial_prefills < 1:
            raise ValueError("long_prefill_token_threshold must be >= 0 and "
                             "max_num_partial_prefills >= 1")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, not {self.scheduling_policy!r}")
        if self.num_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"KV cache holds {self.num_blocks * self.block_size} tokens, fewer than "
                f"max_model_len={self.max_model_len}: raise tensor_parallel_size or "
                "gpu_memory_utilization, or lower max_model_len"
            )
        return self


_OVERRIDABLE = {f.name for f in fields(EngineConfig)} - {"model", "gpu"}


VLLM_LARGE_GPU_GIB = 70.0  # vLLM's threshold for its larger API-server defaults


def vllm_batch_defaults(gpu: str | GpuProfile) -> dict[str, int]:
    """`max_num_batched_tokens` and `max_num_seqs` as `vllm serve` picks them when they are not
    given (vllm/engine/arg_utils.py, `EngineArgs.get_batch_defaults`, OpenAI API server usage
    context): 8,192 tokens and 1,024 sequences on a GPU of at least 70 GiB that is not an A100
    (H100, H200, B200, MI300X), else 2,048 and 256 (A100, L40S). The simulator's own defaults
    (`EngineConfig`: 8,192 and 256) are not these; the fidelity replay and `gateway plan` use
    these, as they model a vLLM deployment on that GPU."""
    g = get_gpu(gpu)
    seen_gib = g.memory_gib or g.memory_gb * 1e9 / 2**30
    name = f"{g.key} {g.name}".lower()
    if seen_gib >= VLLM_LARGE_GPU_GIB and "a100" not in name:
        return {"max_num_batched_tokens": 8192, "max_num_seqs": 1024}
    return {"max_num_batched_tokens": 2048, "max_num_seqs": 256}


def build_config(model: str | ModelProfile = "qwen2.5-14b", gpu: str | GpuProfile = "a100-80g",
                 **overrides: Any) -> EngineConfig:
    """Resolve profiles by name, apply overrides, pick TP when not given, validate.

    `engine` may be a profile name ("vllm") or an `EngineProfile`."""
    unknown = set(overrides) - _OVERRIDABLE
    if unknown:
        raise ValueError(f"unknown engine option(s) {sorted(unknown)}; known: {sorted(_OVERRIDABLE)}")
    m, g = get_model(model), get_gpu(gpu)
    opts = {k: v for k, v in overrides.items() if v is not None}
    if isinstance(opts.get("output_lengths"), str):
        opts["output_lengths"] = OutputLengths.parse(opts["output_lengths"])
    opts["engine"] = get_engine(opts.get("engine", "vllm"))
    max_len = int(opts.pop("max_model_len", m.max_model_len))
    tp = opts.pop("tensor_parallel_size", None)
    if tp is None:
        tp = auto_tp(m, g, max_model_len=max_len,
                     gpu_memory_utilization=opts.get("gpu_memory_utilization", 0.9),
                     overhead_gb=opts.get("overhead_gb"), engine=opts["engine"],
                     weight_dtype=opts.get("weight_dtype", ""),
                     kv_cache_dtype=opts.get("kv_cache_dtype", "auto"),
                     max_num_batched_tokens=opts.get("max_num_batched_tokens", 8192),
                     max_num_seqs=opts.get("max_num_seqs", 256))
    base = EngineConfig(model=m, gpu=g, tensor_parallel_size=int(tp), max_model_len=max_len)
    return replace(base, **opts).validate()
