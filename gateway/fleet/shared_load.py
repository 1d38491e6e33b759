"""Shared load: the gateways of one fleet publish their per-replica in-flight figures and learned
TTFT sums to Redis and fold the others' into every `ReplicaView`, on one tick off the request path.

One hash per fleet, one field per gateway (docs/scaleout.md):

    kvgw:fleet:{<fleet.name>}:load   HASH   <gateway_id> -> orjson {"s": seq, "t": unix s,
        "r": {replica url: [in-flight requests, uncached prompt tokens queued, placed blocks
                            (, {new prefix key: its tokens queued}, while there are any)]},
        "l": {pool: {plugin: {replica url: numbers}}},      (`Policy.share()`, by URL)
        "m": {replica url: [seq, load sample, LoRA info]}}  (gateway/fleet/shared_scrape.py)

A tick is one round trip (one Lua call: HSET own field, PEXPIRE, HDEL of the long dead, HGETALL).
A peer whose `seq` has not moved for `stale_after_s` (by this gateway's clock, so clock skew does
not matter) no longer counts; its field is deleted after ten times that. A gateway that stops
deletes its own field. Redis down: one warning, peers' figures age out as above (own-only
load), retried with backoff. Replicas are keyed by URL, which names the engine whatever each
gateway's config calls it.

Shared load pushed as it changes: each gateway publishes its per-replica figures on a Redis
channel within `fleet.push_interval_ms` of a change, and applies its peers' as they arrive.

The tick (gateway/fleet/shared_load.py) stays the fleet's ground truth: liveness, the learned sums,
recovery after Redis was out. But a tick-old load picture (100 ms by default, up to two ticks
from a peer's dispatch to this gateway's reading) lets gateways that get requests moments apart
send them to the same "least loaded" replica: measured with `bench.scaleout`, 4 gateways
replaying the public trace lost 13-19 % of TTFT mean to one gateway at a 20 ms tick and 5 % at
1 ms. A push arrives one Redis round trip after the change, and costs nothing while the
figures stand still.

    kvgw:fleet:{<fleet.name>}:push   PUBLISH   orjson {"g": gateway_id, "s": seq, "r": {...},
                                                       "l": {...}}

`r` and `l` are what the tick's hash field carries (load figures, learned sums): a request's end
moves both, and a peer that learned from it a tick later than it saw the load end could send a
new prefix elsewhere than this gateway would (the `ttft` fit decides the near ties).

`s` comes from the tick's counter, so a reader keeps whichever of push and hash field is newer.
A replica's figures moving (dispatch, first token, end) wakes the publisher
(`ReplicaState.on_load`, one Event.set on the request path); it publishes at most once per
interval, if the figures differ from its last push: the first change after a quiet interval at
once, the changes that follow within the interval together at its end. Waiting an interval
before every push (as before) put 2 ms on the median push: 3.8 ms from a change to a peer's
applying it, 1.8 ms without the wait (bench.scaleout's system workload, 4 gateways): requests
that arrive a few ms apart at different gateways are what a push-old picture sends to the same
idle replica, each gateway unaware of the other's. Idle, it costs nothing. Redis out: the tick reports it; the listener retries every second.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import orjson
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.config import Config
from gateway.fleet.pools import Pool
from gateway.fleet.replicas import ReplicaState
from gateway.fleet.shared_scrape import ScrapeShare, replicas_by_url
from prefix_index import MemoryIndex, PrefixIndex
from prefix_index._fastlane import ClusterLane, FastLane, Lane
from prefix_index.redis_client import OUTAGE, Client, cancel, open_redis, redact_url

# What ends a tick or a push without ending the fleet's tasks: Redis going away (the index's
# list, with redis-py's cluster races), and any refusal besides (a demoted master's READONLY):
# the shared load is then down until a tick gets through.
FLEET_OUTAGE = (RedisError, *OUTAGE)


log = logging.getLogger("gateway.fleet")


class Fleet(Protocol):
    """What the shared load reads of the gateway's current snapshot (gateway/runtime/snapshot.py)."""

    @property
    def config(self) -> Config: ...

    @property
    def pools(self) -> Mapping[str, Pool]: ...

    def replicas(self) -> list[ReplicaState]: ...

