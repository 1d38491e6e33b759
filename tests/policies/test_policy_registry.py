"""Registry: presets and plugins by name, the module:attr escape hatch, precise config errors."""

from __future__ import annotations

import random
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from policies import (
    POLICY_NAMES,
    Policy,
    PolicyConfigError,
    ReplicaView,
    RoutedRequest,
    build_policy,
)
from policies.registry import TABLE

REQ = RoutedRequest("r", "m", "m", "p", 1024, tuple(range(16)), 64.0)


def _fleet(seed: int) -> list[ReplicaView]:
    rng = random.Random(seed)
    return [
        ReplicaView(
            f"r{i}",
            healthy=rng.random() > 0.1,
            inflight=rng.randrange(0, 12),
            inflight_prompt_tokens=rng.randrange(0, 20_000),
            kv_usage=rng.choice([None, rng.random()]),
            hit_blocks=rng.randrange(0, 17),
        )
        for i in range(8)
    ]


def test_policy_names_are_the_presets() -> None:
    assert set(POLICY_NAMES) == {
        "prefix_aware",
        "ttft",
        "cost_blocks",
        "sticky",
        "sglang_cache_aware",
        "round_robin",
        "least_loaded",
        "random",
    }
    assert POLICY_NAMES[0] == "prefix_aware"


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_preset_builds_and_ranks_every_survivor(name: str) -> None:
    policy = build_policy(name, seed=1)
    assert policy.name == name
    for seed in range(20):
        views = _fleet(seed)
        decision = policy.choose(REQ, views)
        healthy = {v.name for v in views if v.healthy}
        assert sorted(decision.ranked) == sorted(healthy)
        assert set(decision.filtered) == {v.name for v in views} - healthy
        assert decision.reason and decision.policy == name


def test_preset_weights() -> None:
    weights = {s.name: w for s, w in build_policy("prefix_aware").scorers}
    assert weights == {"prefix": 3.0, "queue": 2.0, "kv_pressure": 2.0}
    assert {s.name: w for s, w in build_policy("ttft").scorers} == {"ttft": 1.0}
    assert build_policy("ttft").picker.guard is None  # type: ignore[attr-defined]
    assert [s.name for s, _ in build_policy("cost_blocks").scorers] == ["cost_blocks"]
    assert [f.name for f in build_policy("round_robin").filters] == [
        "healthy",
        "serves_model",
        "serves_adapter",
        "not_saturated",
    ]


def test_every_table_entry_resolves() -> None:
    for kind, table in TABLE.items():
        for name in table:
            if kind == "policy":
                build_policy(name)
            else:
                build_policy({"filters": [], **_spec_with(kind, name)})


def _spec_with(kind: str, name: str) -> dict[str, Any]:
    if kind == "filter":
        return {"filters": [name]}
    if kind == "scorer":
        return {"scorers": {name: 1}}
    return {"picker": name}


def test_mapping_spec() -> None:
    policy = build_policy(
        {
            "name": "mine",
            "scorers": {
                "prefix": 3,
                "queue": 2,
                "kv_pressure": {"weight": 2, "unknown_usage": 0.7},
                "ttft": 0,
            },
            "picker": "max_score",
            "guard": {"max_load_gap": 4, "max_load_ratio": 1.5},
            "filters": ["healthy", "serves_model"],
        },
        seed=3,
    )
    assert policy.name == "mine"
    assert [(s.name, w) for s, w in policy.scorers] == [
        ("prefix", 3.0),
        ("queue", 2.0),
        ("kv_pressure", 2.0),
        ("ttft", 0.0),
    ]
    assert policy.picker.guard.max_load_gap == 4  # type: ignore[attr-defined]
    assert [f.name for f in policy.filters] == ["healthy", "serves_model"]


