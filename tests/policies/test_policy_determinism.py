"""Same seed, same decisions: each policy owns its random.Random; the global random is untouched."""

from __future__ import annotations

import random

import pytest

from policies import POLICY_NAMES, Decision, ReplicaView, RoutedRequest, build_policy


def _run(name: str, seed: int | None, blocks: tuple[int, ...] = tuple(range(8))) -> list[Decision]:
    policy = build_policy(name, seed=seed)
    rng = random.Random(99)  # the workload, independent of the policy's seed
    decisions = []
    for i in range(200):
        views = [
            ReplicaView(f"r{j}", inflight=rng.randrange(3), hit_blocks=rng.choice([0, 0, 4, 8]))
            for j in range(6)
        ]
        req = RoutedRequest(f"q{i}", "m", "m", "p", 512, blocks, 64.0, session_key="s")
        decisions.append(policy.choose(req, views))
    return decisions


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_same_seed_same_decisions(name: str) -> None:
    state = random.getstate()
    assert _run(name, 7) == _run(name, 7)
    assert random.getstate() == state  # never the global random


@pytest.mark.parametrize("name", ["random", "least_loaded"])
def test_different_seeds_break_ties_differently(name: str) -> None:
    assert [d.ranked for d in _run(name, 1)] != [d.ranked for d in _run(name, 2)]


@pytest.mark.parametrize("name", ["prefix_aware", "ttft", "cost_blocks"])
def test_max_score_ties_follow_the_prompt_not_the_seed(name: str) -> None:
    """Near ties go by a rendezvous hash of the prompt's first block, the same in every process
    (two gateways place a new prefix alike); only a prompt without blocks gets the seeded pick."""
    assert [d.ranked for d in _run(name, 1)] == [d.ranked for d in _run(name, 2)]
    assert [d.ranked for d in _run(name, 1, ())] != [d.ranked for d in _run(name, 2, ())]