CHANNEL = "kvgw:fleet:{%s}:push"  # the fleet's hash tag: one Cluster slot, like its hash


class LoadPush:
    """The publisher and the listener of one gateway's pushes."""

    def __init__(
        self, fleet: FleetLoad, mine: Callable[[], tuple[dict[str, list[Any]], Any]], name: str,
        interval_s: float,
    ) -> None:  # fmt: skip
        self.fleet = fleet
        self._mine = mine  # this gateway's own per-replica figures and learned sums, now
        self.channel = CHANNEL % name
        self.interval_s = interval_s
        self.sent = 0  # pushes published
        self.applied = 0  # peers' pushes taken (newer than what this gateway held)
        self._tasks: list[asyncio.Task[None]] = []
        self._wake = asyncio.Event()

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._publish(), name="fleet-push"),
            asyncio.create_task(self._listen(), name="fleet-listen"),
        ]

    async def stop(self) -> None:
        await cancel(*self._tasks)
        self._tasks = []

    def poke(self) -> None:
        """A replica's in-flight figures moved (ReplicaState.on_load): publish within one
        interval. On the request path: one Event.set, nothing else."""
        self._wake.set()

    async def _publish(self) -> None:
        fleet = self.fleet
        last: tuple[dict[str, list[int]], Any] | None = None
        gid = fleet.gateway_id
        loop = asyncio.get_running_loop()
        sent_at = -math.inf
        while True:
            await self._wake.wait()
            # at most one push per interval: the first change after a quiet interval goes at
            # once, the changes that follow it within the interval go together in the next
            wait = sent_at + self.interval_s - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            self._wake.clear()
            mine = self._mine()
            if mine == last:
                continue
            body = orjson.dumps({"g": gid, "s": fleet.next_seq(), "r": mine[0], "l": mine[1]})
            try:
                await fleet.call(b"PUBLISH", self.channel.encode(), body)
            except FLEET_OUTAGE:
                continue  # the tick says Redis is out; try again at the next change
            last, sent_at = mine, loop.time()
            self.sent += 1

    async def _listen(self) -> None:
        while True:
            pubsub: Any = None
            try:
                client = self.fleet.redis()
                await client.initialize()  # a Cluster's pubsub needs its slot map first
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                await pubsub.subscribe(self.channel)
                async for msg in pubsub.listen():
                    if msg.get("type") == "message" and self.fleet.apply_push(msg["data"]):
                        self.applied += 1
            except FLEET_OUTAGE as exc:
                log.debug("fleet push listener: %s: %s", type(exc).__name__, exc)
            except Exception:  # never a dead listener: the pushes would stop without a word
                log.exception("fleet push listener failed; subscribing again in 1 s")
            finally:
                if pubsub is not None:
                    with contextlib.suppress(*FLEET_OUTAGE):
                        await pubsub.aclose()
            await asyncio.sleep(1.0)



KEY = "kvgw:fleet:{%s}:load"  # the hash tag keeps the fleet's key in one Cluster slot
_GONE_FACTOR = 10  # a field unchanged for this many stale_after_s is deleted
QUIET_TICKS, IDLE_FACTOR = 10, 5  # an idle fleet ticks 5x less often (no figure has moved)
# One tick, one round trip: write this gateway's field (ARGV[1] = field, '' = a read alone;
# ARGV[2] = body, ARGV[3] = the key's TTL in ms), delete the fields of peers gone (ARGV[4..]),
# read the whole hash. Sent hand-packed on the index's fast lane: redis-py's pipeline machinery
# cost more CPU than the tick's own work, and every gateway of a fleet pays it 50 times a second.
TICK = """
if ARGV[1] ~= '' then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
if #ARGV > 3 then redis.call('HDEL', KEYS[1], unpack(ARGV, 4)) end
return redis.call('HGETALL', KEYS[1])
"""
TICK_SHA = hashlib.sha1(TICK.encode()).hexdigest().encode()
OK, DOWN, OFF = "ok", "down", "off"


