"""The engine: filters, then clamped and weighted scores, then the picker; decisions explained."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import pytest

from policies import Decision, Outcome, Policy, ReplicaView, RoutedRequest, Scorer
from policies.baselines import RoundRobinPicker
from policies.filters import Healthy, NotSaturated
from policies.pickers.max_score import MaxScorePicker
from policies.scorers.prefix import PrefixScorer
from policies.scorers.queue import QueueScorer

REQ = RoutedRequest("r", "m", "m", "p", 64, (1, 2, 3, 4), 16.0)


class Fixed(Scorer):
    """A scorer that answers a fixed table (may break the contract, to test the clamp)."""

    def __init__(self, name: str, table: dict[str, float], reason: str | None = None) -> None:
        self.name = name
        self.table = table
        self._reason = name if reason is None else reason
        self.observed: list[Outcome] = []

    @property
    def reason(self) -> str:
        return self._reason

    def score(self, req: RoutedRequest, views: Sequence[ReplicaView]) -> dict[str, float]:
        return dict(self.table)

    def observe(self, outcome: Outcome) -> None:
        self.observed.append(outcome)


class Exploding(Scorer):
    name = "exploding"

    def score(self, req: RoutedRequest, views: Sequence[ReplicaView]) -> dict[str, float]:
        raise AssertionError("a zero-weight scorer must not be asked")

    def observe(self, outcome: Outcome) -> None:
        self.seen = outcome


def _views(*names: str, **kw: object) -> list[ReplicaView]:
    return [ReplicaView(n, **kw) for n in names]  # type: ignore[arg-type]


def _policy(*scorers: tuple[Scorer, float], guard: bool | None = None) -> Policy:
    picker = MaxScorePicker(guard=guard)
    return Policy("t", filters=[Healthy()], scorers=scorers, picker=picker)


def test_engine_clamps_every_score_to_unit_interval() -> None:
    table = {"a": 1.7, "b": -0.3, "c": math.nan, "e": math.inf, "f": 0.4}  # "d" missing
    decision = _policy((Fixed("x", table), 2.0)).choose(REQ, _views("a", "b", "c", "d", "e", "f"))
    got = {name: s["x"] for name, s in decision.scores.items()}
    assert got == {"a": 1.0, "b": 0.0, "c": 0.0, "d": 0.0, "e": 1.0, "f": 0.4}
    assert decision.totals == pytest.approx({"a": 2.0, "b": 0, "c": 0, "d": 0, "e": 2.0, "f": 0.8})


def test_engine_applies_weights_and_sums() -> None:
    x = Fixed("x", {"a": 1.0, "b": 0.0}, reason="prefix")
    y = Fixed("y", {"a": 0.0, "b": 1.0}, reason="load")
    assert _policy((x, 3.0), (y, 2.0)).choose(REQ, _views("a", "b")).ranked == ["a", "b"]
    decision = _policy((x, 1.0), (y, 2.0)).choose(REQ, _views("a", "b"))
    assert decision.ranked == ["b", "a"]
    assert decision.totals == {"a": 1.0, "b": 2.0}
    assert decision.reason == "load"  # the scorer that put the winner ahead


def test_zero_weight_scorer_is_not_asked_but_still_learns() -> None:
    exploding = Exploding()
    policy = _policy((Fixed("x", {"a": 1.0}), 1.0), (exploding, 0.0))
    decision = policy.choose(REQ, _views("a", "b"))
    assert decision.ranked == ["a", "b"]
    assert "exploding" not in decision.scores["a"]
    outcome = Outcome("a", 64, 64, 0, 0, 0.1)
    policy.observe(outcome)
    assert exploding.seen is outcome


def test_ranked_lists_every_survivor_and_filtered_explains_the_rest() -> None:
    views = [
        ReplicaView("a", hit_blocks=1),
        ReplicaView("down", healthy=False),
        ReplicaView("b", hit_blocks=4),
        ReplicaView("full", inflight=2, max_inflight=2, hit_blocks=4),
        ReplicaView("c", hit_blocks=2),
    ]
    policy = Policy(
        "t",
        filters=[Healthy(), NotSaturated()],
        scorers=[(PrefixScorer(), 1.0)],
        picker=MaxScorePicker(),
    )
    decision = policy.choose(REQ, views)
    assert decision.ranked == ["b", "c", "a"]
    assert decision.replica == "b"
    assert decision.reason == "prefix"
    assert decision.predicted_hit_blocks == 4
    assert decision.filtered == {"down": "unhealthy", "full": "saturated (2/2 in flight)"}


def test_no_candidates_and_only_candidate() -> None:
    policy = _policy((PrefixScorer(), 1.0))
    none = policy.choose(REQ, _views("a", "b", healthy=False))
    assert (none.ranked, none.replica, none.reason) == ([], None, "no_candidates")
    assert set(none.filtered) == {"a", "b"}
    one = policy.choose(REQ, [ReplicaView("a", healthy=False), ReplicaView("b", hit_blocks=3)])
    assert (one.ranked, one.reason, one.predicted_hit_blocks) == (["b"], "only_candidate", 3)


@pytest.mark.parametrize(
    ("views", "reason"),
    [
        # the prefix hit outweighs the queue difference
        ([ReplicaView("a", hit_blocks=4, inflight=1), ReplicaView("b")], "prefix"),
        # same prefix everywhere: load decides
        ([ReplicaView("a", hit_blocks=4, inflight=1), ReplicaView("b", hit_blocks=4)], "load"),
        # nothing tells them apart, and neither holds any block: placed as a cold prompt
        ([ReplicaView("a"), ReplicaView("b")], "cold"),
    ],
)
def test_reason_names_the_deciding_scorer(views: list[ReplicaView], reason: str) -> None:
    decision = _policy((PrefixScorer(), 3.0), (QueueScorer(), 2.0)).choose(REQ, views)
    assert decision.reason == reason


def test_explain_is_json_ready() -> None:
    decision = _policy((PrefixScorer(), 3.0), (QueueScorer(), 2.0)).choose(
        REQ, [ReplicaView("a", hit_blocks=4), ReplicaView("b", healthy=False), ReplicaView("c")]
    )
    explained = json.loads(json.dumps(decision.explain()))
    assert explained["policy"] == "t"
    assert explained["ranked"] == ["a", "c"]
    assert explained["scores"]["a"] == {"prefix": 1.0, "queue": 1.0}
    assert explained["filtered"] == {"b": "unhealthy"}
    assert isinstance(decision, Decision)


def test_observe_reaches_every_learner_once() -> None:
    x, y = Fixed("x", {}), Fixed("y", {})
    policy = Policy("t", scorers=[(x, 1.0), (y, 2.0)], picker=RoundRobinPicker())
    outcome = Outcome("a", 64, 0, 0, 0, 0.2)
    policy.observe(outcome)
    assert x.observed == [outcome] and y.observed == [outcome]


@pytest.mark.parametrize(
    ("weight", "error"), [(-1.0, ValueError), (math.nan, ValueError), ("2", TypeError)]
)
def test_policy_rejects_bad_weights(weight: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="weight"):
        Policy("t", scorers=[(PrefixScorer(), weight)], picker=RoundRobinPicker())  # type: ignore[list-item]


def test_policy_rejects_duplicate_scorer_names() -> None:
    with pytest.raises(ValueError, match="prefix"):
        Policy("t", scorers=[(PrefixScorer(), 1), (PrefixScorer(), 2)], picker=RoundRobinPicker())


@pytest.mark.parametrize(
    ("home", "ranked", "reason", "hit"),
    [
        (None, ["b", "c", "a"], "prefix", 4),  # no state elsewhere: the policy's own order
        ("a", ["a", "b", "c"], "previous_response", 1),  # the replica holding the response first
        ("b", ["b", "c", "a"], "previous_response", 4),  # already first: still its reason
        ("down", ["b", "c", "a"], "prefix", 4),  # filtered out: the follow-up goes elsewhere
    ],
)
def test_a_home_replica_that_survives_the_filters_goes_first(
    home: str | None, ranked: list[str], reason: str, hit: int
) -> None:
    """`RoutedRequest.home` (a /v1/responses follow-up's replica) is an input of the policy:
    first when it survived the filters, with the reason `previous_response` and its own hit."""
    views = [ReplicaView("a", hit_blocks=1), ReplicaView("down", healthy=False),
             ReplicaView("b", hit_blocks=4), ReplicaView("c", hit_blocks=2)]  # fmt: skip
    req = RoutedRequest("r", "m", "m", "p", 64, (1, 2, 3, 4), 16.0, home=home)
    decision = _policy((PrefixScorer(), 1.0)).choose(req, views)
    assert (decision.ranked, decision.reason, decision.predicted_hit_blocks) == (ranked, reason, hit)
    only = _policy((PrefixScorer(), 1.0)).choose(req, [ReplicaView(home or "x", hit_blocks=2)])
    assert only.reason == ("previous_response" if home else "only_candidate")
