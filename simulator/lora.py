"""Multi-LoRA serving as vLLM does it: GPU adapter slots, a CPU cache, loads that cost time.

- `LoraConfig.max_loras` GPU slots (vLLM `--max-loras`, default 1) and `max_cpu_loras` CPU
  copies (default = max_loras), both LRU. A batch holds requests of at most `max_loras`
  distinct adapters: the scheduler skips a waiting request whose adapter would be one too many
  and admits the ones behind it (vLLM v1's scheduler does the same), so such a request waits
  until a running adapter has no request left in the batch.
- Loading an adapter that is not on the GPU is a stall: the step that admits its first request
  takes `load_s` longer (`cpu_load_s` when the CPU cache still holds it), for the whole batch,
  as vLLM's worker loads adapters inside the step (`set_active_adapters`). Counted in `loads`.
- Adapters are registered (`/v1/models` lists them with `parent`) at start, or at run time
  through `/v1/load_lora_adapter` / `/v1/unload_lora_adapter` when `runtime_updating` is on
  (vLLM: `VLLM_ALLOW_RUNTIME_LORA_UPDATING`); unload forgets the name, not the GPU copy
  (vllm#54839).
- `vllm:lora_requests_info` bug for bug: a gauge whose value is the Unix time of its last
  update, labels `max_lora`, `running_lora_adapters`, `waiting_lora_adapters` (comma-separated
  names of adapters with requests in flight: the same list in both, an idle loaded adapter in
  neither), one series per distinct label set, old ones lingering; absent until an adapter
  has been used.

KV blocks of different adapters never share prefix-cache entries: `lora_salt` joins the adapter
to the chain's salt (vLLM puts the adapter in every block's extra keys).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from simulator.sequence import Sequence

EPOCH_S = 1_700_000_000.0  # the metric's timestamps: this Unix time plus simulated seconds
_LINGER = 64  # series of the info gauge kept (vLLM keeps every one; bounded here)


@dataclass(frozen=True, slots=True)
class LoraConfig:
    adapters: tuple[str, ...] = ()  # registered at start (`--lora-modules name=path`)
    max_loras: int = 1
    max_cpu_loras: int | None = None  # None: max_loras
    load_s: float = 0.25  # disk -> GPU
    cpu_load_s: float = 0.01  # CPU cache -> GPU
    runtime_updating: bool = False  # the load/unload routes exist
    missing: tuple[str, ...] = ()  # adapter paths this replica cannot find (a load: vLLM's 404)

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError("max_loras must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras must be >= max_loras")
        if self.load_s < 0 or self.cpu_load_s < 0:
            raise ValueError("adapter load times must be >= 0")


def lora_salt(adapter: str | None, cache_salt: str | None) -> str | None:
    """The salt of a request's block chain: its adapter joined to its cache_salt."""
    if not adapter:
        return cache_salt
    return f"lora:{len(adapter)}:{adapter}|{cache_salt or ''}"


def adapter_path(name: str) -> str:
    return f"/adapters/{name}"


@dataclass(slots=True)
class LoraState:
    """One engine's adapters: registered names, GPU and CPU residency, the adapter of each
    request in flight, loads done, and the info gauge's series."""

    config: LoraConfig
    registered: dict[str, str] = field(default_factory=dict)  # name -> path
    gpu: OrderedDict[str, None] = field(default_factory=OrderedDict)  # LRU, newest last
    cpu: OrderedDict[str, None] = field(default_factory=OrderedDict)
    adapter_of: dict[str, str] = field(default_factory=dict)  # request id -> adapter
    loads: int = 0
    cpu_loads: int = 0
    series: OrderedDict[tuple[str, str], float] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        for name in self.config.adapters:
            self.registered.setdefault(name, adapter_path(name))

    # -- registration (the runtime routes) --------------------------------------------------
    def register(self, name: str, path: str) -> tuple[int, str] | None:
        """Load an adapter by name: None on success, else vLLM's (status, message): 400 for a
        name already loaded, 404 for a path it cannot find (`LoraConfig.missing`)."""
        if name in self.registered:
            return 400, (f"The lora adapter '{name}' has already been loaded. If you want to "
                         "load the adapter in place, set 'load_inplace' to True.")
        if path in self.config.missing:
            return 404, f"Loading lora {name} failed: No adapter found for <path>"
        self.registered[name] = path
        return None

    def unregister(self, name: str) -> bool:
        """Forget a name (its GPU/CPU copies stay until LRU eviction, as in vLLM)."""
        return self.registered.pop(name, None) is not None

    # -- requests ---------------------------------------------------------------------------
    def assign(self, request_id: str, adapter: str) -> None:
        self.adapter_of[request_id] = adapter

    def release(self, request_id: str) -> None:
        self.adapter_of.pop(request_id, None)

    def adapters_of(self, seqs: Iterable[Sequence]) -> set[str]:
        """The adapters of these sequences (a batch, the running set)."""
        of = self.adapter_of
        return {a for s in seqs if (a := of.get(s.id)) is not None}

    def admissible(self, request_id: str, active: set[str]) -> bool:
        """May a request join a batch whose requests use the adapters `active`?"""
        a = self.adapter_of.get(request_id)
        return a is None or a in active or len(active) < self.config.max_loras

    def activate(self, adapters: Iterable[str], keep: set[str]) -> float:
        """Bring `adapters` onto the GPU (LRU order refreshed); the seconds the loads add to
        the step. `keep`: adapters of the batch, never evicted for another."""
        cfg, gpu, cpu = self.config, self.gpu, self.cpu
        stall = 0.0
        for a in adapters:
            if a in gpu:
                gpu.move_to_end(a)
                continue
            while len(gpu) >= cfg.max_loras:
                victim = next((v for v in gpu if v not in keep), None)
                if victim is None:
                    break
                del gpu[victim]
            gpu[a] = None
            if a in cpu:
                cpu.move_to_end(a)
                stall += cfg.cpu_load_s
                self.cpu_loads += 1
            else:
                stall += cfg.load_s
                cpu[a] = None
                while len(cpu) > (cfg.max_cpu_loras or cfg.max_loras):
                    cpu.popitem(last=False)
            self.loads += 1
        return stall

    # -- vllm:lora_requests_info ------------------------------------------------------------
    def touch_metric(self, in_flight_ids: Iterable[str], now_s: float) -> None:
        """Set the gauge for the adapters with requests in flight now (both labels alike)."""
        of = self.adapter_of
        names = ",".join(sorted({a for r in in_flight_ids if (a := of.get(r)) is not None}))
        if not names and not self.series:
            return  # absent until an adapter is used
        key = (names, names)
        self.series.pop(key, None)
        self.series[key] = EPOCH_S + now_s
        while len(self.series) > _LINGER:
            self.series.popitem(last=False)

    def metric_samples(self) -> list[tuple[dict[str, str], float]]:
        m = str(self.config.max_loras)
        return [({"max_lora": m, "running_lora_adapters": run, "waiting_lora_adapters": wait}, t)
                for (run, wait), t in self.series.items()]
