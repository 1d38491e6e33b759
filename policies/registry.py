"""Every plugin and preset by name in one table, and `build_policy` that turns a spec into a Policy.

A name not in the table may be a ``"module:attr"`` path. Adding a scorer is one module plus one
line in TABLE["scorer"]. A plugin from such a path that matches its Protocol only structurally
gets the optional capabilities it does not declare filled in (see `_conform`), with a warning.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import random
from collections.abc import Mapping
from types import MappingProxyType, MethodType
from typing import Any

from policies.base import Filter, Picker, Plugin, Policy, Scorer
from policies.errors import PolicyConfigError
from policies.pickers.max_score import LoadGuard

TABLE: Mapping[str, Mapping[str, str]] = MappingProxyType(
    {
        "filter": MappingProxyType(
            {
                "healthy": "policies.filters:Healthy",
                "serves_model": "policies.filters:ServesModel",
                "not_saturated": "policies.filters:NotSaturated",
                "serves_adapter": "policies.lora_filter:ServesAdapter",
            }
        ),
        "scorer": MappingProxyType(
            {
                "prefix": "policies.scorers.prefix:PrefixScorer",
                "queue": "policies.scorers.queue:QueueScorer",
                "kv_pressure": "policies.scorers.kv_pressure:KVPressureScorer",
                "ttft": "policies.scorers.ttft:TTFTScorer",
                "session": "policies.scorers.session:SessionScorer",
                "cost_blocks": "policies.scorers.cost_blocks:CostBlocksScorer",
                "lora_affinity": "policies.scorers.lora:LoraAffinityScorer",
            }
        ),
        "picker": MappingProxyType(
            {
                "max_score": "policies.pickers.max_score:MaxScorePicker",
                "sticky": "policies.pickers.sticky:StickyPicker",
                "sglang_cache_aware": "policies.pickers.sglang_cache_aware:SGLangCacheAwarePicker",
                "round_robin": "policies.baselines:RoundRobinPicker",
                "least_loaded": "policies.baselines:LeastLoadedPicker",
                "random": "policies.baselines:RandomPicker",
            }
        ),
        "policy": MappingProxyType(
            {
                "prefix_aware": "policies.presets:PREFIX_AWARE",
                "ttft": "policies.presets:TTFT",
                "cost_blocks": "policies.presets:COST_BLOCKS",
                "sticky": "policies.presets:STICKY",
                "sglang_cache_aware": "policies.presets:SGLANG_CACHE_AWARE",
                "round_robin": "policies.presets:ROUND_ROBIN",
                "least_loaded": "policies.presets:LEAST_LOADED",
                "random": "policies.presets:RANDOM",
            }
        ),
    }
)

POLICY_NAMES: tuple[str, ...] = tuple(TABLE["policy"])
DEFAULT_POLICY = "ttft"  # picked by bench/routing.py (most goals met); docs/benchmarks.md
DEFAULT_FILTERS: tuple[str, ...] = ("healthy", "serves_model", "serves_adapter", "not_saturated")
SPEC_KEYS: tuple[str, ...] = ("name", "preset", "filters", "scorers", "picker", "guard")
_METHOD = {"filter": "keep", "scorer": "score", "picker": "pick"}
_PROTOCOL = {"filter": "Filter", "scorer": "Scorer", "picker": "Picker"}
_log = logging.getLogger(__name__)


def build_policy(spec: str | Mapping[str, Any], *, seed: int | None = None) -> Policy:
    """Build a fresh Policy from a preset name, a ``"module:attr"`` path, or a mapping.

    All randomness of the policy (tie-breaks, the random baseline) comes from one
    ``random.Random(seed)`` owned by this policy instance.
    """
    rng = random.Random(seed)
    if isinstance(spec, str):
        target = _lookup("policy", spec, "policy")
        if isinstance(target, Mapping):
            return _from_mapping(target, rng, "policy", default_name=spec)
        if callable(target):
            try:
                takes_seed = "seed" in inspect.signature(target).parameters
            except (TypeError, ValueError):
                takes_seed = False
            policy = target(seed=seed) if takes_seed else target()
            if not isinstance(policy, Policy):
                raise PolicyConfigError(f"policy: {spec!r} returned {policy!r}, not a Policy")
            return policy
        raise PolicyConfigError(f"policy: {spec!r} is neither a spec mapping nor a factory")
    if isinstance(spec, Mapping):
        return _from_mapping(spec, rng, "policy", default_name="custom")
    raise PolicyConfigError(
        f"policy: expected a preset name, 'module:attr' or a mapping, got {type(spec).__name__}"
    )


def resolve(path: str, where: str = "policy") -> Any:
    """Import ``"module:attr"`` (attr may be dotted) or raise PolicyConfigError naming `where`."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise PolicyConfigError(f"{where}: {path!r} is not of the form 'module:attr'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise PolicyConfigError(f"{where}: cannot import module {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PolicyConfigError(
                f"{where}: module {module_name!r} has no attribute {attr!r}"
            ) from None
    return obj


