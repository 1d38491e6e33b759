"""What the gateway knows of each replica's LoRA adapters, and how it reads it (docs/lora.md).

Three sources, per replica:
- `/v1/models` (refreshed every `refresh_s`): the adapters it serves are the cards with a
  `parent`; the cards without one are its base models. A replica none of whose cards has a
  parent is not LoRA-enabled: it gets no `LoraView` and routing treats it as before.
  SGLang (cards `owned_by: "sglang"`) lists its adapters so only in recent versions; otherwise
  they are its `/get_server_info`'s `lora_paths` (`sglang_adapters`: a list of LoRARef dicts
  `{lora_id, lora_name, lora_path, pinned}`, or in older versions `{name: path}` or
  `name=path` strings), and its GPU slots `max_loras_per_batch` less the one a batch keeps for
  the base model. Its OpenAI API names an adapter `<base model>:<adapter>` (`model:
  "llama:sql"`), so an SGLang replica serves each adapter under both names.
- `vllm:lora_requests_info` in each `/metrics` scrape. Its value is the Unix time of the
  gauge's last update and every label set it ever had lingers as its own series, so only the
  series with the largest value is read. Its `running_lora_adapters` and
  `waiting_lora_adapters` name the adapters with requests in flight (vLLM writes every such
  adapter into both), not the loaded set: an idle adapter on the GPU appears in neither.
  `max_lora` is the replica's GPU adapter slots. A missing family is "no LoRA info".
- The gateway's own dispatches: in-flight requests per adapter (fresher than any scrape), and
  the adapters it sent there last, which stand in for the GPU residency no metric reports.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

from gateway.transport.control import ControlClient, get_json, model_cards
from policies.scorers.lora import adapter_state
from policies.types import LoraView

LORA_INFO = "vllm:lora_requests_info"
LoraInfo = tuple[frozenset[str], int | None]  # (adapters with requests in flight, max_lora)
DEFAULT_MAX_LORAS = 1  # vLLM's --max-loras default, until the metric says otherwise
_MAX_ADAPTERS = 4096  # bound on the names kept per replica
DEMAND_DECAY = 0.97  # per request sent to the replica: demand is over its last ~30 requests


def adapters_of(cards: Iterable[Mapping[str, Any]]) -> tuple[frozenset[str], frozenset[str]]:
    """(adapters, base models) from a replica's `/v1/models` cards (`model_cards`)."""
    adapters: set[str] = set()
    base: set[str] = set()
    for card in cards:
        (adapters if isinstance(card.get("parent"), str) else base).add(card["id"])
    return frozenset(adapters), frozenset(base)


def is_sglang(cards: Iterable[Mapping[str, Any]]) -> bool:
    """SGLang writes its name into every card's `owned_by` (vLLM writes "vllm")."""
    return any(card.get("owned_by") == "sglang" for card in cards)


def sglang_adapters(info: Any) -> tuple[frozenset[str], int | None] | None:
    """(adapter names, GPU adapter slots) from SGLang's `/get_server_info`; None when LoRA is
    off there (`enable_lora` false and no `lora_paths`) or the answer is not SGLang's."""
    if not isinstance(info, Mapping):
        return None
    paths = info.get("lora_paths")
    names: set[str] = set()
    if isinstance(paths, Mapping):  # older: {name: path}
        names.update(k for k in paths if isinstance(k, str) and k)
    elif isinstance(paths, list):
        for item in paths:
            if isinstance(item, Mapping):  # LoRARef, as dataclasses.asdict writes it
                name = item.get("lora_name") or item.get("name")
            elif isinstance(item, str):  # `--lora-paths name=path`, or a bare path (its own name)
                name = item.partition("=")[0]
            else:
                name = None
            if isinstance(name, str) and name:
                names.add(name)
    if not names and info.get("enable_lora") is not True:
        return None
    per_batch = info.get("max_loras_per_batch")
    slots = None
    if isinstance(per_batch, int) and not isinstance(per_batch, bool) and per_batch >= 1:
        slots = max(1, per_batch - 1)  # one of a batch's slots is the base model's
    return frozenset(list(names)[:_MAX_ADAPTERS]), slots


