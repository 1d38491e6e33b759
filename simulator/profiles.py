"""Model and GPU profiles: the data the performance model is computed from.

Profiles live in `simulator/profiles/*.yaml` (package data); a profile file of your own can be
loaded with `load_models(path)` / `load_gpus(path)` and passed by object instead of by name.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")
GB = 1e9  # profiles use decimal units, as datasheets and the seeds' worked numbers do


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

    @property
    def kv_bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x dtype_bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class GpuProfile:
    """One accelerator: datasheet figures plus the efficiency an engine reaches on it."""

    key: str
    memory_gb: float
    hbm_tbps: float
    dense_tflops: float
    mfu: float = 0.5
    mbu: float = 0.9
    overhead_gb: float = 6.0
    tp_efficiency: float = 0.9
    name: str = ""

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * GB

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_tbps * 1e12

    @property
    def flops_per_s(self) -> float:
        return self.dense_tflops * 1e12


def _read(path: Path | None, default: str) -> dict[str, dict[str, Any]]:
    if path is None:
        text = resources.files("simulator").joinpath("profiles").joinpath(default).read_text("utf-8")
    else:
        text = Path(path).read_text("utf-8")
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


_COERCE: dict[str, Any] = {"float": float, "int": int}


def load_models(path: Path | None = None) -> dict[str, ModelProfile]:
    """All model profiles in `path` (default: the shipped `profiles/models.yaml`)."""
    src = str(path or "models.yaml")
    return {k: _build(ModelProfile, "name", k, v, src) for k, v in _read(path, "models.yaml").items()}


def load_gpus(path: Path | None = None) -> dict[str, GpuProfile]:
    """All GPU profiles in `path` (default: the shipped `profiles/gpus.yaml`)."""
    src = str(path or "gpus.yaml")
    return {k: _build(GpuProfile, "key", k, v, src) for k, v in _read(path, "gpus.yaml").items()}


def _pick(table: dict[str, T], name: str, what: str) -> T:
    found = table.get(name.lower())
    if found is None:
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(sorted(table))}")
    return found


def get_model(name: str | ModelProfile) -> ModelProfile:
    return name if isinstance(name, ModelProfile) else _pick(load_models(), name, "model")


def get_gpu(name: str | GpuProfile) -> GpuProfile:
    return name if isinstance(name, GpuProfile) else _pick(load_gpus(), name, "gpu")
