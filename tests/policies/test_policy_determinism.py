"""Same seed, same decisions: each policy owns its random.Random; the global random is untouched."""

from __future__ import annotations

import random

import pytest

from policies import POLICY_NAMES, Decision, ReplicaView, RoutedRequest, build_policy


def _run(name: str, seed: int | None) -> list[Decision]:
    policy = build_policy(name, seed=seed)
    rng = random.Random(99)  # the workload, independent of the policy's seed
    decisions = []
    for i in range(200):
        views = [
            ReplicaView(f"r{j}", inflight=rng.randrange(3), hit_blocks=rng.choice([0, 0, 4, 8]))
            for j in range(6)
        ]
        req = RoutedRequest(f"q{i}", "m", "m", "p", 512, tuple(range(8)), 64.0, session_key="s")
        decisions.append(policy.choose(req, views))
    return decisions


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_same_seed_same_decisions(name: str) -> None:
    state = random.getstate()
    assert _run(name, 7) == _run(name, 7)
    assert random.getstate() == state  # never the global random


@pytest.mark.parametrize("name", ["random", "least_loaded", "prefix_aware"])
def test_different_seeds_break_ties_differently(name: str) -> None:
    assert [d.ranked for d in _run(name, 1)] != [d.ranked for d in _run(name, 2)]