def sglang_names(adapters: frozenset[str], base: frozenset[str]) -> frozenset[str]:
    """Every name a request may give an SGLang replica's adapter: its own and
    `<base model>:<adapter>`, the form SGLang's OpenAI API reads."""
    if not adapters:
        return adapters
    return adapters | {f"{b}:{a}" for b in base for a in adapters}


def parse_lora_info(text: str) -> LoraInfo | None:
    """(adapters with requests in flight, max_lora) from the newest `vllm:lora_requests_info`
    series of a scrape; None when the family is absent (no LoRA info, not an error)."""
    best: tuple[float, str] | None = None
    start = 0
    while (i := text.find(LORA_INFO + "{", start)) >= 0:
        start = i + 1
        if i and text[i - 1] != "\n":
            continue  # inside a comment or another name
        end = text.find("}", i)
        nl = text.find("\n", end)
        try:
            value = float(text[end + 1 : nl if nl >= 0 else None].split()[0])
        except (ValueError, IndexError):
            continue
        if math.isfinite(value) and (best is None or value > best[0]):
            best = (value, text[i + len(LORA_INFO) + 1 : end])
    if best is None:
        return None
    labels = _labels(best[1])
    names = {
        n.strip()
        for key in ("running_lora_adapters", "waiting_lora_adapters")
        for n in labels.get(key, "").split(",")
        if n.strip()
    }
    try:
        max_lora: int | None = int(labels["max_lora"])
    except (KeyError, ValueError):
        max_lora = None
    return frozenset(names), max_lora if max_lora is None or max_lora >= 1 else None


def _labels(inner: str) -> dict[str, str]:
    out: dict[str, str] = {}
    i, n = 0, len(inner)
    while i < n:
        eq = inner.find("=", i)
        if eq < 0 or eq + 1 >= n or inner[eq + 1] != '"':
            break
        key = inner[i:eq].strip().lstrip(",").strip()
        j = eq + 2
        value: list[str] = []
        while j < n and inner[j] != '"':
            if inner[j] == "\\" and j + 1 < n:
                j += 1
            value.append(inner[j])
            j += 1
        out[key] = "".join(value)
        i = j + 1
    return out


