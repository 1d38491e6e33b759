"""The optional capabilities (needs_prefix, reason, observe): Protocol defaults, honest built-ins,
how a Policy combines them, and what the registry assumes for a structural plugin."""

from __future__ import annotations

import inspect
import logging
import random
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from policies import (
    Filter,
    Outcome,
    Picker,
    Policy,
    PolicyConfigError,
    ReplicaView,
    RoutedRequest,
    Scorer,
    build_policy,
)
from policies.base import learns
from policies.baselines import RoundRobinPicker
from policies.filters import Healthy
from policies.registry import TABLE, resolve
from policies.scorers.prefix import PrefixScorer
from policies.scorers.queue import QueueScorer

PROTOCOLS: dict[str, Any] = {"filter": Filter, "scorer": Scorer, "picker": Picker}
# The built-ins that cannot do their job without the prompt's blocks; every other one must give
# the same answer whether or not the gateway hashed the prompt.
NEEDS_PREFIX = {"prefix", "ttft", "cost_blocks", "sticky", "sglang_cache_aware"}
# Reads hit_blocks as a near-tie break when another plugin had the prompt hashed; without them
# it still ranks by the totals.
OPPORTUNISTIC = {"max_score"}
BUILTINS = [(kind, name) for kind in PROTOCOLS for name in TABLE[kind]]


class Minimal(Scorer):
    name = "minimal"

    def score(self, req: RoutedRequest, views: Sequence[ReplicaView]) -> dict[str, float]:
        return {}


class Hungry(Filter):
    name = "hungry"
    needs_prefix = True

    def keep(self, req: RoutedRequest, view: ReplicaView) -> str | None:
        return None


class Counting(Scorer):
    name = "counting"

    def __init__(self) -> None:
        self.seen = 0

    def score(self, req: RoutedRequest, views: Sequence[ReplicaView]) -> dict[str, float]:
        return {}

    def observe(self, outcome: Outcome) -> None:
        self.seen += 1


def _make(kind: str, name: str) -> Any:
    factory = resolve(TABLE[kind][name])
    takes_rng = "rng" in inspect.signature(factory).parameters
    return factory(rng=random.Random(0)) if takes_rng else factory()


def _answer(kind: str, name: str, req: RoutedRequest, views: list[ReplicaView]) -> object:
    plugin = _make(kind, name)  # fresh, same seed: randomness is the same for both answers
    if kind == "filter":
        return [plugin.keep(req, v) for v in views]
    if kind == "scorer":
        return plugin.score(req, views)
    return plugin.pick(req, views, {v.name: 0.5 for v in views})


def _fleet(seed: int) -> tuple[RoutedRequest, list[ReplicaView], RoutedRequest, list[ReplicaView]]:
    """The same request and replicas with the prefix (hashes, hits) and without it (the gateway
    skipped hashing: no hashes, every hit 0)."""
    rng = random.Random(seed)
    with_prefix = RoutedRequest("r", "m", "m", "p", 1024, tuple(range(16)), 64.0, session_key="s")
    without = RoutedRequest("r", "m", "m", "p", 1024, (), 64.0, session_key="s")
    views = [
        ReplicaView(
            f"r{i}",
            inflight=rng.randrange(0, 6),
            inflight_prompt_tokens=rng.randrange(0, 4000),
            kv_usage=rng.random(),
            hit_blocks=rng.choice([0, 4, 13, 16]),
        )
        for i in range(4)
    ]
    cold = [
        ReplicaView(v.name, inflight=v.inflight, inflight_prompt_tokens=v.inflight_prompt_tokens,
                    kv_usage=v.kv_usage)
        for v in views
    ]  # fmt: skip
    return with_prefix, views, without, cold


def test_an_explicit_subclass_inherits_the_cheap_defaults() -> None:
    plugin = Minimal()
    assert plugin.needs_prefix is False
    assert plugin.reason == "minimal"
    plugin.observe(Outcome("a", 1, 0, 0, 0, 0.1))  # does nothing
    assert not learns(plugin) and learns(Counting())
    assert isinstance(plugin, Scorer)


@pytest.mark.parametrize(("kind", "name"), BUILTINS)
def test_every_builtin_subclasses_its_protocol(kind: str, name: str) -> None:
    cls = resolve(TABLE[kind][name])
    assert PROTOCOLS[kind] in cls.__mro__
    assert cls.needs_prefix is (name in NEEDS_PREFIX)


@pytest.mark.parametrize(("kind", "name"), BUILTINS)
def test_needs_prefix_is_honest(kind: str, name: str) -> None:
    differs = False
    for seed in range(30):
        with_prefix, views, without, cold = _fleet(seed)
        differs |= _answer(kind, name, with_prefix, views) != _answer(kind, name, without, cold)
    if name in NEEDS_PREFIX:
        assert differs, f"{name} declares needs_prefix but its answers never depend on the prefix"
    elif name not in OPPORTUNISTIC:
        assert not differs, f"{name} reads the prefix but does not declare needs_prefix"


