"""Pickers: max_score ties and hot-spot guard, sticky until saturated, SGLang's cache_aware."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from policies import ReplicaView, RoutedRequest
from policies.pickers.max_score import LoadGuard, MaxScorePicker
from policies.pickers.sglang_cache_aware import SGLangCacheAwarePicker
from policies.pickers.sticky import StickyPicker

# 10 blocks of 100 tokens
REQ = RoutedRequest("r", "m", "m", "p", 1000, tuple(range(10)), 100.0)


def test_max_score_ranks_by_total() -> None:
    views = [ReplicaView("a"), ReplicaView("b"), ReplicaView("c")]
    ranked, reason = MaxScorePicker().pick(REQ, views, {"a": 1.0, "b": 3.0, "c": 2.0})
    assert (ranked, reason) == (["b", "c", "a"], "score")


def test_max_score_tie_goes_to_least_loaded() -> None:
    views = [
        ReplicaView("a", inflight=3, hit_blocks=1),
        ReplicaView("b", waiting=1, running=1, hit_blocks=1),
        ReplicaView("c", hit_blocks=1),
    ]
    ranked, reason = MaxScorePicker().pick(REQ, views, {"a": 2.0, "b": 2.0, "c": 2.0})
    assert (ranked, reason) == (["c", "b", "a"], "tie")


COLD_CASES = [
    # (views, totals, winner): a prompt no replica holds any block of
    # idle fleet, small learned differences: the replica with the fewest placed blocks wins
    ([ReplicaView("a", placed_blocks=90), ReplicaView("b", placed_blocks=10),
      ReplicaView("c", placed_blocks=50)], {"a": 1.0, "b": 0.95, "c": 0.97}, "b"),
    # within the slack, fewer requests beat fewer placed blocks
    ([ReplicaView("a", inflight=2), ReplicaView("b", inflight=1, placed_blocks=500)],
     {"a": 1.0, "b": 0.92}, "b"),
    # outside the slack the scores still decide (a slow or busy replica stays out)
    ([ReplicaView("a", placed_blocks=900), ReplicaView("b")], {"a": 1.0, "b": 0.5}, "a"),
]


@pytest.mark.parametrize(("views", "totals", "winner"), COLD_CASES)
def test_cold_prompts_spread_by_load_then_placed_blocks(
    views: list[ReplicaView], totals: dict[str, float], winner: str
) -> None:
    ranked, reason = MaxScorePicker(guard=False).pick(REQ, views, totals)
    assert ranked[0] == winner
    assert reason in ("cold", "score")


def test_cold_placement_spreads_new_prefixes_one_at_a_time() -> None:
    """New prefixes arriving one by one on an idle fleet land on every replica in turn."""
    names = "abcd"
    placed = dict.fromkeys(names, 0)
    for _ in range(8):
        views = [ReplicaView(n, placed_blocks=placed[n]) for n in names]
        totals = {n: 1.0 - 0.01 * i for i, n in enumerate(names)}  # "a" always looks a bit faster
        win = MaxScorePicker(guard=False).pick(REQ, views, totals)[0][0]
        placed[win] += len(REQ.block_hashes)
    assert set(placed.values()) == {2 * len(REQ.block_hashes)}


def test_a_prompt_with_a_hit_somewhere_is_not_cold() -> None:
    views = [ReplicaView("a", placed_blocks=900, hit_blocks=1), ReplicaView("b")]
    ranked, reason = MaxScorePicker(guard=False).pick(REQ, views, {"a": 0.95, "b": 1.0})
    assert ranked[0] == "a" and reason == "tie"  # within the slack, the block holder wins


def test_max_score_full_tie_without_blocks_is_random_but_seeded() -> None:
    views = [ReplicaView(n) for n in "abcd"]
    totals = dict.fromkeys("abcd", 1.0)
    req = RoutedRequest("r", "m", "m", "p", 1000, (), 100.0)

    def winners(seed: int) -> list[str]:
        picker = MaxScorePicker(rng=random.Random(seed))
        return [picker.pick(req, views, totals)[0][0] for _ in range(400)]

    assert winners(1) == winners(1)
    assert winners(1) != winners(2)
    counts = Counter(winners(1))
    assert set(counts) == set("abcd") and min(counts.values()) > 60


def test_max_score_full_tie_goes_by_first_block_in_every_process() -> None:
    """A full tie on a prompt with blocks: the rendezvous hash of its first block decides, so
    two pickers (two gateways, any seeds) agree, and first blocks spread over the replicas."""
    views = [ReplicaView(n) for n in "abcd"]
    totals = dict.fromkeys("abcd", 1.0)
    a, b = MaxScorePicker(rng=random.Random(1)), MaxScorePicker(rng=random.Random(2))
    winners = []
    for first in range(400):
        req = RoutedRequest("r", "m", "m", "p", 1000, (first * 7919 + 13, 1, 2), 100.0)
        ranked, reason = a.pick(req, views, totals)
        assert b.pick(req, views, totals)[0] == ranked  # the whole order, not only the winner
        assert reason == "cold"
        winners.append(ranked[0])
    counts = Counter(winners)
    assert set(counts) == set("abcd") and min(counts.values()) > 60


@pytest.mark.parametrize(
    ("guard", "best_load", "min_load", "trips"),
    [
        (LoadGuard(8, 2.0), 9, 0, True),
        (LoadGuard(8, 2.0), 8, 0, False),  # gap 8 is not more than 8
        (LoadGuard(8, 2.0), 20, 11, False),  # gap 9 but 20 < 2 * 11
        (LoadGuard(8, 2.0), 30, 11, True),
        (LoadGuard(8, None), 20, 11, True),
        (LoadGuard(None, 2.0), 3, 1, True),
        (LoadGuard(None, 2.0), 2, 1, False),
        (LoadGuard(None, None), 100, 0, False),
    ],
)
def test_load_guard(guard: LoadGuard, best_load: int, min_load: int, trips: bool) -> None:
    assert guard.trips(best_load, min_load) is trips


def test_guard_picks_by_load_when_the_best_is_a_hot_spot() -> None:
    views = [ReplicaView("hot", inflight=12), ReplicaView("b", inflight=1), ReplicaView("c")]
    totals = {"hot": 5.0, "b": 1.0, "c": 0.5}
    assert MaxScorePicker().pick(REQ, views, totals) == (["c", "b", "hot"], "guard")
    assert MaxScorePicker(guard=False).pick(REQ, views, totals) == (["hot", "b", "c"], "score")
    custom = MaxScorePicker(guard={"max_load_gap": 16})
    assert custom.pick(REQ, views, totals)[1] == "score"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"max_load_gpa": 1}, "unknown key 'max_load_gpa'"),
        ({"max_load_gap": -1}, "max_load_gap must be a number >= 0"),
        ("yes", "guard must be a mapping"),
    ],
)
def test_guard_config_errors(config: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LoadGuard.from_config(config)  # type: ignore[arg-type]


def _sticky() -> StickyPicker:
    # threshold: 16000 tok/s * 2 s = 32000 tokens more than the best non-sticky replica
    return StickyPicker(rng=random.Random(0))


@pytest.mark.parametrize(
    ("views", "ranked", "reason"),
    [
        # nobody holds 80 % of the prompt: least token load
        (
            [ReplicaView("a", hit_blocks=7, inflight_prompt_tokens=900), ReplicaView("b")],
            ["b", "a"],
            "load",
        ),
        # a holds it and is busier, but not by 2 s of prefill
        (
            [
                ReplicaView("a", hit_blocks=10, inflight=3, inflight_prompt_tokens=20_000),
                ReplicaView("b"),
            ],
            ["a", "b"],
            "prefix",
        ),
        # of two sticky replicas, the less loaded one
        (
            [
                ReplicaView("a", hit_blocks=10, inflight=2),
                ReplicaView("b", hit_blocks=8),
                ReplicaView("c"),
            ],
            ["b", "c", "a"],
            "prefix",
        ),
        # saturated: 40,000 queued tokens + 4 * 1000 held is > 32,000 beyond b's 1,000
        (
            [
                ReplicaView("a", hit_blocks=10, inflight=4, inflight_prompt_tokens=40_000),
                ReplicaView("b"),
            ],
            ["b", "a"],
            "guard",
        ),
    ],
)
def test_sticky(views: list[ReplicaView], ranked: list[str], reason: str) -> None:
    assert _sticky().pick(REQ, views, {}) == (ranked, reason)


def test_sticky_releases_a_burst_of_cached_requests() -> None:
    # cached requests add no uncached tokens, but each one held counts prompt-size tokens
    stay = [ReplicaView("a", hit_blocks=10, inflight=8), ReplicaView("b")]
    assert _sticky().pick(REQ, stay, {})[1] == "prefix"
    leave = [ReplicaView("a", hit_blocks=10, inflight=40), ReplicaView("b")]
    assert _sticky().pick(REQ, leave, {})[1] == "guard"
    assert StickyPicker(held_tokens_per_request=0).pick(REQ, leave, {})[1] == "prefix"


@pytest.mark.parametrize(
    ("views", "winner", "reason"),
    [
        # imbalanced (gap > 64 and max > 1.5 * min): shortest queue, whatever the cache says
        (
            [ReplicaView("a", hit_blocks=10, inflight=100), ReplicaView("b", inflight=30)],
            "b",
            "guard",
        ),
        # balanced enough (gap 70 but 100 < 1.5 * 70): longest prefix
        (
            [ReplicaView("a", hit_blocks=10, inflight=100), ReplicaView("b", inflight=70)],
            "a",
            "prefix",
        ),
        # match 4/10 > 0.3: longest prefix, ties to the less loaded
        (
            [
                ReplicaView("a", hit_blocks=4, inflight=5),
                ReplicaView("b", hit_blocks=4, inflight=2),
                ReplicaView("c"),
            ],
            "b",
            "prefix",
        ),
        # match 3/10 is not > 0.3: least loaded
        ([ReplicaView("a", hit_blocks=3, inflight=5), ReplicaView("c", inflight=1)], "c", "load"),
    ],
)
def test_sglang_cache_aware(views: list[ReplicaView], winner: str, reason: str) -> None:
    ranked, got = SGLangCacheAwarePicker(rng=random.Random(0)).pick(REQ, views, {})
    assert (ranked[0], got) == (winner, reason)
    assert sorted(ranked) == sorted(v.name for v in views)


@pytest.mark.parametrize(
    ("cls", "option", "value"),
    [
        (StickyPicker, "affinity_threshold", 0),
        (StickyPicker, "peak_prefill_tokens_per_s", 0),
        (StickyPicker, "max_ttft_penalty_s", -1),
        (SGLangCacheAwarePicker, "cache_threshold", 2),
        (SGLangCacheAwarePicker, "balance_abs_threshold", -1),
    ],
)
def test_picker_option_errors(cls: type, option: str, value: float) -> None:
    with pytest.raises(ValueError, match=option):
        cls(**{option: value})
