"""A burst sharing a new prefix, faster than the scrape: the gateway's in-flight counts spread it.

Between choose() calls the test does what the gateway does at dispatch: it counts the request
in the chosen replica's `inflight` and `inflight_prompt_tokens` at once. The scraped fields
(waiting, running, kv_usage) stay as the last scrape saw them: idle.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from policies import POLICY_NAMES, ReplicaView, RoutedRequest, build_policy

N_REPLICAS, BURST = 8, 32
PROMPT_TOKENS, TPB = 4096, 64.0
BLOCKS = tuple(range(int(PROMPT_TOKENS // TPB)))


def _burst(policy_name: str, *, predict_on_route: bool, seed: int) -> Counter[str]:
    """Route BURST requests sharing one prompt prefix; return requests per replica.

    predict_on_route: the index records each routing decision at once (a speculative entry), so
    later requests of the burst see the prefix on the replicas already chosen.
    """
    policy = build_policy(policy_name, seed=seed)
    views = {
        f"r{i}": ReplicaView(f"r{i}", waiting=0, running=0, kv_usage=0.1) for i in range(N_REPLICAS)
    }
    counts: Counter[str] = Counter()
    for i in range(BURST):
        req = RoutedRequest(f"q{i}", "m", "m", "p", PROMPT_TOKENS, BLOCKS, TPB)
        decision = policy.choose(req, list(views.values()))
        chosen = views[decision.ranked[0]]
        uncached = max(0, PROMPT_TOKENS - int(chosen.hit_blocks * TPB))
        views[chosen.name] = dataclasses.replace(
            chosen,
            inflight=chosen.inflight + 1,
            inflight_prompt_tokens=chosen.inflight_prompt_tokens + uncached,
            hit_blocks=len(BLOCKS) if predict_on_route else chosen.hit_blocks,
        )
        counts[chosen.name] += 1
    return counts


@pytest.mark.parametrize("name", [n for n in POLICY_NAMES if n != "random"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_burst_without_index_updates_spreads_evenly(name: str, seed: int) -> None:
    counts = _burst(name, predict_on_route=False, seed=seed)
    assert max(counts.values()) == BURST // N_REPLICAS, counts


# With the prefix recorded on each chosen replica, affinity pulls the burst together; what stops
# it is each policy's own limit on load:
# - prefix_aware: the guard trips once the best replica has 8 more requests than the emptiest (9).
# - cost_blocks: the first request's prefill is still queued where the prefix was recorded,
#   so a "hit" there saves nothing yet; load decides and the burst spreads evenly (4).
# - sticky: releases once a replica holds about 2 s of prefill-equivalent tokens more (8).
@pytest.mark.parametrize(
    ("name", "most_on_one"),
    [("prefix_aware", 9), ("cost_blocks", 4), ("sticky", 8)],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_burst_with_predict_on_route_never_lands_on_one_replica(
    name: str, most_on_one: int, seed: int
) -> None:
    counts = _burst(name, predict_on_route=True, seed=seed)
    assert max(counts.values()) <= most_on_one, counts
    assert len(counts) >= BURST // most_on_one, counts


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ttft_keeps_a_burst_on_a_new_prefix_together(seed: int) -> None:
    """ttft: waiting for the first request's prefill there costs what prefilling elsewhere would,
    so the near tie goes to the replica counted as holding the prefix: one prefill, not eight."""
    counts = _burst("ttft", predict_on_route=True, seed=seed)
    assert len(counts) <= 2, counts


def test_sglang_cache_aware_keeps_its_published_hot_spot() -> None:
    # SGLang's imbalance switch needs a gap over 64 requests: a 32-request burst stays on one
    # replica. Kept faithful on purpose, so benchmarks show what its users reported.
    counts = _burst("sglang_cache_aware", predict_on_route=True, seed=0)
    assert list(counts.values()) == [BURST]
