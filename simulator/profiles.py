"""Model and GPU profiles: the data the performance model is computed from.

Profiles live in `simulator/profiles/*.yaml` (package data); a profile file of your own can be
loaded with `load_models(path)` / `load_gpus(path)` and passed by object instead of by name.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")
GB = 1e9  # profiles use decimal units, as datasheets and the seeds' worked numbers do
GIB = 2**30  # the engine counts memory in GiB (torch.cuda.mem_get_info)

# bytes per weight / KV element of each dtype name; int4 and mxfp4 carry a scale per group
# (AWQ/GPTQ group 128 with an FP16 scale and zero: 4.25 bits; MXFP4 blocks of 32 share an
# 8-bit exponent: 4.25 bits)
DTYPE_BYTES: dict[str, float] = {"bf16": 2.0, "fp16": 2.0, "auto": 2.0, "fp8": 1.0,
                                 "int8": 1.0, "int4": 0.53125, "mxfp4": 0.53125}


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """A decoder-only transformer, as far as serving cost is concerned."""

    name: str
    layers: int
    hidden_size: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    params: float
    dtype_bytes: int = 2
    max_model_len: int = 4096
    hf_name: str = ""
    attention: str = ""
    intermediate_size: int = 0  # MLP width (0: 4 x hidden); a MoE's per-expert width
    vocab_size: int = 32000
    tied_embeddings: bool = False
    weight_dtype: str = ""  # the checkpoint's weight dtype ("": 2-byte, as `dtype_bytes`)
    active_params: float = 0.0  # parameters one token goes through (MoE); 0: all of them
    experts: int = 0  # routed experts per MoE layer (0: dense)
    experts_per_token: int = 0
    expert_params: float = 0.0  # parameters in all routed experts together
    kv_latent_dim: int = 0  # MLA: one latent vector of this width per layer and token

    @property
    def kv_bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x dtype_bytes."""
        if self.kv_latent_dim:
            return self.layers * self.kv_latent_dim * self.dtype_bytes
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def embedding_params(self) -> float:
        """Input embedding and LM head, kept in 16 bits by quantized checkpoints."""
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    @property
    def mlp_width(self) -> int:
        return self.intermediate_size or 4 * self.hidden_size

    @property
    def compute_params(self) -> float:
        """Parameters whose matmuls each token runs through (2 FLOPs each)."""
        return self.active_params or self.params


@dataclass(frozen=True, slots=True)
class GpuProfile:
    """One accelerator: datasheet figures plus the efficiency an engine reaches on it."""

    key: str
    memory_gb: float
    hbm_tbps: float
    dense_tflops: float
    mfu: float = 0.5
    mbu: float = 0.9
    overhead_gb: float = 6.0  # the flat overhead of the seeds' rule (memory_gib = 0)
    tp_efficiency: float = 1.0  # kept for old profiles; communication is modelled below
    name: str = ""
    memory_gib: float = 0.0  # total memory as the engine sees it; 0: memory_gb, seeds' rule
    fp8_tflops: float = 0.0  # dense FP8 tensor peak (0: no FP8 units, FP8 runs at BF16 peak)
    fp4_tflops: float = 0.0  # dense FP4 tensor peak (0: none)
    layer_us: float = 0.0  # per layer and step: kernel launch/latency floor (us)
    allreduce_us: float = 0.0  # latency of one small all-reduce across the TP group (us)
    link_gbps: float = 0.0  # per-GPU interconnect bandwidth, one direction (GB/s)

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB if self.memory_gib else self.memory_gb * GB

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_tbps * 1e12

    @property
    def flops_per_s(self) -> float:
        return self.dense_tflops * 1e12

    def peak_flops(self, weight_dtype: str) -> float:
        """Tensor peak for matmuls with weights of `weight_dtype`: FP8 weights run W8A8 on
        FP8 units where the GPU has them; 4-bit weights are dequantized to BF16 (W4A16)."""
        if weight_dtype in ("fp8", "int8") and self.fp8_tflops:
            return self.fp8_tflops * 1e12
        return self.flops_per_s


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """What a serving engine adds around the GPU work (CPU side, API server, memory rule)."""

    name: str
    step_ms: float = 0.0  # CPU work per step: scheduling, input prep, sampling, output
    step_us_per_seq: float = 0.0  # the part of it that grows with each running sequence
    request_ms: float = 0.0  # per request: API server, HTTP, detokenizer/streaming path
    request_us_per_token: float = 0.0  # per prompt token: tokenization, input transfer
    non_torch_gib: float = 0.0  # per GPU outside the torch allocator: CUDA context, NCCL, graphs
    jitter_cv: float = 0.0  # coefficient of variation of a step's duration (seeded)
    request_jitter_cv: float = 0.0  # coefficient of variation of a request's latency
    description: str = ""


@functools.lru_cache(maxsize=8)
def _shipped(default: str) -> str:
    return resources.files("simulator").joinpath("profiles").joinpath(default).read_text("utf-8")


def _read(path: Path | None, default: str) -> dict[str, dict[str, Any]]:
    text = _shipped(default) if path is None else Path(path).read_text("utf-8")
    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path or default}: expected a mapping of profile name to fields")
    return data


def _build(cls: type[T], key_field: str, key: str, raw: dict[str, Any], src: str) -> T:
    types = {f.name: f.type for f in fields(cls)}  # type: ignore[arg-type]
    unknown = set(raw) - set(types)
    if unknown:
        raise ValueError(f"{src}: profile {key!r}: unknown field(s) {sorted(unknown)}")
    try:
        # YAML 1.1 reads `13.0e9` as a string: coerce numbers by the field's declared type
        values = {k: _COERCE.get(str(types[k]), _same)(v) for k, v in raw.items()}
        return cls(**{key_field: key, **values})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{src}: profile {key!r}: {exc}") from None


def _same(v: Any) -> Any:
    return v


_COERCE: dict[str, Any] = {"float": float, "int": int, "bool": bool}


def load_models(path: Path | None = None) -> dict[str, ModelProfile]:
    """All model profiles in `path` (default: the shipped `profiles/models.yaml`)."""
    src = str(path or "models.yaml")
    return {k: _build(ModelProfile, "name", k, v, src) for k, v in _read(path, "models.yaml").items()}


def load_gpus(path: Path | None = None) -> dict[str, GpuProfile]:
    """All GPU profiles in `path` (default: the shipped `profiles/gpus.yaml`)."""
    src = str(path or "gpus.yaml")
    return {k: _build(GpuProfile, "key", k, v, src) for k, v in _read(path, "gpus.yaml").items()}


def load_engines(path: Path | None = None) -> dict[str, EngineProfile]:
    """All engine profiles in `path` (default: the shipped `profiles/engines.yaml`)."""
    src = str(path or "engines.yaml")
    return {k: _build(EngineProfile, "name", k, v, src)
            for k, v in _read(path, "engines.yaml").items()}


def _pick(table: dict[str, T], name: str, what: str) -> T:
    found = table.get(name.lower())
    if found is None:
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(sorted(table))}")
    return found


def get_model(name: str | ModelProfile) -> ModelProfile:
    return name if isinstance(name, ModelProfile) else _pick(load_models(), name, "model")


def get_gpu(name: str | GpuProfile) -> GpuProfile:
    return name if isinstance(name, GpuProfile) else _pick(load_gpus(), name, "gpu")


def get_engine(name: str | EngineProfile) -> EngineProfile:
    return name if isinstance(name, EngineProfile) else _pick(load_engines(), name, "engine")