def test_preset_with_overrides() -> None:
    policy = build_policy({"preset": "prefix_aware", "guard": False})
    assert policy.name == "prefix_aware"
    assert policy.picker.guard is None  # type: ignore[attr-defined]
    assert len(policy.scorers) == 3
    sticky = build_policy(
        {"preset": "sticky", "picker": {"name": "sticky", "max_ttft_penalty_s": 5}}
    )
    assert sticky.picker.max_ttft_penalty_s == 5.0  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "prefx_aware",
            "policy: unknown policy 'prefx_aware'; valid: cost_blocks, least_loaded, "
            "prefix_aware, random, round_robin, sglang_cache_aware, sticky, ttft, "
            "or 'module:attr'",
        ),
        (42, "policy: expected a preset name, 'module:attr' or a mapping, got int"),
        (
            {"scorer": {}},
            "policy.scorer: unknown key; valid: name, preset, filters, scorers, picker, guard",
        ),
        (
            {"scorers": {"prefx": 1}},
            "policy.scorers.prefx: unknown scorer 'prefx'; valid: "
            "cost_blocks, kv_pressure, lora_affinity, prefix, queue, session, ttft, "
            "or 'module:attr'",
        ),
        (
            {"scorers": {"prefix": -1}},
            "policy.scorers.prefix: weight must be a number >= 0, got -1",
        ),
        ({"scorers": {"prefix": True}}, "policy.scorers.prefix: weight must be a number"),
        ({"scorers": {"prefix": "3"}}, "policy.scorers.prefix: weight must be a number"),
        ({"scorers": ["prefix"]}, "policy.scorers: expected a mapping"),
        (
            {"scorers": {"kv_pressure": {"weight": 1, "unknwn": 1}}},
            "policy.scorers.kv_pressure.unknwn: unknown option; valid: unknown_usage",
        ),
        (
            {"scorers": {"kv_pressure": {"unknown_usage": 3}}},
            "policy.scorers.kv_pressure: unknown_usage must be in [0, 1], got 3",
        ),
        (
            {"scorers": {"queue": {"weight": 1, "rng": 1}}},
            "policy.scorers.queue.rng: unknown option; scorer 'queue' takes no options",
        ),
        (
            {"filters": ["healthy", "sick"]},
            "policy.filters[1]: unknown filter 'sick'; valid: healthy, not_saturated, serves_adapter, serves_model",
        ),
        ({"filters": "healthy"}, "policy.filters: expected a list"),
        ({"filters": [{"nme": "healthy"}]}, "policy.filters[0].name: expected a plugin name"),
        (
            {"filters": [{"name": "healthy", "strict": True}]},
            "policy.filters[0].strict: unknown option; filter 'healthy' takes no options",
        ),
        (
            {"picker": "best"},
            "policy.picker: unknown picker 'best'; valid: least_loaded, "
            "max_score, random, round_robin, sglang_cache_aware, sticky",
        ),
        (
            {"picker": {"name": "sticky", "affinity": 0.5}},
            "policy.picker.affinity: unknown option; valid: affinity_threshold, "
            "held_tokens_per_request, max_ttft_penalty_s, peak_prefill_tokens_per_s",
        ),
        (
            {"picker": "round_robin", "guard": {"max_load_gap": 3}},
            "policy.guard: picker 'round_robin' takes no guard",
        ),
        ({"guard": {"gap": 3}}, "policy.guard: guard: unknown key 'gap'"),
        ({"preset": "nope"}, "policy.preset: unknown policy 'nope'"),
        ({"name": ""}, "policy.name: expected a non-empty string"),
        (
            {"scorers": {"policies.filters:Healthy": 1}},
            "policy.scorers.policies.filters:Healthy: 'policies.filters:Healthy' is not a scorer",
        ),
        (
            {"scorers": {"no_such_module_xyz:Scorer": 1}},
            "cannot import module 'no_such_module_xyz'",
        ),
        (
            {"scorers": {"policies.scorers.prefix:Nope": 1}},
            "module 'policies.scorers.prefix' has no attribute 'Nope'",
        ),
        ({"scorers": {":Nope": 1}}, "':Nope' is not of the form 'module:attr'"),
    ],
)
def test_config_errors_name_the_key_and_the_valid_choices(spec: object, message: str) -> None:
    with pytest.raises(PolicyConfigError) as info:
        build_policy(spec)  # type: ignore[arg-type]
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_module_attr_escape_hatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_routing.py").write_text(
        textwrap.dedent(
            """
            from policies import Policy
            from policies.baselines import RoundRobinPicker

            class Constant:
                name = "constant"

                def __init__(self, *, value=0.5):
                    self.value = value

                def score(self, req, views):
                    return {v.name: self.value for v in views}

            SPEC = {"scorers": {"my_routing:Constant": {"weight": 1, "value": 0.25}}}

            def make(seed=None):
                return Policy("made", picker=RoundRobinPicker())

            def not_a_policy():
                return 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "my_routing", None)  # restored (removed) after the test
    del sys.modules["my_routing"]
    from_spec = build_policy("my_routing:SPEC")
    decision = from_spec.choose(REQ, [ReplicaView("a"), ReplicaView("b")])
    assert decision.scores["a"] == {"constant": 0.25}
    assert build_policy("my_routing:make").name == "made"
    assert isinstance(build_policy("my_routing:make"), Policy)
    with pytest.raises(PolicyConfigError, match="returned 3, not a Policy"):
        build_policy("my_routing:not_a_policy")
