"""The TTFT scorer's tier pricing: lower-tier hits in seconds, fixed weights, or ignored."""

from __future__ import annotations

import pytest

from policies.scorers.ttft import TTFTScorer
from policies.types import Outcome, ReplicaView, RoutedRequest

TPB = 16
PROMPT = 128_000  # a long context: 8000 blocks


def req(tokens: int = PROMPT) -> RoutedRequest:
    return RoutedRequest("r", "m", "s", "p", tokens, list(range(tokens // TPB)), float(TPB))


def scorer(**kw: object) -> TTFTScorer:
    # prior only: a = 0.05 s, b = c = 1/8000 s per token
    return TTFTScorer(prefill_tokens_per_s=8000, base_s=0.05, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("tiers", "gpu", "tier_hits", "expected_s"),
    [
        # nothing cached: 128K tokens at 8000/s
        ("seconds", 0, None, 0.05 + 16.0),
        # all on the GPU: only the base
        ("seconds", 8000, None, 0.05),
        # all on the host tier: 128K x 128 KiB / 50 GB/s = 0.3355 s of loading
        ("seconds", 0, {"cpu": 8000}, 0.05 + PROMPT * 131072 / 50e9),
        # half GPU, half disk at 7 GB/s
        ("seconds", 4000, {"disk": 4000}, 0.05 + 64_000 * 131072 / 7e9),
        # shared store for a quarter, the rest recomputed
        ("seconds", 0, {"shared": 2000}, 0.05 + 32_000 * 131072 / 12.5e9 + 96_000 / 8000),
        # fixed weights: a CPU block is 0.75 of a GPU block, no load time
        ("weights", 0, {"cpu": 8000}, 0.05 + 0.25 * PROMPT / 8000),
        ("weights", 0, {"disk": 8000}, 0.05 + 0.75 * PROMPT / 8000),
        # off: GPU-only, the CPU blocks are recomputed
        ("off", 0, {"cpu": 8000}, 0.05 + 16.0),
    ],
)
def test_predicted_ttft_table(
    tiers: str, gpu: int, tier_hits: dict[str, int] | None, expected_s: float
) -> None:
    s = scorer(tiers=tiers)
    view = ReplicaView("a", hit_blocks=gpu, tier_hits=tier_hits)
    assert s.predict(req(), view) == pytest.approx(expected_s, rel=1e-9)


def test_score_and_predict_agree() -> None:
    s = scorer()
    views = [
        ReplicaView("gpu", hit_blocks=8000, inflight_prompt_tokens=64_000),  # busy, all on GPU
        ReplicaView("cpu", hit_blocks=0, tier_hits={"cpu": 8000}, inflight_prompt_tokens=8000),
        ReplicaView("idle"),  # recompute all 128K
    ]
    scores = s.score(req(), views)
    preds = {v.name: s.predict(req(), v) for v in views}
    best = min(preds.values())
    assert scores == pytest.approx({n: best / p for n, p in preds.items()})
    # a busy replica with the prefix on its host tier beats recomputing on an idle one
    assert preds["cpu"] < preds["idle"] and scores["cpu"] == 1.0


def test_bandwidth_and_bytes_per_token_are_configurable() -> None:
    s = scorer(kv_bytes_per_token=327680, tier_gbps={"cpu": 25})
    view = ReplicaView("a", tier_hits={"cpu": 8000})
    assert s.predict(req(), view) == pytest.approx(0.05 + PROMPT * 327680 / 25e9)


def test_bad_tier_options_are_refused() -> None:
    with pytest.raises(ValueError, match="tiers"):
        scorer(tiers="fast")
    with pytest.raises(ValueError, match="tier_gbps"):
        scorer(tier_gbps={"cpu": 0})


def test_the_fit_learns_without_the_load_time() -> None:
    s = scorer()
    # every TTFT is exactly the prior's recompute time plus the host load: the fit must not move
    load = 64_000 * 131072 / 50e9
    for _ in range(50):
        s.observe(Outcome("a", PROMPT, 0, 0, 0, 0.05 + 8.0 + load, tier_tokens={"cpu": 64_000}))
    a, b, _c = s.coefficients("a")
    assert a == pytest.approx(0.05, abs=0.02) and b == pytest.approx(1 / 8000, rel=0.02)


def test_prefix_scorer_weighs_tiers_only_when_told() -> None:
    from policies.scorers.prefix import PrefixScorer

    r = RoutedRequest("r", "m", "s", "p", 160, list(range(10)), float(TPB))
    views = [ReplicaView("a", hit_blocks=2, tier_hits={"cpu": 5, "shared": 3}), ReplicaView("b")]
    assert PrefixScorer().score(r, views) == {"a": 0.2, "b": 0.0}
    weighted = PrefixScorer(tiers={"cpu": 0.8}).score(r, views)
    assert weighted == {"a": pytest.approx(0.6), "b": 0.0}  # (2 + 0.8 x 5) / 10; shared: 0
    with pytest.raises(ValueError, match="tier weights"):
        PrefixScorer(tiers={"cpu": 2.0})
