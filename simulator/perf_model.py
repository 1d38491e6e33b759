"""The performance model: KV capacity from memory, step time from FLOP/s and HBM bandwidth.

Formulas are the ones DESIGN.md and the seeds give; every figure is per replica (one TP group).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from simulator.profiles import GB, GpuProfile, ModelProfile

TP_CHOICES = (1, 2, 4, 8)


@dataclass(frozen=True, slots=True)
class PerfModel:
    """Memory and time for one replica: `tp` GPUs of one kind serving one model.

    - KV per token = 2 x layers x kv_heads x head_dim x dtype_bytes (sharded over TP; KV heads
      are replicated when there are fewer of them than GPUs).
    - KV capacity per GPU = memory x utilisation - weights / tp - fixed overhead.
    - Prefill is compute-bound: 2 x params FLOPs per uncached token at MFU (plus, when
      `prefill_attention`, the attention FLOPs 4 x layers x heads x head_dim x context).
    - Decode is bandwidth-bound: (weights + KV read by the batch) / (bandwidth x MBU), and never
      below its own compute (2 x params per decoded token), which bites at very large batches.
    - A step that mixes both costs what both cost; a step with prefill only still reads the
      weights once. A fixed `step_overhead_s` (scheduling, sampling, launches) is added.
    """

    model: ModelProfile
    gpu: GpuProfile
    tp: int = 1
    gpu_memory_utilization: float = 0.9
    overhead_gb: float | None = None  # None: the GPU profile's
    step_overhead_s: float = 0.001
    prefill_attention: bool = False

    # derived once in __post_init__: the step-time functions run on every simulated step
    prefill_s_per_token: float = field(init=False, repr=False)
    weight_read_s: float = field(init=False, repr=False)
    kv_read_s_per_token: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.tp not in TP_CHOICES:
            raise ValueError(f"tensor_parallel_size must be one of {TP_CHOICES}, got {self.tp}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        flops, bandwidth = self.effective_flops, self.effective_bandwidth
        derived = {
            "prefill_s_per_token": 2.0 * self.model.params / flops,
            "weight_read_s": self.model.weight_bytes / bandwidth,
            "kv_read_s_per_token": self.kv_bytes_per_token_per_gpu * self.tp / bandwidth,
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    # -- memory ---------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        """Whole-model KV bytes per token (the seeds' figure: 819,200 B for Llama-2-13B)."""
        return self.model.kv_bytes_per_token

    @property
    def kv_bytes_per_token_per_gpu(self) -> float:
        m = self.model
        heads = max(1.0, m.kv_heads / self.tp)
        return 2 * m.layers * heads * m.head_dim * m.dtype_bytes

    @property
    def weight_bytes_per_gpu(self) -> float:
        return self.model.weight_bytes / self.tp

    @property
    def kv_capacity_bytes_per_gpu(self) -> float:
        overhead = self.gpu.overhead_gb if self.overhead_gb is None else self.overhead_gb
        usable = self.gpu.memory_bytes * self.gpu_memory_utilization
        return usable - self.weight_bytes_per_gpu - overhead * GB

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
        return self.gpu.flops_per_s * self.gpu.mfu * self._scale

    @property
    def effective_bandwidth(self) -> float:
        return self.gpu.hbm_bytes_per_s * self.gpu.mbu * self._scale

    def attention_s(self, new_tokens: int, context: int) -> float:
        """Attention FLOPs of `new_tokens` appended after `context` cached/computed tokens."""
        if not self.prefill_attention or new_tokens <= 0:
            return 0.0
        m = self.model
        pairs = new_tokens * context + new_tokens * (new_tokens + 1) / 2
        return 4.0 * m.layers * m.attention_heads * m.head_dim * pairs / self.effective_flops

    def prefill_time(self, new_tokens: int, context: int = 0) -> float:
        """Compute time of `new_tokens` uncached prompt tokens (no overhead, no weight floor)."""
        return new_tokens * self.prefill_s_per_token + self.attention_s(new_tokens, context)

    def decode_time(self, n_seqs: int, kv_tokens: int) -> float:
        """One decode step for `n_seqs` sequences holding `kv_tokens` of context in total."""
        memory = self.weight_read_s + kv_tokens * self.kv_read_s_per_token
        return max(memory, n_seqs * self.prefill_s_per_token)

    def step_time(self, prefill_s: float, n_decode: int, decode_kv_tokens: int) -> float:
        """A whole engine step: `prefill_s` of prefill compute beside `n_decode` decodes."""
        if n_decode:
            return self.step_overhead_s + prefill_s + self.decode_time(n_decode, decode_kv_tokens)
        return self.step_overhead_s + max(prefill_s, self.weight_read_s)


def auto_tp(model: ModelProfile, gpu: GpuProfile, *, max_model_len: int,
            gpu_memory_utilization: float = 0.9, overhead_gb: float | None = None) -> int:
    """The smallest tensor-parallel size whose KV cache holds one `max_model_len` sequence."""
    for tp in TP_CHOICES:
        pm = PerfModel(model, gpu, tp=tp, gpu_memory_utilization=gpu_memory_utilization,
                       overhead_gb=overhead_gb)
        if pm.kv_capacity_tokens >= max_model_len:
            return tp
    raise ValueError(f"{model.name} does not fit on {TP_CHOICES[-1]} x {gpu.key}")
