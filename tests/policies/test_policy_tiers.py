"""The TTFT scorer's tier pricing: lower-tier hits in seconds, fixed weights, or ignored; and the
tier rates it learns from TTFTs."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from policies.scorers.ttft import TTFTScorer
from policies.types import Outcome, ReplicaView, RoutedRequest

TPB = 16
PROMPT = 128_000  # a long context: 8000 blocks


def req(tokens: int = PROMPT) -> RoutedRequest:
    return RoutedRequest("r", "m", "s", "p", tokens, list(range(tokens // TPB)), float(TPB))


def scorer(**kw: object) -> TTFTScorer:
    # prior only: a = 0.05 s, b = c = 1/8000 s per token; the TTFT alone (the score's price of
    # the fleet's recompute is tested in test_policy_scorer_ttft)
    kw.setdefault("recompute", 0)
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


# --- tier rates learned from TTFTs (policies/scorers/tier_rates.py) ----------------------------

TRUE_CPU_S = 131072 / 50e9  # the host tier really loads at 50 GB/s


def truth(recomputed: int, cpu: int) -> float:
    return 0.05 + recomputed / 8000 + cpu * TRUE_CPU_S


def outcomes(n: int, seed: int = 1, short: bool = False) -> list[Outcome]:
    """Outcomes of a fleet whose host tier loads at 50 GB/s: GPU-only ones and ones with part of
    the prompt on the host tier. `short`: the replica lost the host copy and recomputed it."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        cpu = rng.randrange(16_000, 120_000, TPB) if i % 2 else 0
        gpu = rng.randrange(0, PROMPT - cpu + 1, TPB)
        recomputed = PROMPT - gpu - (0 if short else cpu)
        out.append(Outcome(
            "ab"[i % 3 == 0], PROMPT, gpu, 0, 0, truth(recomputed, 0 if short else cpu),
            tier_tokens={"cpu": cpu} if cpu else None,
            cached_tokens=gpu if short else gpu + cpu, tokens_per_block=TPB,
        ))  # fmt: skip
    return out


def host_or_recompute(s: TTFTScorer) -> str:
    """The pick between the whole prompt on an idle replica's host tier (0.39 s at 50 GB/s, 3.4 s
    at 5) and 16K tokens to recompute after a GPU hit (2.05 s)."""
    views = [ReplicaView("a", tier_hits={"cpu": 8000}), ReplicaView("b", hit_blocks=7000)]
    scores = s.score(req(), views)
    return max(scores, key=scores.__getitem__)


def test_learning_recovers_the_true_tier_rate_from_a_prior_ten_times_off() -> None:
    assert not scorer().learn_tiers  # opt-in: the engine's measurement is the default source
    s = scorer(tier_gbps={"cpu": 5}, learn_tiers=True)
    assert host_or_recompute(s) == "b"  # the wrong prior prices the host tier out
    for o in outcomes(300):
        s.observe(o)
    assert s.tier_gbps()["cpu"] == pytest.approx(50, rel=0.1)
    assert s.load_s_per_token["cpu"] == pytest.approx(TRUE_CPU_S, rel=0.1)
    assert host_or_recompute(s) == "a"  # as the truth ranks them
    assert s.tier_gbps()["disk"] == pytest.approx(7)  # never observed: the prior
    a, b, _c = s.coefficients("a")  # the prefill fit still measures the prefill alone
    assert a == pytest.approx(0.05, abs=0.02) and b == pytest.approx(1 / 8000, rel=0.05)


def test_outcomes_that_fell_short_or_did_not_say_teach_no_rate() -> None:
    s = scorer(tier_gbps={"cpu": 5}, learn_tiers=True)
    for o in outcomes(200, short=True):
        s.observe(o)
    for o in outcomes(200):
        s.observe(replace(o, cached_tokens=None))
    assert s.tier_gbps()["cpu"] == pytest.approx(5)
    off = scorer(tier_gbps={"cpu": 5}, learn_tiers=False)
    for o in outcomes(100):
        off.observe(o)
    assert off.tier_gbps()["cpu"] == pytest.approx(5)


def test_a_full_hit_is_served_though_the_engine_recomputes_the_last_block() -> None:
    full = Outcome("a", 1024, 512, 0, 0, 0.1, tier_tokens={"cpu": 512}, cached_tokens=1008,
                   tokens_per_block=TPB)  # fmt: skip
    assert full.served_in_full() and full.credited_cached_tokens() == 1024
    assert not replace(full, cached_tokens=992).served_in_full()
    assert not replace(full, cached_tokens=None).served_in_full()