def _lookup(kind: str, name: object, where: str) -> Any:
    table = TABLE[kind]
    valid = f"valid: {', '.join(sorted(table))}, or 'module:attr'"
    if not isinstance(name, str):
        raise PolicyConfigError(f"{where}: expected a {kind} name, got {name!r}; {valid}")
    if name in table:
        return resolve(table[name], where)
    if ":" in name:
        return resolve(name, where)
    raise PolicyConfigError(f"{where}: unknown {kind} {name!r}; {valid}")


def _from_mapping(
    spec: Mapping[str, Any], rng: random.Random, where: str, *, default_name: str, depth: int = 0
) -> Policy:
    unknown = sorted(str(k) for k in spec if k not in SPEC_KEYS)
    if unknown:
        raise PolicyConfigError(f"{where}.{unknown[0]}: unknown key; valid: {', '.join(SPEC_KEYS)}")
    if "preset" in spec:
        preset = spec["preset"]
        base = _lookup("policy", preset, f"{where}.preset")
        if not isinstance(base, Mapping) or depth > 4:
            raise PolicyConfigError(f"{where}.preset: {preset!r} is not a spec mapping")
        merged = {**base, **{k: v for k, v in spec.items() if k != "preset"}}
        return _from_mapping(merged, rng, where, default_name=preset, depth=depth + 1)

    name = spec.get("name", default_name)
    if not isinstance(name, str) or not name:
        raise PolicyConfigError(f"{where}.name: expected a non-empty string, got {name!r}")

    filter_specs = spec.get("filters", DEFAULT_FILTERS)
    if isinstance(filter_specs, str | Mapping) or not hasattr(filter_specs, "__iter__"):
        raise PolicyConfigError(f"{where}.filters: expected a list, got {filter_specs!r}")
    filters: list[Filter] = []
    for i, item in enumerate(filter_specs):
        fname, options = _name_and_options(item, f"{where}.filters[{i}]")
        filters.append(_construct("filter", fname, options, rng, f"{where}.filters[{i}]"))

    scorer_specs = spec.get("scorers", {})
    if not isinstance(scorer_specs, Mapping):
        raise PolicyConfigError(f"{where}.scorers: expected a mapping name -> weight")
    scorers: list[tuple[Scorer, float]] = []
    for sname, value in scorer_specs.items():
        at = f"{where}.scorers.{sname}"
        options = dict(value) if isinstance(value, Mapping) else {"weight": value}
        weight = options.pop("weight", 1.0)
        if (
            isinstance(weight, bool)
            or not isinstance(weight, int | float)
            or not math.isfinite(weight)
            or weight < 0
        ):
            raise PolicyConfigError(f"{at}: weight must be a number >= 0, got {weight!r}")
        scorer = _construct("scorer", sname, options, rng, at)
        scorers.append((scorer, float(weight)))
    names = [s.name for s, _ in scorers]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise PolicyConfigError(f"{where}.scorers: two scorers are named {dup!r}")

    pname, poptions = _name_and_options(spec.get("picker", "max_score"), f"{where}.picker")
    if "guard" in spec:
        try:
            poptions["guard"] = LoadGuard.from_config(spec["guard"])
        except (TypeError, ValueError) as exc:
            raise PolicyConfigError(f"{where}.guard: {exc}") from exc
        if "guard" not in _parameters(_lookup("picker", pname, f"{where}.picker")):
            raise PolicyConfigError(f"{where}.guard: picker {pname!r} takes no guard")
    picker: Picker = _construct("picker", pname, poptions, rng, f"{where}.picker")
    return Policy(name, filters=filters, scorers=scorers, picker=picker)


