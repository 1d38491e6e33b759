"""Who scrapes which replica in a fleet (gateway/fleet/shared_scrape.py): every gateway agrees, a
gateway joining takes replicas from the others and never leaves one unscraped, a shared load
that is down makes each gateway scrape everything, and a peer's samples are taken once each."""

from __future__ import annotations

import time

from gateway.fleet.replicas import Circuit, ReplicaState
from gateway.fleet.scrape import LoadSample
from gateway.fleet.shared_scrape import ScrapeShare, replicas_by_url

URLS = [f"http://10.0.0.{i}:8000" for i in range(64)]


def owners(ids: list[str]) -> dict[str, str]:
    shares = {g: ScrapeShare(g) for g in ids}
    for g, s in shares.items():
        s.set_live((p.encode() for p in ids if p != g), shared=True)
    out = {}
    for url in URLS:
        mine = [g for g, s in shares.items() if s.owns(url)]
        assert len(mine) == 1, (url, mine)
        out[url] = mine[0]
    return out


def test_the_gateways_agree_and_a_joining_one_only_takes_replicas() -> None:
    two, three = owners(["gw-a", "gw-b"]), owners(["gw-a", "gw-b", "gw-c"])
    assert set(two.values()) == {"gw-a", "gw-b"}
    for url in URLS:  # rendezvous: a replica moves only to the newcomer
        assert three[url] in (two[url], "gw-c")
    assert 10 < sum(o == "gw-c" for o in three.values()) < 40


def test_alone_or_with_the_shared_load_down_a_gateway_scrapes_everything() -> None:
    s = ScrapeShare("gw-a")
    assert all(s.owns(u) for u in URLS)  # no tick yet
    s.set_live([b"gw-b"], shared=True)
    assert not all(s.owns(u) for u in URLS)
    s.set_live([b"gw-b"], shared=False)
    assert all(s.owns(u) for u in URLS)


def replica(url: str) -> ReplicaState:
    return ReplicaState(name="r", url=url, pool="p", max_inflight=8, circuit=Circuit(3, 5.0))


def test_a_peers_sample_is_taken_once_with_its_lora_info_and_kv_geometry() -> None:
    mine, theirs = ScrapeShare("gw-a"), ScrapeShare("gw-b")
    mine.set_live([b"gw-b"], shared=True)
    theirs.set_live([b"gw-a"], shared=True)
    url = next(u for u in URLS if theirs.owns(u))
    src, dst = replica(url), replica(url)
    kv = []
    dst.on_engine_kv = lambda r: kv.append(r.engine_kv)
    sample = LoadSample(waiting=2, running=5, kv_usage=0.5, block_size=16, kv_blocks=1000)
    src.own_scrape = (7, time.monotonic(), sample, (frozenset({"sql"}), 4))
    src.scraped_at = time.monotonic()
    shared = theirs.payload([src])
    assert list(shared) == [url]
    seen: dict[str, int] = {}
    mine.take(seen, shared, replicas_by_url([dst]))
    assert dst.scraped == sample and seen == {url: 7}
    assert dst.lora.metric_active == frozenset({"sql"}) and kv == [(16, 16000)]
    dst.scraped = None
    mine.take(seen, shared, replicas_by_url([dst]))  # the same seq again: nothing new
    assert dst.scraped is None and mine.applied == 1
    mine.take(seen, {url: ["bad"]}, replicas_by_url([dst]))  # not this version's: ignored
    assert mine.applied == 1
    assert mine.payload([dst]) == {}  # never scraped here: nothing to share
