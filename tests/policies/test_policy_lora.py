"""Table tests of the LoRA plugins from hand-made ReplicaViews: `adapter_state`, the
`serves_adapter` filter, the `lora_affinity` ladder, and the `ttft` scorer's pricing in seconds."""

from __future__ import annotations

import pytest

from policies import build_policy
from policies.lora_filter import ServesAdapter
from policies.scorers.lora import LoraAffinityScorer, LoraCost, adapter_state
from policies.scorers.ttft import TTFTScorer
from policies.types import LoraView, Outcome, ReplicaView, RoutedRequest

BASE = "llama"


def req(model: str = "sql", prompt_tokens: int = 1000, adapter: bool = False) -> RoutedRequest:
    return RoutedRequest("r", model, model, "p", prompt_tokens, (), 16.0, adapter=adapter)


def lv(served: str = "sql,poet,chat,math,law", resident: str = "", inflight: str = "",
       max_loras: int = 2, **kw: object) -> LoraView:  # fmt: skip
    counts = {a: 1 for a in inflight.split(",") if a}
    return LoraView(frozenset(served.split(",")) if served else frozenset(), frozenset({BASE}),
                    max_loras, tuple(a for a in resident.split(",") if a), counts, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("view", "state"),
    [
        (lv(resident="sql", inflight="sql"), "active"),
        (lv(resident="poet,sql"), "resident"),
        (lv(resident="poet"), "free"),
        (lv(resident="poet,chat"), "evict"),
        (lv(resident="poet,chat", inflight="chat"), "evict"),  # poet is idle: it goes
        (lv(resident="poet,chat", inflight="poet,chat"), "busy"),
        (lv(served="poet"), None),  # not one of its adapters
        (lv(served="", loadable=frozenset({"sql"})), "free"),  # managed: it may be loaded
    ],
)
def test_adapter_state(view: LoraView, state: str | None) -> None:
    assert adapter_state("sql", view) == state


@pytest.mark.parametrize(
    ("model", "view", "kept", "adapter"),
    [
        ("sql", None, True, False),  # a replica without LoRA, in a pool without: as before
        # ... in a pool where another replica serves it: vLLM with no adapter loaded answers 404
        ("sql", None, False, True),
        (BASE, lv(), True, True),
        ("sql", lv(), True, True),
        (BASE, lv(), True, False),  # the base model
        ("sql", lv(served="poet"), False, True),
        ("sql", lv(served="", loadable=frozenset({"sql"})), True, True),
        ("sql", lv(served="", managed=frozenset({"sql"})), False, True),  # managed, not offered
    ],
)
def test_serves_adapter(model: str, view: LoraView | None, kept: bool, adapter: bool) -> None:
    why = ServesAdapter().keep(req(model, adapter=adapter), ReplicaView("a", lora=view))
    assert (why is None) is kept
    if not kept:
        assert why == f"does not serve adapter {model!r}"


def test_the_ladder_prefers_active_then_resident_then_a_free_slot() -> None:
    views = [
        ReplicaView("busy", lora=lv(resident="poet,chat", inflight="poet,chat")),
        ReplicaView("evict", lora=lv(resident="poet,chat")),
        ReplicaView("free", lora=lv(resident="poet")),
        ReplicaView("resident", lora=lv(resident="sql")),
        ReplicaView("active", lora=lv(resident="sql", inflight="sql")),
        ReplicaView("plain"),
    ]
    scores = LoraAffinityScorer().score(req(), views)
    assert scores == {"busy": 0.0, "evict": 0.3, "free": 0.6, "resident": 0.9, "active": 1.0,
                      "plain": 1.0}  # fmt: skip


def test_eviction_is_priced_by_the_victims_demand() -> None:
    cost = LoraCost(0.4, evict_penalty=1.0, demand_scale=4.0)
    cold = lv(resident="poet,chat", demand={"poet": 0.0, "chat": 0.5})
    hot = lv(resident="poet,chat", demand={"poet": 0.5, "chat": 0.0})  # its LRU victim is hot
    assert cost.extra_s("sql", lv(resident="sql")) == 0.0
    assert cost.extra_s("sql", lv(resident="poet")) == pytest.approx(0.4)
    assert cost.extra_s("sql", cold) == pytest.approx(0.4)
    assert cost.extra_s("sql", hot) == pytest.approx(0.8)
    assert cost.extra_s("sql", lv(resident="poet,chat", inflight="poet,chat")) == pytest.approx(2.4)
    assert cost.extra_s(BASE, lv()) == 0.0 and cost.extra_s("sql", None) == 0.0


def test_ttft_prices_the_load_in_seconds_against_queueing() -> None:
    scorer = TTFTScorer(prefill_tokens_per_s=10_000, base_s=0.05, lora_load_s=0.3)
    loaded = ReplicaView("loaded", lora=lv(resident="sql"), inflight_prompt_tokens=2000)
    free = ReplicaView("free", lora=lv(resident="poet"))
    # 2,000 queued tokens cost 0.2 s there, a load 0.3 s here: the adapter's replica wins
    assert scorer.predict(req(), loaded) == pytest.approx(0.05 + 0.1 + 0.2)
    assert scorer.predict(req(), free) == pytest.approx(0.05 + 0.1 + 0.3)
    s = scorer.score(req(), [loaded, free])
    assert s["loaded"] == 1.0 and s["free"] < 1.0
    busier = ReplicaView("loaded", lora=lv(resident="sql"), inflight_prompt_tokens=6000)
    s = scorer.score(req(), [busier, free])
    assert s["free"] == 1.0 > s["loaded"]  # past the load time, spilling over is faster
    plain = [ReplicaView("a"), ReplicaView("b", inflight_prompt_tokens=10)]
    assert TTFTScorer().score(req(), plain) == TTFTScorer(lora_load_s=9).score(req(), plain)


def test_the_load_time_is_learned_from_observed_ttfts() -> None:
    scorer = TTFTScorer(prefill_tokens_per_s=10_000, base_s=0.05, lora_load_s=0.3)
    for _ in range(200):  # every load took 1.0 s on top of what the fit predicts
        scorer.observe(Outcome("r", 1000, 0, 0, 0, 0.15 + 1.0, adapter_load=True))
        scorer.observe(Outcome("r", 1000, 0, 0, 0, 0.15, adapter_load=False))
    assert scorer.lora.load_s == pytest.approx(1.0, abs=0.1)
    a, b, _ = scorer.coefficients("r")
    # the fit without the loads (0.65 s, the mean, if they were left in), converging on 0.15
    assert 0.15 <= a + b * 1000 < 0.25


def test_the_default_policy_filters_adapters_and_plain_pools_route_as_before() -> None:
    policy = build_policy("ttft", seed=0)
    views = [ReplicaView("a", lora=lv(served="poet")), ReplicaView("b", lora=lv())]
    decision = policy.choose(req(), views)
    assert decision.ranked == ["b"] and "a" in decision.filtered
    plain = [ReplicaView("a"), ReplicaView("b")]
    assert sorted(policy.choose(req(), plain).ranked) == ["a", "b"]
