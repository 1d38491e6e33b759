"""The gateway's plain-number tallies expose exactly what prometheus-client's own Counter and
Histogram expose for the same observations (less the `_created` series); the label cap of the
`model` and `tenant` labels, through a gateway; no `_created` series on /metrics."""

from __future__ import annotations

import random
import re

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from gateway.telemetry.tallies import OTHER, CounterTally, HistogramTally, LabelCap, Tallies
from tests.gateway.conftest import rig
from tests.gateway.fake_replica import Upstream

BUCKETS = (0.0, 0.005, 0.01, 0.5, 1, 64, 131072)


def exposition(registry: CollectorRegistry) -> list[str]:
    return sorted(
        line for line in generate_latest(registry).decode().splitlines() if "_created" not in line
    )


def test_tallies_expose_what_the_library_metrics_expose() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    c = CounterTally("x_requests_total", "Requests.", ["pool", "status"])
    h = HistogramTally("x_latency_seconds", "Latency.", ["pool"], BUCKETS)
    empty = CounterTally("x_unused_total", "Never counted.", ["pool"])
    ours.register(Tallies([c, h, empty]))
    lc = Counter("x_requests_total", "Requests.", ["pool", "status"], registry=theirs)
    lh = Histogram("x_latency_seconds", "Latency.", ["pool"], buckets=BUCKETS, registry=theirs)
    Counter("x_unused_total", "Never counted.", ["pool"], registry=theirs)
    rng = random.Random(7)
    for _ in range(500):
        pool, status = rng.choice("ab"), rng.choice(["200", "503"])
        n = rng.choice([1, 1, 3, 0.5])
        c.labels(pool, status).inc(n)
        lc.labels(pool, status).inc(n)
        v = rng.choice([0.0, 0.005, 0.0051, 0.7, 64, 1e6, rng.random()])  # bounds themselves too
        h.labels(pool).observe(v)
        lh.labels(pool).observe(v)
    assert exposition(ours) == exposition(theirs)


def test_a_wrong_label_count_is_refused() -> None:
    with pytest.raises(ValueError, match="labels"):
        CounterTally("x_total", "X.", ["a", "b"]).labels("only-one")


def test_a_label_cap_folds_values_past_its_limit() -> None:
    cap = LabelCap(2)
    assert [cap(v) for v in ("a", "b", "c", "a", "d", "b")] == ["a", "b", OTHER, "a", OTHER, "b"]
    assert len(cap.kept) == 2  # a folded value is not kept: the memory stays bounded
    cap.limit = 3  # raised (a reload): the next new value gets its own series
    assert cap("d") == "d" and cap("e") == OTHER


def samples(text: str, family: str) -> dict[tuple[tuple[str, str], ...], float]:
    """{sorted label pairs: value} of one family in a text exposition."""
    out = {}
    for labels, value in re.findall(rf"^{family}\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE):
        pairs = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', labels)))
        out[pairs] = float(value)
    return out


async def test_model_and_tenant_labels_with_the_cap() -> None:
    """Three models under a cap of two: the third reads `other`; a model that matched no route
    reads `none`; tenants are the configured ones (and anonymous)."""
    cfg = {
        "server": {"metrics": {"max_label_values": 2}},
        "auth": "off",
        "tenants": [{"name": "team-a", "api_keys": ["key-a"]}],
        "routes": [{"match": {"model": "m*"}, "pool": "chat"}],
    }
    async with rig([Upstream("r1")], extra=cfg) as r, httpx.AsyncClient(base_url=r.url) as h:
        for model, key in (("m1", "key-a"), ("m2", None), ("m3", "key-a"), ("m1", "key-a")):
            headers = {"authorization": f"Bearer {key}"} if key else {}
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
            res = await h.post("/v1/chat/completions", json=body, headers=headers)
            assert res.status_code == 200
        body = {"model": "unrouted", "messages": [{"role": "user", "content": "hi"}]}
        assert (await h.post("/v1/chat/completions", json=body)).status_code == 404
        text = (await h.get("/metrics")).text
    requests = samples(text, "gateway_requests_total")
    by = {(dict(k)["model"], dict(k)["tenant"], dict(k)["status"]): v for k, v in requests.items()}
    assert by == {
        ("m1", "team-a", "200"): 2,
        ("m2", "anonymous", "200"): 1,
        ("other", "team-a", "200"): 1,  # m3: past the cap of 2 models
        ("none", "anonymous", "404"): 1,  # no pool: the client's word takes no label value
    }

    def keys(family: str) -> set[tuple[str, str]]:
        return {(dict(k)["model"], dict(k)["tenant"]) for k in samples(text, family)}

    served = {("m1", "team-a"), ("m2", "anonymous"), ("other", "team-a")}
    assert keys("gateway_prompt_tokens_total") == served
    assert keys("gateway_output_tokens_total") == served


async def test_no_created_series() -> None:
    async with rig([Upstream("r1")]) as r, httpx.AsyncClient(base_url=r.url) as h:
        body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}
        assert (await h.post("/v1/chat/completions", json=body)).status_code == 200
        text = (await h.get("/metrics")).text
    assert "gateway_requests_total{" in text
    assert "_created" not in text
