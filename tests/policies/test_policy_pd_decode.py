"""The decode-side picker of a P/D pool (policies/pd_decode.py), as a table of hand-made views."""

from __future__ import annotations

import pytest

from policies import ReplicaView, RoutedRequest
from policies.pd_decode import rank_decode

REQ = RoutedRequest("r", "m", "m", "p", 1000, (1, 2, 3), 16.0, max_tokens=200)  # needs 1200 tokens
KV = 10_000  # tokens of KV of each replica whose capacity is known


def view(name: str, **kw: object) -> ReplicaView:
    return ReplicaView(name, max_inflight=10, **kw)  # type: ignore[arg-type]


CASES = [
    # (views, known KV capacity by name, transfer seconds, ranked, filtered names)
    ([view("a", running=4), view("b", running=1), view("c", running=2)],
     {}, None, ["b", "c", "a"], set()),
    ([view("a", inflight=3), view("b", running=1, waiting=4)],  # the larger of scrape and count
     {}, None, ["a", "b"], set()),
    ([view("full", kv_usage=0.95), view("room", kv_usage=0.5)],  # 500 free < 1200 needed
     {"full": KV, "room": KV}, None, ["room"], {"full"}),
    ([view("busy", kv_usage=0.1, running=5), view("free", kv_usage=0.1)],
     {"busy": KV, "free": KV}, None, ["free", "busy"], set()),
    ([view("unknown"), view("known", kv_usage=0.0)],  # unknown KV is not the emptiest
     {"known": KV}, None, ["known", "unknown"], set()),
    ([view("far"), view("near")], {}, {"far": 0.4, "near": 0.01}, ["near", "far"], set()),
    ([view("down", healthy=False, circuit="open"), view("drain", draining=True),
      view("capped", inflight=10), view("other", models=frozenset({"x"})), view("ok")],
     {}, None, ["ok"], {"down", "drain", "capped", "other"}),
    ([view("b"), view("a")], {}, None, ["a", "b"], set()),  # ties go by name
    ([], {}, None, [], set()),
]  # fmt: skip


@pytest.mark.parametrize(("views", "kv", "transfer", "ranked", "filtered"), CASES)
def test_rank_decode(
    views: list[ReplicaView], kv: dict[str, int], transfer: dict[str, float] | None,
    ranked: list[str], filtered: set[str],
) -> None:  # fmt: skip
    d = rank_decode(REQ, views, kv, transfer)
    assert d.ranked == ranked
    assert set(d.filtered) == filtered
    assert d.policy == "pd_decode"
    assert d.reason == ("decode_load" if ranked else "no_decode_replica")
    for name in ranked:
        assert 0.0 <= d.scores[name]["decode_load"] <= 1.0


def test_headroom_counts_max_tokens_or_a_default() -> None:
    views = [view("a", kv_usage=0.88)]  # 1200 free
    assert rank_decode(REQ, views, {"a": KV}).ranked == ["a"]
    short = RoutedRequest("r", "m", "m", "p", 1001, (), 16.0, max_tokens=200)
    assert "kv headroom" in rank_decode(short, views, {"a": KV}).filtered["a"]
    no_max = RoutedRequest("r", "m", "m", "p", 1000, (), 16.0)  # 256 assumed: 1256 > 1200
    assert rank_decode(no_max, views, {"a": KV}).ranked == []