class ReplicaAdapters:
    """One replica's adapters as the gateway knows them; `view()` is what policies read."""

    __slots__ = (
        "served", "base", "loadable", "managed", "max_loras", "metric_active", "own", "recent",
        "demand", "lora_on", "_view",
    )  # fmt: skip

    def __init__(self, max_loras: int | None = None) -> None:
        self.served: frozenset[str] = frozenset()
        self.base: frozenset[str] = frozenset()
        self.loadable: frozenset[str] = frozenset()  # managed placement may load these now
        self.managed: frozenset[str] = frozenset()  # every adapter managed placement places
        self.max_loras = max_loras  # configured, else the metric's
        self.metric_active: frozenset[str] = frozenset()
        self.own: dict[str, int] = {}  # this gateway's requests in flight, per adapter
        self.recent: OrderedDict[str, None] = OrderedDict()  # used last, newest last
        self.demand: dict[str, float] = {}  # decayed share of the requests sent here, by adapter
        self.lora_on = False  # the engine says LoRA is on, adapters or not (SGLang's server info)
        self._view: LoraView | None = None

    @property
    def enabled(self) -> bool:
        """The replica serves adapters, or may be given some, or says it runs LoRA."""
        return bool(self.served or self.managed or self.lora_on)

    def is_adapter(self, model: str) -> bool:
        return model in self.served or model in self.managed

    def set_loadable(self, adapters: frozenset[str], managed: frozenset[str]) -> None:
        if adapters != self.loadable or managed != self.managed:
            self.loadable, self.managed = adapters, managed
            self._view = None

    def set_models(self, adapters: frozenset[str], base: frozenset[str]) -> None:
        if adapters != self.served or base != self.base:
            self.served, self.base = adapters, base
            for gone in [a for a in self.recent if a not in adapters]:
                del self.recent[gone]  # unloaded (or never loaded) by the operator
            self._view = None

    def set_lora_on(self, on: bool) -> None:
        """The engine says it runs LoRA (or not), whether or not it holds an adapter now."""
        if on != self.lora_on:
            self.lora_on = on
            self._view = None

    def set_slots(self, slots: int | None) -> None:
        """GPU adapter slots the engine reports outside the metric (SGLang's server info)."""
        if slots is not None and slots != self.max_loras:
            self.max_loras = slots
            self._view = None

    def set_metric(self, active: frozenset[str], max_lora: int | None, configured: int | None) -> None:
        for a in sorted(active - self.metric_active):
            self._use(a)
        self.metric_active = active
        self.max_loras = configured or max_lora or self.max_loras
        self._view = None

    def _use(self, adapter: str) -> None:
        recent = self.recent
        recent.pop(adapter, None)
        recent[adapter] = None
        while len(recent) > _MAX_ADAPTERS:
            recent.popitem(last=False)

    def state(self, adapter: str) -> str | None:
        """Where `adapter` stands here: active, resident, free, evict or busy (policies' words);
        None for a model that is no adapter of this replica."""
        view = self.view()
        return adapter_state(adapter, view) if view is not None else None

    def dispatched(self, adapter: str) -> bool:
        """Count a request for `adapter` sent here; True when it needs the adapter loaded."""
        if not self.is_adapter(adapter):
            return False
        state = self.state(adapter)
        self.own[adapter] = self.own.get(adapter, 0) + 1
        self._use(adapter)
        demand = self.demand
        for a in list(demand):
            d = demand[a] * DEMAND_DECAY
            if d < 1e-3:
                del demand[a]
            else:
                demand[a] = d
        demand[adapter] = demand.get(adapter, 0.0) + (1.0 - DEMAND_DECAY)
        self._view = None
        return state in ("free", "evict", "busy")

    def unplaced(self, adapter: str) -> None:
        """A dispatch of `adapter` here was given up (its managed load failed): it is not the
        adapter sent here last, and its share of the demand goes."""
        self.recent.pop(adapter, None)
        self.demand.pop(adapter, None)
        self._view = None

    def finished(self, adapter: str) -> None:
        n = self.own.get(adapter, 0)
        if n <= 0:
            return
        if n == 1:
            del self.own[adapter]
        else:
            self.own[adapter] = n - 1
        self._view = None

    def view(self) -> LoraView | None:
        if not self.enabled:
            return None
        if self._view is None:
            slots = self.max_loras or DEFAULT_MAX_LORAS
            inflight: dict[str, int] = dict(self.own)
            for a in self.metric_active:
                inflight.setdefault(a, 1)
            busy = [a for a in self.recent if a in inflight]
            idle = [a for a in self.recent if a not in inflight]
            resident = (idle + busy)[-max(slots, len(busy)) :]  # in flight ones were used last
            self._view = LoraView(
                served=self.served, base=self.base, max_loras=slots, resident=tuple(resident),
                inflight=inflight, loadable=self.loadable,
                demand={a: self.demand.get(a, 0.0) for a in resident}, managed=self.managed,
            )  # fmt: skip
        return self._view


async def refresh_models(
    client: ControlClient, url: str, into: ReplicaAdapters, configured: int | None = None
) -> list[dict[str, Any]] | None:
    """Read the replica's `/v1/models` into `into` (for SGLang also its `/get_server_info`,
    when the cards list no adapter); its cards, None when it did not answer with a list.
    `configured`: the pool's `lora.max_loras`, which wins over slots the engine reports."""
    cards = await model_cards(client, url, timeout_s=5.0)
    if cards is None:
        return None
    adapters, base = adapters_of(cards)
    if is_sglang(cards):
        if not adapters:
            info = await get_json(client, url + "/get_server_info", timeout_s=5.0)
            found = sglang_adapters(info)
            into.set_lora_on(found is not None)
            if found is not None:
                adapters, slots = found
                into.set_slots(configured or slots)
        adapters = sglang_names(adapters, base)
    into.set_models(adapters, base)
    return cards


def unserved(adapters: Iterable[ReplicaAdapters], model: str) -> bool:
    """No replica can serve `model`, as far as their `/v1/models` say: every one is
    LoRA-enabled with a known model list, and has it neither as an adapter (served, or placed
    by the gateway) nor as a base model."""
    seen = False
    for a in adapters:
        if not a.enabled or not a.base or model in a.base or a.is_adapter(model):
            return False
        seen = True
    return seen