def test_policy_needs_the_prefix_when_a_plugin_it_asks_does() -> None:
    def needs(*scorers: tuple[Scorer, float], filters: Sequence[Filter] = ()) -> bool:
        return Policy("t", filters=filters, scorers=scorers, picker=RoundRobinPicker()).needs_prefix

    assert not needs((QueueScorer(), 1.0), filters=[Healthy()])
    assert not needs((QueueScorer(), 1.0), (PrefixScorer(), 0.0))  # never asked: costs nothing
    assert needs((QueueScorer(), 1.0), (PrefixScorer(), 0.5))
    assert needs((QueueScorer(), 1.0), filters=[Healthy(), Hungry()])
    assert build_policy({"picker": "sticky"}).needs_prefix


def test_only_real_learners_are_fed_outcomes() -> None:
    counting = Counting()
    policy = Policy("t", scorers=[(Minimal(), 1.0), (counting, 0.0)], picker=RoundRobinPicker())
    policy.observe(Outcome("a", 1, 0, 0, 0, 0.1))
    assert counting.seen == 1
    assert [learns(s) for s, _ in policy.scorers] == [False, True]


PLUGINS = """
class Bare:
    name = "bare"

    def score(self, req, views):
        return {v.name: v.hit_blocks / 16 for v in views}

class Declared:
    name = "declared"
    needs_prefix = False
    reason = "load"

    def score(self, req, views):
        return {v.name: 1.0 / (1 + v.inflight) for v in views}

class BarePicker:
    name = "bare_picker"

    def pick(self, req, views, totals):
        return [v.name for v in views], "bare"

class Slotted:
    __slots__ = ()
    name = "slotted"

    def score(self, req, views):
        return {}

class BadFlag:
    name = "bad_flag"
    needs_prefix = "no"

    def score(self, req, views):
        return {}
"""


@pytest.fixture
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    module = "policy_capability_plugins"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(PLUGINS))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, module, None)  # restored (removed) after the test
    del sys.modules[module]
    return module


def test_registry_fills_what_a_structural_plugin_lacks_and_says_so(
    plugins: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="policies.registry"):
        policy = build_policy({"scorers": {f"{plugins}:Bare": 1}, "picker": "round_robin"})
    scorer = policy.scorers[0][0]
    assert policy.needs_prefix  # it may read hit_blocks: never assumed cheap
    assert (scorer.needs_prefix, scorer.reason, learns(scorer)) == (True, "bare", False)
    scorer.observe(Outcome("a", 1, 0, 0, 0, 0.1))  # the filled-in default: does nothing
    (record,) = caplog.records
    message = record.getMessage()
    assert message.startswith(f"policy.scorers.{plugins}:Bare: '{plugins}:Bare' does not declare")
    assert "needs_prefix, reason, observe; assumed needs_prefix=True" in message
    assert "reason='bare'" in message and "Subclass policies.Scorer" in message


def test_registry_keeps_what_a_structural_plugin_declares(
    plugins: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="policies.registry"):
        policy = build_policy({"scorers": {f"{plugins}:Declared": 1}, "picker": "round_robin"})
    assert not policy.needs_prefix
    assert policy.scorers[0][0].reason == "load"
    assert caplog.records == []  # only `observe` was missing: nothing to learn is no assumption
    views = [ReplicaView("a", inflight=3), ReplicaView("b")]
    req = RoutedRequest("r", "m", "m", "p", 64, (), 16.0)
    assert Policy("t", scorers=policy.scorers, picker=policy.picker).choose(req, views).ranked


def test_registry_fills_a_structural_picker(plugins: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="policies.registry"):
        policy = build_policy({"picker": f"{plugins}:BarePicker"})
    assert policy.needs_prefix and policy.picker.needs_prefix
    assert "policy.picker" in caplog.text and "Subclass policies.Picker" in caplog.text


@pytest.mark.parametrize(
    ("attr", "message"),
    [
        ("Slotted", "'{m}:Slotted' does not declare `needs_prefix` and takes no attribute"),
        ("BadFlag", "needs_prefix of '{m}:BadFlag' must be a bool, got 'no'"),
    ],
)
def test_registry_rejects_capabilities_it_cannot_fill_or_trust(
    plugins: str, attr: str, message: str
) -> None:
    with pytest.raises(PolicyConfigError) as info:
        build_policy({"scorers": {f"{plugins}:{attr}": 1}})
    assert message.format(m=plugins) in str(info.value)
