"""The performance model: KV capacity from memory, step time from FLOP/s, HBM and links.

Formulas are the ones DESIGN.md and the seeds give, plus the terms a real engine adds (fixed
per-step and per-request costs, TP communication, quantized weights, FP8 KV); every figure
is per replica (one TP group). docs/simulator.md lists each parameter and where it came from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from simulator.profiles import (
    DTYPE_BYTES,
    GB,
    GIB,
    EngineProfile,
    GpuProfile,
    ModelProfile,
    get_engine,
)

TP_CHOICES = (1, 2, 4, 8)
ACT_BYTES = 2  # activations are BF16 whatever the weights are
_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of `x`."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def jitter_factor(seed: int, step_no: int, cv: float) -> float:
    """The seeded multiplicative noise of step `step_no`: mean 1, standard deviation `cv`.

    A pure function of (seed, step number), so a fused decode run prices its steps exactly as
    stepping one by one would. Normal by Box-Muller, clipped at 3 sigma (and at 0.2).
    """
    if cv <= 0.0:
        return 1.0
    h = _mix((seed & 0xFFFFFFFF) << 32 ^ step_no)
    u1 = ((h >> 11) + 1) / 9007199254740993.0  # (0, 1]
    u2 = (_mix(h) >> 11) / 9007199254740992.0
    z = math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)
    return max(0.2, 1.0 + cv * max(-3.0, min(3.0, z)))


def _default_engine() -> EngineProfile:
    return get_engine("vllm")


@dataclass(frozen=True, slots=True)
class PerfModel:
    """Memory and time for one replica: `tp` GPUs of one kind serving one model.

    Memory (per GPU):
    - KV per token = 2 x layers x kv_heads x head_dim x KV dtype bytes (sharded over TP; KV
      heads are replicated when there are fewer of them than GPUs; MLA: layers x latent dim,
      replicated on every GPU).
    - KV capacity, the engine's rule: total memory (GiB as the engine counts it) x
      `gpu_memory_utilization` - weights / tp - activation peak of a `max_num_batched_tokens`
      forward - non-torch memory. GPU profiles without `memory_gib`, or an explicit
      `overhead_gb`, use the seeds' rule: decimal GB x utilisation - weights - flat overhead.

    Time (per step):
    - matmuls: max(tokens x 2 x active params / (peak of the weight dtype x MFU x tp),
      weights read / (HBM x MBU x tp)): one weight read serves the prefill and the decodes of
      a step together. MoE reads only the experts the step's tokens route to.
    - attention: decode reads each sequence's KV (bandwidth; FP8 KV at the cost of 16-bit,
      see `kv_read_bytes_per_token_per_gpu`); prefill attention FLOPs are added with
      `prefill_attention`.
    - fixed: the engine's CPU work per step (a part per running sequence: sampling, output)
      + layers x a per-layer kernel floor; under TP,
      2 all-reduces per layer, each a latency plus its bytes over the interconnect.
    - a seeded jitter (`jitter_cv`) multiplies the step, so closed-loop clients drift apart
      as they do on real GPUs.
    A request also pays a fixed latency outside the engine (API server, tokenisation):
    `request_latency_s(prompt_tokens)`.
    """

    model: ModelProfile
    gpu: GpuProfile
    tp: int = 1
    gpu_memory_utilization: float = 0.9
    overhead_gb: float | None = None  # None: the engine's rule (or the GPU's flat figure)
    fixed_step_s: float | None = None  # None: engine step_ms + layers x layer_us + TP
    prefill_attention: bool = False
    engine: EngineProfile = field(default_factory=_default_engine)
    weight_dtype: str = ""  # "": the model profile's (2-byte unless it says otherwise)
    kv_cache_dtype: str = "auto"  # auto: the model's 2-byte dtype; fp8: 1 byte
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    jitter_cv: float | None = None  # None: the engine profile's

    # derived once in __post_init__: the step-time functions run on every simulated step
    step_overhead_s: float = field(init=False, repr=False)  # fixed cost of every step
    prefill_s_per_token: float = field(init=False, repr=False)
    weight_read_s: float = field(init=False, repr=False)
    kv_read_s_per_token: float = field(init=False, repr=False)
    comm_s_per_token: float = field(init=False, repr=False)
    seq_s: float = field(init=False, repr=False)  # CPU time per running sequence and step
    jitter: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.tp not in TP_CHOICES:
            raise ValueError(f"tensor_parallel_size must be one of {TP_CHOICES}, got {self.tp}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        for what, dtype in (("weight dtype", self.weights_dtype), ("kv cache dtype",
                                                                   self.kv_cache_dtype)):
            if dtype not in DTYPE_BYTES:
                raise ValueError(f"unknown {what} {dtype!r}; known: {sorted(DTYPE_BYTES)}")
        m, g = self.model, self.gpu
        flops, bandwidth = self.effective_flops, self.effective_bandwidth
        n_ar = 2 * m.layers if self.tp > 1 else 0  # attention out + MLP down, per layer
        ring = 2.0 * (self.tp - 1) / self.tp
        link = g.link_gbps * 1e9
        fixed = self.fixed_step_s
        if fixed is None:
            fixed = (self.engine.step_ms * 1e-3 + m.layers * g.layer_us * 1e-6
                     + n_ar * g.allreduce_us * 1e-6)
        derived = {
            "step_overhead_s": fixed,
            "prefill_s_per_token": 2.0 * m.compute_params / flops,
            "weight_read_s": self.weight_bytes_read / bandwidth,
            "kv_read_s_per_token": self.kv_read_bytes_per_token_per_gpu * self.tp / bandwidth,
            "comm_s_per_token": (n_ar * m.hidden_size * ACT_BYTES * ring / link
                                 if n_ar and link else 0.0),
            "seq_s": self.engine.step_us_per_seq * 1e-6,
            "jitter": self.engine.jitter_cv if self.jitter_cv is None else self.jitter_cv,
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    # -- memory ---------------------------------------------------------------------------
    @property
    def weights_dtype(self) -> str:
        return self.weight_dtype or self.model.weight_dtype or (
            "bf16" if self.model.dtype_bytes == 2 else "fp8")

    @property
    def kv_dtype_bytes(self) -> float:
        if self.kv_cache_dtype == "auto":
            return self.model.dtype_bytes
        return DTYPE_BYTES[self.kv_cache_dtype]

    @property
    def kv_bytes_per_token(self) -> float:
        """Whole-model KV bytes per token (the seeds' figure: 819,200 B for Llama-2-13B)."""
        return self.model.kv_bytes_per_token * self.kv_dtype_bytes / self.model.dtype_bytes

    @property
    def kv_bytes_per_token_per_gpu(self) -> float:
        m = self.model
        if m.kv_latent_dim:
            return m.layers * m.kv_latent_dim * self.kv_dtype_bytes
        heads = max(1.0, m.kv_heads / self.tp)
        return 2 * m.layers * heads * m.head_dim * self.kv_dtype_bytes

    @property
    def kv_read_bytes_per_token_per_gpu(self) -> float:
        """What decode attention costs per token of context, in bytes read: an FP8 KV cache
        is dequantized to 16 bits in the attention kernel and, in the calibration data, decodes
        no faster than a 16-bit one (it halves the capacity, not the time)."""
        return self.kv_bytes_per_token_per_gpu * max(1.0, ACT_BYTES / self.kv_dtype_bytes)

    @property
    def weight_bytes(self) -> float:
        """The checkpoint's bytes: quantized layers, 16-bit embeddings and LM head."""
        m = self.model
        wd = self.weights_dtype
        if not self.weight_dtype and not m.weight_dtype:
            return m.weight_bytes  # an unquantized profile: params x dtype_bytes, as the seeds
        emb = min(m.embedding_params, m.params)
        return (m.params - emb) * DTYPE_BYTES[wd] + emb * 2.0

    @property
    def weight_bytes_read(self) -> float:
        """Bytes one step reads with every expert touched (the input embedding is a gather,
        not a read of the table)."""
        m = self.model
        table = m.vocab_size * m.hidden_size if not m.tied_embeddings else 0
        if not self.weight_dtype and not m.weight_dtype:
            return m.weight_bytes - table * m.dtype_bytes
        return self.weight_bytes - table * 2.0

    @property
    def weight_bytes_per_gpu(self) -> float:
        return self.weight_bytes / self.tp

    def activation_peak_bytes(self) -> float:
        """Per GPU: what the engine's profiling forward of `max_num_batched_tokens` tokens
        peaks at beside the weights: the residual stream and MLP intermediates of those
        tokens (BF16) and the FP32 logits of `max_num_seqs` sampled sequences."""
        m = self.model
        t = self.max_num_batched_tokens
        width = m.mlp_width * max(1, m.experts_per_token if m.experts else 1)
        per_token = (2 * m.hidden_size + 3 * width / self.tp) * ACT_BYTES
        return t * per_token + self.max_num_seqs * m.vocab_size * 4

    @property
    def kv_capacity_bytes_per_gpu(self) -> float:
        if self.overhead_gb is not None or not self.gpu.memory_gib:
            overhead = self.gpu.overhead_gb if self.overhead_gb is None else self.overhead_gb
            usable = self.gpu.memory_gb * GB * self.gpu_memory_utilization
            return usable - self.weight_bytes_per_gpu - overhead * GB
        usable = self.gpu.memory_bytes * self.gpu_memory_utilization
        return (usable - self.weight_bytes_per_gpu - self.activation_peak_bytes()
                - self.engine.non_torch_gib * GIB)

    @property
    def kv_capacity_bytes(self) -> float:
        """KV bytes over the whole TP group (the seeds' 13B-on-80 GB case: about 40 GB)."""
        return self.kv_capacity_bytes_per_gpu * self.tp

    @property
    def kv_capacity_tokens(self) -> int:
        return max(0, int(self.kv_capacity_bytes_per_gpu // self.kv_bytes_per_token_per_gpu))

    def num_blocks(self, block_size: int) -> int:
        return self.kv_capacity_tokens // block_size

    def max_concurrency(self, seq_len: int) -> float:
        """How many sequences of `seq_len` tokens the KV cache holds at once."""
        return self.kv_capacity_tokens / seq_len

    # -- time -----------------------------------------------------------------------------
    @property
    def _scale(self) -> float:
        return self.tp * (self.gpu.tp_efficiency if self.tp > 1 else 1.0)

    @property
    def effective_flops(self) -> float:
        return self.gpu.peak_flops(self.weights_dtype) * self.gpu.mfu * self._scale

    @property
    def effective_bandwidth(self) -> float:
        return self.gpu.hbm_bytes_per_s * self.gpu.mbu * self._scale

    def weight_read_time(self, tokens: int) -> float:
        """Weight read of a step of `tokens` tokens: a MoE reads only the experts routed to
        (expected distinct experts of `tokens` tokens routed top-k of E uniformly)."""
        m = self.model
        if not m.experts or tokens <= 0:
            return self.weight_read_s
        untouched = (1.0 - m.experts_per_token / m.experts) ** tokens
        share = m.expert_params / m.params
        return self.weight_read_s * (1.0 - share * untouched)

    def attention_s(self, new_tokens: int, context: int) -> float:
        """Attention FLOPs of `new_tokens` appended after `context` cached/computed tokens."""
        if not self.prefill_attention or new_tokens <= 0:
            return 0.0
        m = self.model
        pairs = new_tokens * context + new_tokens * (new_tokens + 1) / 2
        return 4.0 * m.layers * m.attention_heads * m.head_dim * pairs / self.attention_flops

    @property
    def attention_flops(self) -> float:
        """Attention runs on 16-bit activations: the BF16 peak whatever the weights are."""
        return self.gpu.flops_per_s * self.gpu.mfu * self._scale

    def prefill_time(self, new_tokens: int, context: int = 0) -> float:
        """Compute time of `new_tokens` uncached prompt tokens (no overhead, no weight floor)."""
        return new_tokens * self.prefill_s_per_token + self.attention_s(new_tokens, context)

    def decode_time(self, n_seqs: int, kv_tokens: int) -> float:
        """The GPU time of one decode step for `n_seqs` sequences holding `kv_tokens` of
        context in total (no fixed costs)."""
        gemm = max(self.weight_read_time(n_seqs), n_seqs * self.prefill_s_per_token)
        return gemm + kv_tokens * self.kv_read_s_per_token

    def step_time(self, prefill_tokens: int, n_decode: int, decode_kv_tokens: int,
                  attention_s: float = 0.0) -> float:
        """A whole engine step (without jitter): `prefill_tokens` of prompt beside `n_decode`
        decodes; one weight read serves both."""
        tokens = prefill_tokens + n_decode
        gemm = max(self.weight_read_time(tokens), tokens * self.prefill_s_per_token)
        return (self.step_overhead_s + tokens * self.comm_s_per_token + n_decode * self.seq_s
                + gemm + decode_kv_tokens * self.kv_read_s_per_token + attention_s)

    def request_latency_s(self, prompt_tokens: int) -> float:
        """Time a request spends outside the engine's steps before its first token: API
        server, HTTP, tokenisation (a fixed part and a part per prompt token)."""
        e = self.engine
        return e.request_ms * 1e-3 + prompt_tokens * e.request_us_per_token * 1e-6


def auto_tp(model: ModelProfile, gpu: GpuProfile, *, max_model_len: int,
            gpu_memory_utilization: float = 0.9, overhead_gb: float | None = None,
            **perf_options: object) -> int:
    """The smallest tensor-parallel size whose KV cache holds one `max_model_len` sequence."""
    for tp in TP_CHOICES:
        pm = PerfModel(model, gpu, tp=tp, gpu_memory_utilization=gpu_memory_utilization,
                       overhead_gb=overhead_gb, **perf_options)  # type: ignore[arg-type]
        if pm.kv_capacity_tokens >= max_model_len:
            return tp
    raise ValueError(f"{model.name} does not fit on {TP_CHOICES[-1]} x {gpu.key}")