def shared_load_enabled(config: Config) -> bool:
    """`fleet.shared_load`, where null follows the index: on with the redis backend."""
    on = config.fleet.shared_load
    return config.index.backend == "redis" if on is None else on


def default_gateway_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"


class _Peer:
    __slots__ = ("seq", "changed", "body", "raw", "rseq", "lseq", "scrapes")

    def __init__(self, seq: int, changed: float, body: dict[str, Any], raw: bytes) -> None:
        self.seq, self.changed, self.body, self.raw = seq, changed, body, raw
        self.rseq = seq  # the seq of the load figures in `body["r"]` (a push may be newer)
        self.lseq = seq  # ...and of the learned sums in `body["l"]`
        self.scrapes: dict[str, int] = {}  # url -> seq of its shared sample last taken


class FleetLoad:
    """The tick: publish this gateway's figures, read the others', set `ReplicaState.peer_*`
    and feed the pools' policies the peers' learned state. `status` is ok | down."""

    def __init__(
        self,
        config: Config,
        current: Callable[[], Fleet],
        notify: Callable[[str], None],
        client: Client | None = None,
    ) -> None:
        fc = config.fleet
        self.gateway_id = fc.gateway_id or default_gateway_id()
        self.name = fc.name
        self.key = KEY % fc.name
        self.interval_s = fc.publish_interval_ms / 1000.0
        # pushes between ticks (gateway/fleet/shared_load.py); None: the tick alone
        self.push = (
            LoadPush(self, lambda: own_state(current()), fc.name, fc.push_interval_ms / 1000.0)
            if fc.push_interval_ms > 0
            else None
        )
        self.stale_after_s = fc.stale_after_s
        self.scrapes = ScrapeShare(self.gateway_id)  # who scrapes which replica (shared_scrape.py)
        self.timeout_s = max(0.25, 5 * self.interval_s)
        self._url = fc.redis_url or config.index.redis_url
        self._client = client
        self._lane: Lane | None = None
        self._current = current
        self._notify = notify
        self._peers: dict[bytes, _Peer] = {}
        self._gone: list[bytes] = []  # fields to delete on the next tick
        self._absorbed: dict[str, list[Any]] = {}  # pool -> what its policy last absorbed
        self._seq = 0
        self._published: tuple[Any, Any] | None = None  # what the last publish said
        self._published_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self.status = OK
        self.peers = 0  # live peers as of the last tick
        self.ticks = 0
        self.errors = 0
        self.tick_s = 0.0  # wall time spent in ticks, in all
        self.quiet = 0  # ticks in a row that changed nothing
        self.early_wakes = 0  # idle waits cut short by this gateway's own figures moving
        self._moved = False  # this tick parsed a peer's new figures

    # --- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="fleet-load")
        if self.push is not None:
            self.push.start()

    async def stop(self) -> None:
        """Stop ticking and take this gateway's field out, so peers stop counting it at once."""
        if self.push is not None:
            await self.push.stop()
        await cancel(self._task)
        self._task = None
        if self._lane is not None:
            await self._lane.reset()
            self._lane = None
        if self._client is not None:
            with contextlib.suppress(*FLEET_OUTAGE):
                async with asyncio.timeout(self.timeout_s):
                    await self._client.hdel(self.key, self.gateway_id)
            await self._client.aclose()
            self._client = None

    def redis(self) -> Client:
        """The client, opened on first use: any URL the index takes (one node, Sentinel,
        Cluster, TLS; the fleet's one key carries a hash tag)."""
        if self._client is None:
            self._client = open_redis(
                self._url, socket_timeout=self.timeout_s, connect_timeout=self.timeout_s
            )
        return self._client

    def lane(self) -> Lane:
        """How ticks and pushes reach Redis: hand-packed commands on connections of the client's
        pool (a Cluster: through its own routing, which follows the fleet key's slot)."""
        if self._lane is None:
            client = self.redis()
            self._lane = (
                FastLane(lambda: client.connection_pool, self.timeout_s, 2)
                if isinstance(client, Redis)
                else ClusterLane(self.redis, self.timeout_s)
            )
        return self._lane

    async def call(self, *args: bytes) -> Any:
        """One command on the lane (the tick's script loaded on first need)."""
        lane = self.lane()
        return await lane.call(lane.command(args, ()), self._load_script)

    async def _load_script(self) -> None:
        await self.redis().script_load(TICK)

    async def _loop(self) -> None:
        """Tick every interval; after QUIET_TICKS ticks in which nothing changed (own figures or
        any peer's), every IDLE_FACTOR intervals until something does, though a change of this
        gateway's own figures ends the wait at the next interval; after a failure, back off
        from 0.5 s to 5 s."""
        backoff = self.interval_s
        while True:
            ok = await self.tick()
            if not ok:
                backoff = min(max(backoff * 2, 0.5), 5.0)
                await asyncio.sleep(backoff)
                continue
            backoff = self.interval_s
            if self.quiet >= QUIET_TICKS:
                await self._idle()
            else:
                await asyncio.sleep(self.interval_s)

    async def _idle(self) -> None:
        """An idle fleet's wait: up to IDLE_FACTOR intervals (never past a heartbeat: peers must
        see this gateway live), looking at its own figures every interval, so the first requests
        after a quiet spell reach the peers within one interval, not five. Looking costs a walk
        over the replicas, no Redis."""
        idle_s = max(self.interval_s, min(self.interval_s * IDLE_FACTOR, self.stale_after_s / 4))
        end = time.monotonic() + idle_s
        while time.monotonic() < end:
            await asyncio.sleep(self.interval_s)
            published = self._published
            if published is None or own_figures(self._current()) != published[0]:
                self.early_wakes += 1
                return

    # --- one tick --------------------------------------------------------------------------------
    async def tick(self) -> bool:
        """Publish and read once; False when Redis did not answer (peers then age out)."""
        t0 = time.perf_counter()
        snap = self._current()
        mine = own_state(snap)
        # publish what changed, and a heartbeat a few times per stale_after_s; read every tick
        publish = (mine != self._published or self.status == DOWN
                   or t0 - self._published_at >= self.stale_after_s / 4)  # fmt: skip
        ttl_ms = int(self.stale_after_s * _GONE_FACTOR * 1000)
        args = [b"EVALSHA", TICK_SHA, b"1", self.key.encode(), b"", b"", b"%d" % ttl_ms]
        if publish:
            body = {"s": self.next_seq(), "t": time.time(), "r": mine[0], "l": mine[1],
                    "m": self.scrapes.payload(snap.replicas())}  # fmt: skip
            args[4], args[5] = self.gateway_id.encode(), orjson.dumps(body)
        args += self._gone
        try:
            flat = await self.call(*args)
        except FLEET_OUTAGE as exc:
            self.errors += 1
            if self.status == OK:
                log.warning(
                    "fleet %s: shared load unavailable at %s (%s: %s); routing on this "
                    "gateway's own load until Redis answers",
                    self.key, redact_url(self._url), type(exc).__name__, exc,
                )  # fmt: skip
            self.status = DOWN
            self._fold(snap, None)
            self.tick_s += time.perf_counter() - t0
            return False
        if self.status == DOWN:
            log.info("fleet %s: shared load is back", self.key)
        changed = publish and mine != self._published
        if publish:
            self._published, self._published_at = mine, t0
        self.status = OK
        self._gone = []
        self._moved = False
        it = iter(flat)
        self._fold(snap, dict(zip(it, it, strict=True)))
        self.quiet = 0 if changed or self._moved else self.quiet + 1
        self.ticks += 1
        self.tick_s += time.perf_counter() - t0
        return True

    def _fold(self, snap: Fleet, fields: Mapping[bytes, bytes] | None) -> None:
        """Update the peers from `fields` (None: Redis did not answer) and set every replica's
        peer figures to the live peers' sums."""
        now = time.monotonic()
        me = self.gateway_id.encode()
        if fields is not None:
            seen = {}
            for field, raw in fields.items():
                if field == me:
                    continue
                peer = self._update(field, raw, now)
                if peer is not None:
                    seen[field] = peer
            self._peers = seen
        peers = self._live_peers(now)
        live = [p.body for p in peers.values()]
        self._gone = [f for f, p in self._peers.items()
                      if now - p.changed > self.stale_after_s * _GONE_FACTOR]  # fmt: skip
        self.peers = len(live)
        self.scrapes.set_live((f for f, p in peers.items() if "m" in p.body), fields is not None)
        self._set_load(snap, live)
        by_url = replicas_by_url(snap.replicas()) if peers else {}
        for peer in peers.values():
            self.scrapes.take(peer.scrapes, peer.body.get("m"), by_url)
        for name, pool in snap.pools.items():
            self._absorb(name, pool, live)

    def _set_load(self, snap: Fleet, live: list[dict[str, Any]]) -> None:
        """Every replica's peer figures: the sums over the live peers' bodies (and its own
        figures' changes wired to the push publisher, for replicas a reload or discovery
        added since the last tick)."""
        sums: dict[str, list[int]] = {}
        colds: dict[str, dict[int, list[int]]] = {}  # url -> key -> [sum, max] over peers
        for body in live:
            for url, figures in (body.get("r") or {}).items():
                acc = sums.setdefault(url, [0, 0, 0])
                for i in range(3):
                    acc[i] += int(figures[i])
                if len(figures) > 3 and isinstance(figures[3], dict):
                    seen = colds.setdefault(url, {})
                    for key, tokens in figures[3].items():
                        both = seen.setdefault(int(key), [0, 0])
                        both[0] += int(tokens)
                        both[1] = max(both[1], int(tokens))
        poke = None if self.push is None else self.push.poke
        for name, pool in snap.pools.items():
            freed = False
            for r in pool.replicas:
                r.on_load, r.scrape_here = poke, self.scrapes.owns
                n, tokens, placed = sums.get(r.url, (0, 0, 0))
                freed = freed or n < r.peer_inflight
                cold = colds.get(r.url)
                if cold:  # a new prefix two peers placed here at once: its prefill counts once
                    tokens -= sum(both[0] - both[1] for both in cold.values())
                    r.peer_cold = {key: both[1] for key, both in cold.items()}
                elif r.peer_cold:
                    r.peer_cold = {}
                r.peer_inflight, r.peer_prompt_tokens, r.peer_placed_blocks = n, tokens, placed
            if freed:
                self._notify(name)  # a peer's request ended: a slot may be free under the cap

    # --- pushes (gateway/fleet/shared_load.py) -----------------------------------------------------------
    def next_seq(self) -> int:
        """The seq of a new publication (field or push): one counter, so a reader can tell
        which of the two carries the newer load figures."""
        self._seq += 1
        return self._seq

    def apply_push(self, raw: bytes) -> bool:
        """A peer's pushed load figures and learned sums ({"g": id, "s": seq, "r": ..., "l":
        ...}): taken when newer than what this gateway holds of that peer; the replicas' peer
        figures are set and the policies refitted at once. A peer not seen in the hash yet
        waits for the tick (its liveness comes from there)."""
        try:
            msg = orjson.loads(raw)
            field, seq, figures = str(msg["g"]).encode(), int(msg["s"]), msg["r"]
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            return False
        peer = self._peers.get(field)
        if peer is None or seq <= peer.rseq or not isinstance(figures, dict):
            return False
        learned = msg.get("l")
        peer.body = {**peer.body, "r": figures}
        if isinstance(learned, dict):  # a gateway of an older version pushes load alone
            peer.body["l"], peer.lseq = learned, seq
        peer.rseq = seq
        now = time.monotonic()
        peer.changed = now
        snap, live = self._current(), self._live(now)
        self._set_load(snap, live)
        if isinstance(learned, dict):
            for name, pool in snap.pools.items():
                self._absorb(name, pool, live)
        return True

    def _live(self, now: float) -> list[dict[str, Any]]:
        """The bodies of the peers that still count."""
        return [p.body for p in self._live_peers(now).values()]

    def _live_peers(self, now: float) -> dict[bytes, _Peer]:
        """The peers that still count (changed within stale_after_s), by field."""
        stale = self.stale_after_s
        return {f: p for f, p in self._peers.items() if now - p.changed <= stale}

    def _update(self, field: bytes, raw: bytes, now: float) -> _Peer | None:
        old = self._peers.get(field)
        if old is not None and old.raw == raw:
            return old  # not republished since: nothing to parse
        try:
            body = orjson.loads(raw)
            seq = int(body["s"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            return None  # not a field this version writes
        if old is not None:
            if old.seq != seq:
                if old.rseq > seq:  # a push after this field was written: its figures are newer
                    body["r"] = old.body.get("r")
                if old.lseq > seq:
                    body["l"] = old.body.get("l")
                if body.get("r") != old.body.get("r") or body.get("l") != old.body.get("l"):
                    self._moved = True  # new figures, not only a heartbeat
                old.seq, old.changed, old.body, old.raw = seq, now, body, raw
                old.rseq, old.lseq = max(old.rseq, seq), max(old.lseq, seq)
            return old
        self._moved = True
        # first sight: as old as its writer's clock says (a dead gateway's field is not counted)
        age = max(0.0, time.time() - float(body.get("t") or 0.0))
        return _Peer(seq, now - age, body, raw)

    def _absorb(self, pool_name: str, pool: Any, live: list[dict[str, Any]]) -> None:
        """Feed the pool's policy what the live peers learned, translated from URLs to names."""
        got = [peer for body in live if (peer := (body.get("l") or {}).get(pool_name))]
        if got == self._absorbed.get(pool_name, []):
            return
        self._absorbed[pool_name] = got
        name_of = {r.url: r.name for r in pool.replicas}
        pool.policy.absorb(
            [
                {
                    plugin: {name_of[u]: nums for u, nums in by_url.items() if u in name_of}
                    for plugin, by_url in peer.items()
                }  # fmt: skip
                for peer in got
            ]
        )


def own_state(snap: Fleet) -> tuple[dict[str, list[int]], dict[str, Any]]:
    """What this gateway publishes, by tick and by push: its load figures, its learned sums."""
    return own_figures(snap), shared_learning(snap)


def own_figures(snap: Fleet) -> dict[str, list[Any]]:
    """Per replica URL: [in flight, uncached prompt tokens queued, placed blocks], then, while
    there are any, {key: tokens} of the new prefixes placed there not yet prefilled (a gateway
    that reads only the first three ignores it)."""
    out: dict[str, list[Any]] = {}
    for r in snap.replicas():
        figures: list[Any] = [r.inflight, r.inflight_prompt_tokens, r.placed_blocks]
        if r.cold:
            figures.append({str(key): tokens for key, (tokens, _) in r.cold.items()})
        out[r.url] = figures
    return out


def shared_learning(snap: Fleet) -> dict[str, dict[str, dict[str, list[float]]]]:
    out = {}
    for name, pool in snap.pools.items():
        shared = pool.policy.share()
        if shared:
            url = {r.name: r.url for r in pool.replicas}
            out[name] = {plugin: {url[n]: v for n, v in per.items() if n in url}
                         for plugin, per in shared.items()}  # fmt: skip
    return out


def start_fleet_load(
    current: Callable[[], Fleet], notify: Callable[[str], None], registry: CollectorRegistry
) -> FleetLoad | None:
    """The tick for the current config, started, with its metrics registered; None when load is
    not shared. Settings are read here: a change to `fleet:` takes effect at restart."""
    config = current().config
    if not shared_load_enabled(config):
        return None
    fleet = FleetLoad(config, current, notify)
    registry.register(_FleetCollector(fleet, current))
    fleet.start()
    return fleet


def ready_fields(fleet: FleetLoad | None, index: PrefixIndex | None) -> dict[str, Any]:
    """What /ready adds: the fleet (live peers; shared load ok | down | off) and the index
    (ok | down for Redis, memory). Neither turns /ready to 503: with Redis down the gateway
    still routes, on its own load and its own index writes (fail-open)."""
    fleet_part = {"peers": 0, "shared_load": OFF} if fleet is None else {
        "peers": fleet.peers, "shared_load": fleet.status}  # fmt: skip
    if index is None or isinstance(index, MemoryIndex):
        state = "memory"
    else:
        state = OK if getattr(index, "healthy", True) else DOWN
    return {"fleet": fleet_part, "index": state}


class _FleetCollector(Collector):
    def __init__(self, fleet: FleetLoad, current: Callable[[], Fleet]) -> None:
        self._fleet, self._current = fleet, current

    def collect(self) -> Iterator[Metric]:
        f = self._fleet
        yield GaugeMetricFamily(
            "gateway_fleet_peers", "Other gateways of the fleet whose load this one counts.",
            value=f.peers,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "gateway_fleet_shared_load_up",
            "1 while the fleet's shared load answers, 0 while routing on own load only.",
            value=1.0 if f.status == OK else 0.0,
        )
        yield CounterMetricFamily(
            "gateway_fleet_ticks", "Shared-load ticks (one Redis round trip each).", value=f.ticks
        )
        yield CounterMetricFamily(
            "gateway_fleet_tick_errors", "Shared-load ticks Redis did not answer.", value=f.errors
        )
        yield CounterMetricFamily(
            "gateway_fleet_tick_seconds", "Wall time spent in shared-load ticks.", value=f.tick_s
        )
        yield CounterMetricFamily(
            "gateway_fleet_scrapes_taken",
            "Replica load samples taken from the gateway of the fleet that scrapes the replica.",
            value=f.scrapes.applied,
        )
        scraped = GaugeMetricFamily(
            "gateway_fleet_scraping_replicas",
            "1 for a replica this gateway scrapes for the fleet, 0 for one a peer scrapes.",
            labels=["pool", "replica"],
        )
        for r in self._current().replicas():
            scraped.add_metric([r.pool, r.name], 1.0 if f.scrapes.owns(r.url) else 0.0)
        yield scraped
        push = f.push
        yield CounterMetricFamily(
            "gateway_fleet_pushes_sent",
            "Own load figures pushed between ticks (fleet.push_interval_ms).",
            value=0 if push is None else push.sent,
        )
        yield CounterMetricFamily(
            "gateway_fleet_pushes_applied",
            "Peers' pushed load figures taken (newer than what this gateway held).",
            value=0 if push is None else push.applied,
        )
        peer = GaugeMetricFamily(
            "gateway_fleet_peer_inflight_requests",
            "Requests the other gateways have in flight on the replica (as of their last tick or push).",
            labels=["pool", "replica"],
        )
        for r in self._current().replicas():
            peer.add_metric([r.pool, r.name], r.peer_inflight)
        yield peer
