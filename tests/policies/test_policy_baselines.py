"""Baselines as policies: round robin cycles, least loaded picks the emptiest, random spreads."""

from __future__ import annotations

from collections import Counter

from policies import ReplicaView, RoutedRequest, build_policy

REQ = RoutedRequest("r", "m", "m", "p", 64, (1, 2, 3, 4), 16.0)
VIEWS = [ReplicaView(n) for n in "abc"]


def test_round_robin_cycles_and_ranks_the_rest_in_order() -> None:
    policy = build_policy("round_robin", seed=0)
    decisions = [policy.choose(REQ, VIEWS) for _ in range(4)]
    assert [d.ranked for d in decisions] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]
    assert {d.reason for d in decisions} == {"round_robin"}


def test_round_robin_skips_filtered_replicas() -> None:
    policy = build_policy("round_robin", seed=0)
    views = [ReplicaView("a"), ReplicaView("down", healthy=False), ReplicaView("b")]
    assert [policy.choose(REQ, views).replica for _ in range(4)] == ["a", "b", "a", "b"]


def test_least_loaded_picks_the_emptiest() -> None:
    policy = build_policy("least_loaded", seed=0)
    views = [
        ReplicaView("a", inflight=4),
        ReplicaView("b", inflight=1, waiting=3, running=2),  # the scrape says 5
        ReplicaView("c", inflight=2),
    ]
    decision = policy.choose(REQ, views)
    assert (decision.ranked, decision.reason) == (["c", "a", "b"], "load")


def test_least_loaded_breaks_ties_at_random() -> None:
    policy = build_policy("least_loaded", seed=0)
    counts = Counter(policy.choose(REQ, VIEWS).replica for _ in range(300))
    assert set(counts) == set("abc") and min(counts.values()) > 60


def test_random_spreads() -> None:
    policy = build_policy("random", seed=0)
    decisions = [policy.choose(REQ, VIEWS) for _ in range(300)]
    counts = Counter(d.replica for d in decisions)
    assert set(counts) == set("abc") and min(counts.values()) > 60
    assert all(sorted(d.ranked) == ["a", "b", "c"] and d.reason == "random" for d in decisions)