def _name_and_options(item: object, where: str) -> tuple[str, dict[str, Any]]:
    if isinstance(item, str):
        return item, {}
    if isinstance(item, Mapping):
        options = dict(item)
        name = options.pop("name", None)
        if not isinstance(name, str):
            raise PolicyConfigError(f"{where}.name: expected a plugin name, got {name!r}")
        return name, options
    raise PolicyConfigError(f"{where}: expected a name or a mapping with 'name', got {item!r}")


def _parameters(factory: Any) -> Mapping[str, inspect.Parameter]:
    try:
        return inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return {}


def _construct(
    kind: str, name: str, options: dict[str, Any], rng: random.Random, where: str
) -> Any:
    factory = _lookup(kind, name, where)
    if not callable(factory):
        raise PolicyConfigError(f"{where}: {name!r} is not a {kind} class or factory")
    params = _parameters(factory)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    valid = sorted(
        p
        for p, info in params.items()
        if p != "rng"
        and info.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    )
    for key in options:
        if key == "rng" or (key not in valid and not takes_any):
            listed = f"valid: {', '.join(valid)}" if valid else f"{kind} {name!r} takes no options"
            raise PolicyConfigError(f"{where}.{key}: unknown option; {listed}")
    if "rng" in params:
        options = {**options, "rng": rng}
    try:
        plugin = factory(**options)
    except (TypeError, ValueError) as exc:
        raise PolicyConfigError(f"{where}: {exc}") from exc
    method = _METHOD[kind]
    if not isinstance(getattr(plugin, "name", None), str) or not callable(
        getattr(plugin, method, None)
    ):
        raise PolicyConfigError(
            f"{where}: {name!r} is not a {kind} (needs a str `name` and a `{method}` method)"
        )
    _conform(plugin, kind, name, where)
    return plugin


def _conform(plugin: Any, kind: str, name: str, where: str) -> None:
    """Check the optional capabilities of `plugin`; give it those it does not declare, and say so.

    A plugin that subclasses its Protocol has them all. One that only matches structurally is
    taken to need the prefix (needs_prefix=True, unlike the Protocols' cheap default: it may read
    hit_blocks, and given zeros it would route wrongly without a sign), to give its name as its
    reason, and to learn nothing. Either of the first two is logged as a warning.
    """
    assumed: dict[str, object] = {}
    if not hasattr(plugin, "needs_prefix"):
        assumed["needs_prefix"] = True
    elif not isinstance(plugin.needs_prefix, bool):
        raise PolicyConfigError(
            f"{where}: needs_prefix of {name!r} must be a bool, got {plugin.needs_prefix!r}"
        )
    if kind == "scorer":
        if not hasattr(plugin, "reason"):
            assumed["reason"] = plugin.name
        elif not isinstance(plugin.reason, str):
            raise PolicyConfigError(
                f"{where}: reason of {name!r} must be a str, got {plugin.reason!r}"
            )
    if not hasattr(plugin, "observe"):
        assumed["observe"] = MethodType(Plugin.observe, plugin)
    elif not callable(plugin.observe):
        raise PolicyConfigError(f"{where}: observe of {name!r} must be a method")
    if not assumed:
        return
    protocol = f"policies.{_PROTOCOL[kind]}"
    for attr, value in assumed.items():
        try:
            setattr(plugin, attr, value)
        except (AttributeError, TypeError):
            raise PolicyConfigError(
                f"{where}: {name!r} does not declare `{attr}` and takes no attribute; "
                f"declare it or subclass {protocol}"
            ) from None
    if set(assumed) == {"observe"}:
        return  # without the method it cannot learn: nothing was assumed
    said = {
        "needs_prefix": "needs_prefix=True (the prompt is hashed and the index asked for every "
        "request; declare needs_prefix = False if it never reads hit_blocks or block_hashes)",
        "reason": f"reason={plugin.name!r}",
        "observe": "it learns nothing from outcomes",
    }
    _log.warning(
        "%s: %r does not declare %s; assumed %s. Subclass %s to declare them.",
        where,
        name,
        ", ".join(assumed),
        "; ".join(said[attr] for attr in assumed),
        protocol,
    )
