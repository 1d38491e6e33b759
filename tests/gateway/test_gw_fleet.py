"""Shared load: two real gateway apps on loopback, one real Redis (a fleet name per test), real
fake replicas. Each sees the other's in-flight requests, stops counting a gateway that vanished,
enforces max_inflight_per_replica fleet-wide, routes on its own load when Redis is down, and
sends a new prefix to the same replica as its peer."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from bench.harness import stop_all
from gateway import create_app, parse_config
from gateway.fleet.shared_load import QUIET_TICKS
from tests.gateway.fake_replica import Upstream
from tests.support import Served, free_port, poll_until, start_server

REDIS = "redis://127.0.0.1:6379/0"
STALE_S = 0.6


class Peak:
    """An upstream that counts how many requests it holds at once (the fleet cap's witness)."""

    def __init__(self, up: Upstream) -> None:
        self.up, self.now, self.peak = up, 0, 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        counted = scope["type"] == "http" and scope["path"].startswith("/v1/")
        if counted:
            self.now += 1
            self.peak = max(self.peak, self.now)
        try:
            await self.up(scope, receive, send)
        finally:
            if counted:
                self.now -= 1


def config(urls: list[str], fleet_name: str, **over: Any) -> dict[str, Any]:
    pool = {
        "replicas": [{"url": u, "name": f"r{i}"} for i, u in enumerate(urls)],
        "policy": "ttft",
        "health": {"interval_s": 0.2},
        "scrape": {"enabled": False},
        **over.pop("pool", {}),
    }
    return {
        "server": {"expose_upstream_errors": True},
        "pools": {"chat": pool},
        "fleet": {
            "shared_load": True,
            "redis_url": REDIS,
            "name": fleet_name,
            "publish_interval_ms": 20,
            "stale_after_s": STALE_S,
            **over.pop("fleet", {}),
        },
        **over,
    }


@contextlib.asynccontextmanager
async def fleet_of(
    n: int, ups: list[Upstream], **over: Any
) -> AsyncIterator[tuple[list[Any], list[Served], list[Peak]]]:
    peaks = [Peak(u) for u in ups]
    served = [await start_server(p) for p in peaks]
    name = f"t-{uuid.uuid4().hex[:10]}"
    apps = [create_app(parse_config(config([s.url for s in served], name, **over)))
            for _ in range(n)]  # fmt: skip
    gws = [await start_server(app, lifespan="on") for app in apps]
    try:
        yield apps, gws, peaks
    finally:
        for g in gws:
            with contextlib.suppress(Exception):
                await g.stop()
        await stop_all(served)


def body(content: str) -> dict[str, Any]:
    msgs = [{"role": "user", "content": content}]
    return {"model": "m", "messages": msgs, "max_tokens": 4, "stream": True}


async def post(h: aiohttp.ClientSession, gw: Served, content: str) -> tuple[int, dict[str, Any]]:
    headers = {"x-gateway-explain": "1"}
    async with h.post(gw.url + "/v1/chat/completions", json=body(content), headers=headers) as r:
        await r.read()
        return r.status, orjson.loads(r.headers.get("x-gateway-decision", "{}"))


def same_picture(apps: list[Any]) -> bool:
    """Two gateways see the same placed blocks and have learned the same ttft fit."""
    placed = [[r.view(0, 0).placed_blocks for r in a.gateway.all_replicas()] for a in apps]
    scorers = [a.gateway.pools["chat"].policy.scorers[0][0] for a in apps]
    names = [r.name for r in apps[0].gateway.all_replicas()]
    fits = [[s.coefficients(n) for n in names] for s in scorers]
    return placed[0] == placed[1] and fits[0] == fits[1]


def peer_inflight(app: Any) -> int:
    return sum(r.peer_inflight for r in app.gateway.all_replicas())


async def test_a_gateway_sees_its_peers_requests_and_their_end() -> None:
    async with fleet_of(2, [Upstream("u0", delay_s=1.0)]) as (apps, gws, _), aiohttp.ClientSession() as h:
        await poll_until(lambda: apps[1].gateway.fleet.peers == 1, 5)
        sent = [asyncio.create_task(post(h, gws[0], f"q{i}")) for i in range(3)]
        await poll_until(lambda: peer_inflight(apps[1]) == 3, 5)  # within a tick or two
        r0 = apps[1].gateway.pools["chat"].by_name["r0"]
        view = r0.view(0, 0.0)
        assert (r0.inflight, view.inflight) == (0, 3)  # own 0, the view counts the peer's 3
        assert view.inflight_prompt_tokens > 0
        async with h.get(gws[1].url + "/ready") as r:
            ready = await r.json()
        assert ready["fleet"] == {"peers": 1, "shared_load": "ok"}
        assert ready["index"] == "memory"
        assert [s for s, _ in await asyncio.gather(*sent)] == [200] * 3
        await poll_until(lambda: peer_inflight(apps[1]) == 0, 5)
        # shared learning: B fits r0 from A's observed TTFTs, to the same coefficients
        scorer_a, scorer_b = (a.gateway.pools["chat"].policy.scorers[0][0] for a in apps)
        await poll_until(lambda: scorer_b.coefficients("r0") == scorer_a.coefficients("r0"), 5)
        assert scorer_a.coefficients("r0") != scorer_a.prior
        async with h.get(gws[1].url + "/metrics") as r:
            text = await r.text()
        assert "gateway_fleet_peers 1.0" in text and "gateway_fleet_shared_load_up 1.0" in text


async def test_a_vanished_gateway_stops_counting_within_stale_after() -> None:
    async with fleet_of(2, [Upstream("u0", delay_s=3.0)]) as (apps, gws, _), aiohttp.ClientSession() as h:
        sent = [asyncio.create_task(post(h, gws[0], f"q{i}")) for i in range(2)]
        await poll_until(lambda: peer_inflight(apps[1]) == 2, 5)
        apps[0].gateway.fleet._task.cancel()  # A stops ticking without a word (a crash)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await poll_until(lambda: peer_inflight(apps[1]) == 0, 5)
        assert loop.time() - t0 >= STALE_S * 0.25  # it was counted until it went stale
        assert apps[1].gateway.fleet.peers == 0
        await asyncio.gather(*sent)


async def test_a_gateway_that_stops_leaves_at_once() -> None:
    async with fleet_of(2, [Upstream("u0")]) as (apps, gws, _):
        await poll_until(lambda: apps[1].gateway.fleet.peers == 1, 5)
        await gws[0].stop()  # graceful: deletes its field
        await poll_until(lambda: apps[1].gateway.fleet.peers == 0, STALE_S)


async def test_max_inflight_per_replica_is_fleet_wide() -> None:
    up = Upstream("u0", delay_s=0.8)
    pool = {"max_inflight_per_replica": 2}
    async with fleet_of(2, [up], pool=pool) as (apps, gws, peaks), aiohttp.ClientSession() as h:
        first = [asyncio.create_task(post(h, gws[0], f"a{i}")) for i in range(2)]
        await poll_until(lambda: peer_inflight(apps[1]) == 2, 5)
        late = asyncio.create_task(post(h, gws[1], "b"))  # B must wait: the replica is full
        await asyncio.sleep(0.3)
        assert up.calls == 2 and not late.done()
        got = await asyncio.gather(*first, late)
    assert [s for s, _ in got] == [200] * 3
    assert peaks[0].peak == 2  # never 3 on the replica, though each gateway alone had room


async def test_redis_down_routes_on_own_load_and_stays_ready() -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    async with fleet_of(1, [Upstream("u0")], fleet={"redis_url": dead}) as (apps, gws, _):
        await poll_until(lambda: apps[0].gateway.fleet.status == "down", 5)
        async with aiohttp.ClientSession() as h:
            assert (await post(h, gws[0], "q"))[0] == 200
            async with h.get(gws[0].url + "/ready") as r:
                assert r.status == 200  # fail-open: not a 503
                assert (await r.json())["fleet"] == {"peers": 0, "shared_load": "down"}
            async with h.get(gws[0].url + "/metrics") as r:
                assert "gateway_fleet_shared_load_up 0.0" in await r.text()
        assert peer_inflight(apps[0]) == 0


async def test_a_new_prefix_goes_to_the_same_replica_through_either_gateway() -> None:
    """Two gateways deciding on the same picture agree on a new prefix's replica (the
    rendezvous tie-break). With pushes, the second may already see the first's request in
    flight on that replica but not yet its blocks, and go elsewhere (docs/scaleout.md, what is
    open): ticks only here, so both decide on the same picture."""
    ups = [Upstream(f"u{i}") for i in range(4)]
    ticks_only = {"fleet": {"push_interval_ms": 0}}
    async with fleet_of(2, ups, **ticks_only) as (apps, gws, _), aiohttp.ClientSession() as h:
        for k in range(8):
            doc = f"Document {k}: " + "lorem ipsum dolor sit amet " * 20
            (sa, da), (sb, db) = await asyncio.gather(post(h, gws[0], doc), post(h, gws[1], doc))
            assert (sa, sb) == (200, 200)
            assert da["ranked"][0] == db["ranked"][0], (k, da, db)
            # both pictures agree again before the next one: the peers' placed blocks folded
            # in, and the fit each learned from its own answer absorbed by the other
            await poll_until(lambda: same_picture(apps), 5)
        used = sum(1 for u in ups if u.calls)
        # new prefixes still spread over the fleet's caches: the tie-break is by prefix, but the
        # learned latency fit (what a busy machine's timings shape) may favour a replica
        assert used >= 2


async def test_a_new_prefix_two_gateways_place_at_once_counts_its_prefill_once() -> None:
    """Both gateways send the same new document to the one replica before either knows the
    other's blocks: each counts its request as a full prefill, the replica computes it once,
    and every gateway's picture counts it once (the key of a new prefix travels with the load
    figures), so the next request of the burst does not find the replica twice as busy."""
    up = Upstream("u0", delay_s=1.0)  # no first token while the pictures are compared
    async with fleet_of(2, [up]) as (apps, gws, _), aiohttp.ClientSession() as h:
        await poll_until(lambda: all(a.gateway.fleet.peers == 1 for a in apps), 10)
        doc = "A document no gateway has seen. " * 60
        sent = [asyncio.create_task(post(h, gw, doc)) for gw in gws]
        await poll_until(lambda: all(peer_inflight(a) == 1 for a in apps), 5)
        states = [a.gateway.all_replicas()[0] for a in apps]
        assert all(r.cold and r.peer_cold for r in states)  # each placed it, each saw the other
        own = [r.inflight_prompt_tokens for r in states]
        assert own[0] == own[1] > 0
        assert [r.view(0, 0).inflight_prompt_tokens for r in states] == own  # once, not twice
        assert [s for s, _ in await asyncio.gather(*sent)] == [200, 200]
        await poll_until(lambda: not any(r.cold or r.peer_cold for r in states), 5)


@pytest.mark.parametrize(
    ("shared", "backend", "want"),
    [(None, "memory", "off"), (None, "redis", "ok"), (False, "redis", "off")],
)
async def test_shared_load_follows_the_index_unless_set(
    shared: bool | None, backend: str, want: str
) -> None:
    over = {"fleet": {"shared_load": shared}, "index": {"backend": backend, "redis_url": REDIS}}
    async with fleet_of(1, [Upstream("u0")], **over) as (apps, gws, _):
        async with aiohttp.ClientSession() as h, h.get(gws[0].url + "/ready") as r:
            got = await r.json()
        assert got["fleet"]["shared_load"] in ({want} if want == "off" else {"ok"})
        assert got["index"] == ("memory" if backend == "memory" else "ok")
        assert (apps[0].gateway.fleet is None) == (want == "off")


async def test_an_idle_fleet_ticks_less_often_and_still_sees_new_load() -> None:
    ticks_only = {"fleet": {"push_interval_ms": 0}}  # the tick's own path (pushes: below)
    async with fleet_of(2, [Upstream("u0", delay_s=1.0)], **ticks_only) as (apps, gws, _), \
            aiohttp.ClientSession() as h:  # fmt: skip
        await poll_until(lambda: all(a.gateway.fleet.quiet >= QUIET_TICKS for a in apps), 10)
        sent = asyncio.create_task(post(h, gws[0], "q"))
        await poll_until(lambda: peer_inflight(apps[1]) == 1, 5)
        assert apps[1].gateway.fleet.quiet < QUIET_TICKS  # the change woke it up
        # the sender published at the next interval, not at the end of its idle wait
        assert apps[0].gateway.fleet.early_wakes >= 1
        assert (await sent)[0] == 200


async def test_pushes_carry_load_between_ticks() -> None:
    """With ticks 2 s apart, a peer still sees the other gateway's requests start and end: the
    pushes (gateway/fleet/shared_load.py) carry them one round trip after the change."""
    slow = {"fleet": {"publish_interval_ms": 2000, "stale_after_s": 30, "push_interval_ms": 2}}
    async with fleet_of(2, [Upstream("u0", delay_s=0.5)], **slow) as (apps, gws, _), \
            aiohttp.ClientSession() as h:  # fmt: skip
        await poll_until(lambda: all(a.gateway.fleet.peers == 1 for a in apps), 10)
        ticks = apps[1].gateway.fleet.ticks
        sent = [asyncio.create_task(post(h, gws[0], f"p{i}")) for i in range(2)]
        await poll_until(lambda: peer_inflight(apps[1]) == 2, 5)
        assert [s for s, _ in await asyncio.gather(*sent)] == [200, 200]
        await poll_until(lambda: peer_inflight(apps[1]) == 0, 5)
        push = apps[1].gateway.fleet.push
        assert push is not None and push.applied >= 2  # start and end came by push
        assert apps[1].gateway.fleet.ticks - ticks <= 1  # at most one tick in between
        assert apps[0].gateway.fleet.push.sent >= 2


async def test_the_first_change_after_a_quiet_interval_is_pushed_at_once() -> None:
    """The push interval throttles, it does not delay: with pushes at most every 5 s and ticks
    10 s apart, a request's start reaches the peer at once; a second start within the interval
    waits for its end (one push, not two)."""
    slow = {"fleet": {"publish_interval_ms": 10_000, "stale_after_s": 60, "push_interval_ms": 5000}}
    async with fleet_of(2, [Upstream("u0", delay_s=3.0)], **slow) as (apps, gws, _), \
            aiohttp.ClientSession() as h:  # fmt: skip
        await poll_until(lambda: apps[1].gateway.fleet.peers == 1, 10)  # its first tick
        push = apps[0].gateway.fleet.push
        assert push is not None and push.sent == 0
        sent = [asyncio.create_task(post(h, gws[0], "first"))]
        await poll_until(lambda: peer_inflight(apps[1]) == 1, 1.5)  # not 5 s later
        assert push.sent == 1
        sent.append(asyncio.create_task(post(h, gws[0], "second")))
        await poll_until(lambda: apps[0].gateway.all_replicas()[0].inflight == 2, 1.5)
        await asyncio.sleep(0.3)
        assert push.sent == 1 and peer_inflight(apps[1]) == 1  # held for the interval's end
        for t in sent:
            t.cancel()
        await asyncio.gather(*sent, return_exceptions=True)


async def test_pushes_carry_the_learned_fit_without_ticks() -> None:
    """A request's end moves the load and the ttft fit together: with both gateways' ticks
    stopped once they know each other, the peer still learns from the other's answers, by push
    alone, to the same coefficients."""
    slow = {"fleet": {"publish_interval_ms": 2000, "stale_after_s": 30, "push_interval_ms": 2}}
    async with fleet_of(2, [Upstream("u0", delay_s=0.2)], **slow) as (apps, gws, _), \
            aiohttp.ClientSession() as h:  # fmt: skip
        await poll_until(lambda: all(a.gateway.fleet.peers == 1 for a in apps), 10)
        for a in apps:  # no more ticks: what follows can only come by push
            a.gateway.fleet._task.cancel()
        ticks = [a.gateway.fleet.ticks for a in apps]
        scorer_a, scorer_b = (a.gateway.pools["chat"].policy.scorers[0][0] for a in apps)
        before = scorer_b.coefficients("r0")
        assert [s for s, _ in await asyncio.gather(*(post(h, gws[0], f"f{i}") for i in range(3)))] \
            == [200] * 3
        await poll_until(lambda: scorer_b.coefficients("r0") == scorer_a.coefficients("r0"), 5)
        assert scorer_b.coefficients("r0") != before  # learned from A's answers
        assert [a.gateway.fleet.ticks for a in apps] == ticks


def own_scrapes(app: Any) -> dict[str, int]:
    """Replica name -> how many times this gateway scraped it itself."""
    return {r.name: r.own_scrape[0] if r.own_scrape else 0 for r in app.gateway.all_replicas()}


async def test_each_replica_is_scraped_by_one_gateway_and_every_gateway_has_its_load() -> None:
    """Shared scrapes (gateway/fleet/shared_scrape.py): once the gateways know each other, each replica's
    /metrics is fetched by one of them, the other takes the sample from the fleet's hash, and
    both see the load the replica reports; when the scraper stops, the other scrapes it again."""
    scrape = {"pool": {"scrape": {"enabled": True, "interval_s": 0.05, "stale_after_s": 2.0}}}
    ups = [Upstream(f"u{i}", delay_s=2.0) for i in range(4)]
    async with fleet_of(2, ups, **scrape) as (apps, gws, _), aiohttp.ClientSession() as h:
        await poll_until(lambda: all(a.gateway.fleet.peers == 1 for a in apps), 10)
        fleets = [a.gateway.fleet for a in apps]
        names = {r.url: r.name for r in apps[0].gateway.all_replicas()}
        owner = {names[u]: [f.scrapes.owns(u) for f in fleets] for u in names}
        assert all(sum(o) == 1 for o in owner.values()), owner  # one scraper per replica
        # the others have stopped scraping it: no count of a replica a gateway does not own
        # moves over a few ticks (a scrape sent before the gateways met may still land)
        def not_owned(snapshot: list[dict[str, int]]) -> list[int]:
            return [snapshot[i][n] for i in range(len(apps)) for n, o in owner.items() if not o[i]]

        before = [own_scrapes(a) for a in apps]
        for _ in range(25):
            await asyncio.sleep(0.2)
            now = [own_scrapes(a) for a in apps]
            settled, before = not_owned(now) == not_owned(before), now
            if settled:
                break
        sent = [asyncio.create_task(post(h, gws[0], f"s{i}")) for i in range(3)]
        await poll_until(lambda: sum(u.calls for u in ups) == 3, 5)

        def running(app: Any) -> int:
            fresh = [r.scraped for r in app.gateway.all_replicas() if r.scraped is not None]
            return sum(int(s.running or 0) for s in fresh)

        await poll_until(lambda: running(apps[0]) == 3 and running(apps[1]) == 3, 5)
        after = [own_scrapes(a) for a in apps]
        for i in range(len(apps)):
            for name, owned in owner.items():
                grew = after[i][name] > before[i][name]
                assert grew == owned[i], (i, name, before[i][name], after[i][name])
        # a gateway that scrapes every replica itself (1 in 8 of the random ports) takes none
        takers = [f for i, f in enumerate(fleets) if not all(o[i] for o in owner.values())]
        assert takers and all(f.scrapes.applied > 0 for f in takers)
        await gws[1].stop()  # its field goes at once: gateway 0 scrapes everything again
        await poll_until(lambda: fleets[0].peers == 0, 5)
        mine = own_scrapes(apps[0])
        await poll_until(lambda: all(v > mine[k] for k, v in own_scrapes(apps[0]).items()), 5)
        for t in sent:
            t.cancel()
        await asyncio.gather(*sent, return_exceptions=True)
