"""Shared load pushed as it changes: each gateway publishes its per-replica figures on a Redis
channel within `fleet.push_interval_ms` of a change, and applies its peers' as they arrive.

The tick (gateway/fleet_load.py) stays the fleet's ground truth: liveness, the learned sums,
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
import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson
from redis.exceptions import RedisError

from prefix_index.redis_client import OUTAGE

# What ends a tick or a push without ending the fleet's tasks: Redis going away (the index's
# list, with redis-py's cluster races), and any refusal besides (a demoted master's READONLY):
# the shared load is then down until a tick gets through.
FLEET_OUTAGE = (RedisError, *OUTAGE)

if TYPE_CHECKING:
    from gateway.fleet.shared_load import FleetLoad

log = logging.getLogger("gateway.fleet")

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
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
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