def test_shared_tier_sums_make_two_gateways_agree() -> None:
    one = scorer(tier_gbps={"cpu": 5}, learn_tiers=True)
    two = scorer(tier_gbps={"cpu": 5}, learn_tiers=True)
    seen = outcomes(300)
    for o in seen[:150]:
        one.observe(o)
    for o in seen[150:]:
        two.observe(o)
    shared_one, shared_two = one.share(), two.share()
    assert all(len(v) == 20 for v in shared_one.values())  # prefill fit + tier sums
    # a gateway from before tier learning sends 10 numbers; junk widths are skipped
    one.absorb([shared_two, {"c": [1.0] * 7}])
    two.absorb([shared_one])
    assert one.tier_gbps() == pytest.approx(two.tier_gbps())
    assert one.tier_gbps()["cpu"] == pytest.approx(50, rel=0.1)
    assert one.coefficients("a") == pytest.approx(two.coefficients("a"))
    old = scorer(tier_gbps={"cpu": 5}, learn_tiers=True)
    old.absorb([{n: v[:10] for n, v in shared_one.items()}])  # fits only: no tier rate moves
    assert old.tier_gbps()["cpu"] == pytest.approx(5)
    assert old.coefficients("a") != old.prior


# --- tier rates the engine measured (ReplicaView.tier_load_rates, gateway/fleet/tier_load.py) -------


def test_a_measured_rate_overrides_a_wrong_configured_one() -> None:
    s = scorer(tier_gbps={"cpu": 5})  # 10x too slow: 3.4 s to load the prompt from the host
    assert host_or_recompute(s) == "b"
    # the engine measured 50 GB/s (seconds per byte): the same prompt loads in 0.34 s
    rates = {"cpu": (1 / 50e9, 0.0)}
    views = [ReplicaView("a", tier_hits={"cpu": 8000}, tier_load_rates=rates),
             ReplicaView("b", hit_blocks=7000)]  # fmt: skip
    assert s.predict(req(), views[0]) == pytest.approx(0.05 + PROMPT * 131072 / 50e9)
    assert s.predict(req(), views[1]) == pytest.approx(0.05 + 16_000 / 8000)
    scores = s.score(req(), views)
    assert scores["a"] == 1.0 and scores["b"] == pytest.approx(
        (0.05 + PROMPT * 131072 / 50e9) / (0.05 + 16_000 / 8000)
    )
    # LMCache measures seconds per token; a tier the replica did not measure keeps tier_gbps
    per_token = {"shared": (0.0, 1e-6)}
    view = ReplicaView("c", tier_hits={"shared": 4000, "cpu": 4000}, tier_load_rates=per_token)
    assert s.predict(req(), view) == pytest.approx(0.05 + 64_000 * 1e-6 + 64_000 * 131072 / 5e9)


def test_the_fit_takes_out_the_load_at_the_measured_rate() -> None:
    s = scorer(tier_gbps={"cpu": 5})
    rates = {"cpu": (1 / 50e9, 0.0)}
    s.score(req(), [ReplicaView("a", tier_hits={"cpu": 4000}, tier_load_rates=rates)])
    load = 64_000 * 131072 / 50e9  # what the engine measured, not the 10x slower config
    for _ in range(50):
        s.observe(Outcome("a", PROMPT, 0, 0, 0, 0.05 + 8.0 + load, tier_tokens={"cpu": 64_000}))
    a, b, _c = s.coefficients("a")
    assert a == pytest.approx(0.05, abs=0.02) and b == pytest.approx(1 / 8000, rel=0.02)


def test_kv_waits_counts_the_requests_that_must_end_first() -> None:
    full = ReplicaView("a", inflight=2, inflight_kv_tokens=11_000, kv_tokens=8192)
    assert full.kv_waits(5000) == 2  # 7808 tokens over: both (5500 each) must end
    assert full.kv_waits(0) == 1  # 2808 over already: one of them must end
    assert replace(full, inflight_kv_tokens=4000).kv_waits(4000) == 0  # fits beside them
    assert replace(full, kv_tokens=None).kv_waits(5000) == 0  # KV size unknown: no wait priced
    assert replace(full, inflight=4, inflight_kv_tokens=8000).kv_waits(2000) == 1


def test_the_wait_for_kv_is_learned_and_sends_a_hit_elsewhere() -> None:
    """Requests that had to wait for KV teach hold_s (the fit learns without it); a replica
    whose KV is full of requests in flight then loses a prompt it holds to an idle one."""
    s = scorer()
    for i in range(200):  # the prior fit exact, plus 0.8 s per request that had to end first
        n, u = i % 4, 1000 + 500 * (i % 5)
        s.observe(Outcome("r0", u, 0, n, 0, 0.05 + u / 8000 + n * 0.8, kv_waits=n))
    assert s.hold.s == pytest.approx(0.8, rel=0.2)  # learned beside the fit, as it converges
    assert s.coefficients("r0")[0] < 0.3  # not the 1.2 s mean wait: the fit learns without it
    r = req(6000)
    held = ReplicaView("r0", hit_blocks=375, inflight=2, inflight_kv_tokens=12_000, kv_tokens=8192)
    idle = ReplicaView("r1", inflight=0, kv_tokens=8192)
    scores = s.score(r, [held, idle])
    assert scores["r1"] == 1.0 > scores["r0"]
    assert scorer().score(r, [held, idle])["r0"] == 1.0  # nothing learned: the hit wins


def test_a_request_that_rode_a_prefix_still_prefilling_teaches_nothing() -> None:
    s = scorer()
    before = s.coefficients("r0")
    s.observe(Outcome("r0", 6000, 5900, 1, 6000, 0.1, rides=True))
    assert s.coefficients("r0") == before
