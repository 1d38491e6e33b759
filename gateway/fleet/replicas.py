"""Replica state the router reads: health and circuit breaker, scraped load, the gateway's own counts
and, with shared load, the other gateways' (`peer_*`, set by gateway/fleet/shared_load.py).

`ReplicaState.view()` turns it into the policies' read-only `ReplicaView`; `ReplicaMonitor` runs the
per-replica background probe and scrape loops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.config import HealthConfig, PoolConfig, ReplicaConfig, ScrapeConfig
from gateway.fleet.lora import (
    LORA_INFO,
    LoraInfo,
    ReplicaAdapters,
    parse_lora_info,
    refresh_models,
)
from gateway.fleet.scrape import LoadSample, parse_metrics
from gateway.fleet.tier_load import TierLoadMeter
from gateway.transport.control import CONTROL_ERRORS, ControlClient, fetch, status_of
from gateway.transport.errors import UpstreamConnectTimeout
from policies.types import ReplicaView

log = logging.getLogger("gateway.replicas")

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
# a scrape that fails: no answer, or one that is not text in its charset (decoded strictly)
_SCRAPE_ERRORS: tuple[type[BaseException], ...] = (*CONTROL_ERRORS, UnicodeDecodeError, LookupError)


# the KV a replica's requests in flight hold is counted by every KV_STRIDE-th block of their
# chains (and each chain's last): a prefix they share is resolved to KV_STRIDE blocks (256
# tokens at 16 a block), and a dispatch costs a sixteenth of the dict updates of every block
KV_STRIDE = 16


def _kv_keys(chain: Sequence[int]) -> list[int]:
    """The blocks of `chain` counted in `ReplicaState.kv_blocks`: every KV_STRIDE-th, and the
    last (a whole chain held is then known held)."""
    keys = list(chain[KV_STRIDE - 1 :: KV_STRIDE])
    if len(chain) % KV_STRIDE:
        keys.append(chain[-1])
    return keys


@dataclass(slots=True)
class Circuit:
    """Open after N consecutive failures; half-open after `open_s`; a success closes it."""

    failures_to_open: int
    open_s: float
    state: str = CLOSED
    failures: int = 0
    opened_at: float = 0.0

    def current(self, now: float) -> str:
        if self.state == OPEN and now - self.opened_at >= self.open_s:
            self.state = HALF_OPEN
        return self.state

    def success(self) -> bool:
        """Record a success; True when this closed an open/half-open circuit."""
        changed = self.state != CLOSED
        self.state, self.failures = CLOSED, 0
        return changed

    def failure(self, now: float) -> bool:
        """Record a failure; True when this opened the circuit."""
        self.failures += 1
        if self.state == HALF_OPEN or (
            self.state == CLOSED and self.failures >= self.failures_to_open
        ):
            self.state, self.opened_at = OPEN, now
            return True
        return False


@dataclass(slots=True)
class ReplicaState:
    name: str
    url: str
    pool: str
    max_inflight: int
    circuit: Circuit
    models: frozenset[str] = frozenset()
    capacity_blocks: int | None = None
    kv_events: str | None = None
    kv_events_replay: str | None = None
    stale_after_s: float = 5.0
    dead_after_s: float = 10.0  # pools.<p>.health.dead_after_s
    # when it last sent a byte of anything (an answer, a probe's, a scrape's; monotonic): a
    # replica heard from within `dead_after_s` that only times out is busy, not dead
    heard_at: float = field(default_factory=time.monotonic)
    busy: int = 0  # timeouts not counted against its circuit: it was heard from (`failed`)
    kv_lost: bool = False  # `lost` was told since it last answered (the index forgot it once)
    draining: bool = False  # removed by a change, or cordoned: in no new snapshot's choice
    cordoned: bool = False  # drained through the admin API: no request is routed to it
    # its live streams that can resume elsewhere: each callable hands one over (`hand_over`)
    streams: set[Callable[[], None]] = field(default_factory=set)
    inflight: int = 0
    inflight_prompt_tokens: int = 0
    # the KV its requests in flight hold until they end, in prompt tokens, a prefix they share
    # counted once (issue 42); and their chains' blocks, each with the requests that hold it
    inflight_kv_tokens: int = 0
    kv_blocks: dict[int, int] = field(default_factory=dict)
    placed_blocks: int = 0  # blocks new to this replica routed to it, ever (cold placement)
    unrecords: int = 0  # failed dispatches whose unconfirmed blocks left the index
    # the other gateways' figures for this replica as of the last fleet tick (gateway/fleet/shared_load.py;
    # 0 when load is not shared): routing and the in-flight cap count own + peers'
    peer_inflight: int = 0
    peer_prompt_tokens: int = 0
    peer_placed_blocks: int = 0
    # new prefixes placed here and not yet prefilled, by their chain's key (gateway/routing/router.py,
    # Dispatch: a replica that held none of the prompt): own -> [tokens, requests], and the
    # peers' largest count per key. Two gateways that place one new prefix here at once count
    # its prefill once: the replica computes it once.
    cold: dict[int, list[int]] = field(default_factory=dict)
    peer_cold: dict[int, int] = field(default_factory=dict)
    scraped: LoadSample | None = None
    scraped_at: float = 0.0
    tier_load: TierLoadMeter = field(default_factory=TierLoadMeter)  # its tiers' measured rates
    engine_kv: tuple[int, int] | None = None  # (block size, KV tokens) the engine last reported
    engine_started: float | None = None  # its process's start time, as last scraped
    ttft_ewma_s: float | None = None
    served_models: frozenset[str] = frozenset()  # from the replica's /v1/models
    max_model_len: int | None = None  # the engine's context, from its /v1/models cards
    lora: ReplicaAdapters = field(default_factory=ReplicaAdapters)  # its LoRA adapters
    lora_max: int | None = None  # pools.<p>.lora.max_loras (None: the metric's)
    on_change: Callable[[ReplicaState], None] | None = field(default=None, repr=False)
    # its in-flight figures moved: the fleet's push publisher (gateway/fleet/shared_load.py), set by
    # the shared-load tick; None when load is not shared
    on_load: Callable[[], None] | None = field(default=None, repr=False)
    # with shared load, whether this gateway is the one of its fleet that scrapes the replica
    # (by URL; the others take its samples by tick, gateway/fleet/shared_scrape.py); None: it is
    scrape_here: Callable[[str], bool] | None = field(default=None, repr=False)
    # this gateway's own last scrape, what the fleet tick shares: (seq, when, sample, LoRA info)
    own_scrape: tuple[int, float, LoadSample, LoraInfo | None] | None = field(
        default=None, repr=False
    )
    # the engine reported a new KV geometry (`engine_kv`): set by its ReplicaMonitor, which
    # sizes the replica in the index by it
    on_engine_kv: Callable[[ReplicaState], None] | None = field(default=None, repr=False)
    # its prefix cache is gone (the engine restarted, or its health probes opened the circuit):
    # the index forgets what it held; set by its ReplicaMonitor
    on_lost: Callable[[ReplicaState, str], None] | None = field(default=None, repr=False)
    _idle: asyncio.Event | None = field(default=None, repr=False)

    @classmethod
    def from_config(cls, pool_name: str, pool: PoolConfig, rc: ReplicaConfig) -> ReplicaState:
        return cls(
            name=rc.display_name,
            url=rc.url,
            pool=pool_name,
            max_inflight=pool.max_inflight_per_replica,
            circuit=Circuit(pool.health.failures_to_open, pool.health.open_s),
            models=frozenset(rc.models),
            capacity_blocks=rc.capacity_blocks or pool.capacity_blocks,
            stale_after_s=pool.scrape.stale_after_s,
            dead_after_s=pool.health.dead_after_s,
            kv_events=rc.kv_events,
            kv_events_replay=rc.kv_events_replay,
            lora_max=pool.lora.max_loras,
        )

    # --- what routing reads ---------------------------------------------------------------
    def update(self, pool: PoolConfig, rc: ReplicaConfig) -> None:
        """Take a reloaded config's settings, keeping counters, circuit state and scraped load."""
        self.max_inflight = pool.max_inflight_per_replica
        self.circuit.failures_to_open = pool.health.failures_to_open
        self.circuit.open_s = pool.health.open_s
        self.models = frozenset(rc.models)
        self.capacity_blocks = rc.capacity_blocks or pool.capacity_blocks
        self.stale_after_s = pool.scrape.stale_after_s
        self.dead_after_s = pool.health.dead_after_s
        self.lora_max = pool.lora.max_loras

    def hand_over(self) -> int:
        """The replica is draining: each live stream on it that can resume elsewhere is told to
        (gateway/forwarding/resume.py); how many were."""
        streams = list(self.streams)
        for leave in streams:
            leave()
        return len(streams)

    async def drained(self, timeout_s: float) -> bool:
        """Wait until no request is in flight (the replica is draining); False on timeout."""
        if self.inflight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    def available(self, now: float) -> bool:
        """May take requests: circuit not open (a half-open one takes trials).

        A replica a change removed (`draining`) is in no new snapshot, so no new request sees it;
        requests that hold an older snapshot, queued before the change, may still be sent to it.
        """
        return self.circuit.current(now) != OPEN

    def proven(self, now: float) -> bool:
        """Known good: not draining and circuit closed (what /ready and replica_up report)."""
        return not self.draining and self.circuit.current(now) == CLOSED

    def view(self, hit_blocks: int, now: float) -> ReplicaView:
        load = (
            self.scraped
            if self.scraped is not None and now - self.scraped_at <= self.stale_after_s
            else None
        )
        return ReplicaView(
            name=self.name,
            url=self.url,
            pool=self.pool,
            healthy=self.circuit.current(now) != OPEN,
            draining=self.cordoned,
            circuit=self.circuit.state,
            models=self.models,
            inflight=self.inflight + self.peer_inflight,
            inflight_prompt_tokens=self.queued_prompt_tokens(),
            max_inflight=self.max_inflight,
            waiting=None if load is None or load.waiting is None else int(load.waiting),
            running=None if load is None or load.running is None else int(load.running),
            kv_usage=None if load is None else load.kv_usage,
            hit_blocks=hit_blocks,
            ttft_ewma_s=self.ttft_ewma_s,
            placed_blocks=self.placed_blocks + self.peer_placed_blocks,
            lora=lora.view() if (lora := self.lora).enabled else None,
            tier_load_rates=self.tier_load.rates,  # kept fresh by each scrape, not stale-gated
            kv_tokens=None if (kv := self.engine_kv) is None else kv[1],
            inflight_kv_tokens=self.inflight_kv_tokens,
        )

    def queued_prompt_tokens(self) -> int:
        """Uncached prompt tokens queued here, own and peers', a new prefix that this gateway
        and a peer both placed here counted once."""
        total = self.inflight_prompt_tokens + self.peer_prompt_tokens
        cold, peers = self.cold, self.peer_cold
        if cold and peers:
            for key, (tokens, _) in cold.items():
                theirs = peers.get(key)
                if theirs is not None:
                    total -= min(tokens, theirs)
        return total

    def took_sample(self, sample: LoadSample, now: float) -> None:
        """A scrape's load (fresh until `stale_after_s`) and the engine's tier load counters."""
        self.scraped, self.scraped_at = sample, now
        self.tier_load.update(sample)

    def took_scrape(self, sample: LoadSample, lora: LoraInfo | None, now: float) -> None:
        """What one scrape says, this gateway's or (shared load) the fleet's scraper's: the load,
        the adapters in flight, the engine's KV geometry (`on_engine_kv` when it is new)."""
        self.took_sample(sample, now)
        started = sample.started
        if started is not None:
            if self.engine_started is not None and started != self.engine_started:
                self.lost("the engine restarted (process_start_time_seconds changed)")
            self.engine_started = started
        if lora is not None:  # adapters in flight, by the newest series (gateway/fleet/lora.py)
            self.lora.set_metric(lora[0], lora[1], self.lora_max)
        tokens = sample.kv_tokens
        if tokens is not None and sample.block_size is not None:
            kv = (sample.block_size, tokens)
            if kv != self.engine_kv:
                self.engine_kv = kv
                if self.on_engine_kv is not None:
                    self.on_engine_kv(self)

    def scrapes_here(self) -> bool:
        return self.scrape_here is None or self.scrape_here(self.url)

    def has_slot(self) -> bool:
        """Below `max_inflight` counting every gateway's requests (own + peers' last tick)."""
        return self.inflight + self.peer_inflight < self.max_inflight

    # --- what the proxy reports ------------------------------------------------------------
    def dispatched(
        self,
        uncached_prompt_tokens: int,
        new_blocks: int = 0,
        cold: int | None = None,
        kv_tokens: int = 0,
        kv_chain: Sequence[int] = (),
        block_tokens: float = 0.0,
    ) -> None:
        """A request sent here; `cold`: the key of a new prefix it places (none held here);
        `kv_tokens`: its prompt, the KV it holds here until it ends, less the leading blocks of
        `kv_chain` (its block hashes, `block_tokens` each) that requests in flight here hold."""
        self.inflight += 1
        self.inflight_prompt_tokens += uncached_prompt_tokens
        if kv_chain:
            shared = self.kv_held(kv_chain)
            blocks = self.kv_blocks
            for h in _kv_keys(kv_chain):
                blocks[h] = blocks.get(h, 0) + 1
            kv_tokens = max(0, kv_tokens - int(shared * block_tokens))
        self.inflight_kv_tokens += kv_tokens
        self.placed_blocks += new_blocks
        if cold is not None:
            entry = self.cold.setdefault(cold, [0, 0])
            entry[0] += uncached_prompt_tokens
            entry[1] += 1
        if self.on_load is not None:
            self.on_load()

    def prefilled(self, uncached_prompt_tokens: int, cold: int | None = None) -> None:
        self.inflight_prompt_tokens = max(0, self.inflight_prompt_tokens - uncached_prompt_tokens)
        if cold is not None and (entry := self.cold.get(cold)) is not None:
            entry[0] -= uncached_prompt_tokens
            entry[1] -= 1
            if entry[1] <= 0:
                del self.cold[cold]
        if self.on_load is not None:
            self.on_load()

    def finished(
        self, kv_tokens: int = 0, kv_chain: Sequence[int] = (), block_tokens: float = 0.0
    ) -> None:
        """A request ended: its KV is freed, but for the blocks of its chain that other
        requests in flight here still hold."""
        self.inflight = max(0, self.inflight - 1)
        if kv_chain:
            blocks = self.kv_blocks
            for h in _kv_keys(kv_chain):
                n = blocks.get(h)
                if n is not None:
                    if n <= 1:
                        del blocks[h]
                    else:
                        blocks[h] = n - 1
            kv_tokens = max(0, kv_tokens - int(self.kv_held(kv_chain) * block_tokens))
        self.inflight_kv_tokens = max(0, self.inflight_kv_tokens - kv_tokens)
        if self.inflight == 0 and self._idle is not None:
            self._idle.set()
        if self.on_load is not None:
            self.on_load()

    def kv_held(self, chain: Sequence[int]) -> int:
        """How many leading blocks of `chain` the requests in flight here hold, to a multiple of
        `KV_STRIDE` (or the whole chain). A chain hash names its whole prefix, so the blocks
        held form a prefix of it: a binary search over the blocks counted (`_kv_keys`)."""
        blocks = self.kv_blocks
        n = len(chain)
        if not blocks or not n:
            return 0
        lo, hi = 0, (n - 1) // KV_STRIDE + 1  # keys [0, lo) held; keys [hi, ...) not known held
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if chain[min(mid * KV_STRIDE, n) - 1] in blocks:
                lo = mid
            else:
                hi = mid - 1
        return min(lo * KV_STRIDE, n)

    def observe_ttft(self, ttft_s: float) -> None:
        self.ttft_ewma_s = (
            ttft_s if self.ttft_ewma_s is None else 0.8 * self.ttft_ewma_s + 0.2 * ttft_s
        )

    def succeeded(self) -> None:
        self.kv_lost = False
        if self.circuit.success():
            log.info("replica %s: circuit closed", self.name)
            self._changed()

    def failed(self, why: str, busy: bool = False) -> bool:
        """Count a failure; True when it opened the circuit.

        `busy`: the failure was a timeout (a connect, a first byte, a probe), which a replica
        that is alive but slow gives as surely as a dead one. Heard from within `dead_after_s`,
        it is busy: counted in `busy`, not against its circuit (its requests fail over all the
        same). Silent longer, the timeout is a failure like any other."""
        now = time.monotonic()
        if busy and now - self.heard_at < self.dead_after_s:
            if not self.busy:
                log.info("replica %s: busy (%s); alive, so its circuit does not count it", self.name, why)
            self.busy += 1
            return False
        if self.circuit.failure(now):
            log.warning("replica %s: circuit opened (%s)", self.name, why)
            self._changed()
            return True
        return False

    def heard(self, now: float | None = None) -> None:
        """It sent something: it is alive, however busy."""
        self.heard_at = time.monotonic() if now is None else now

    def lost(self, why: str) -> None:
        """Its KV cache is gone or out of reach: what the index holds for it is no prediction."""
        log.warning("replica %s: %s; the index forgets its blocks", self.name, why)
        self.kv_lost = True
        if self.on_lost is not None:
            self.on_lost(self, why)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self)


class ReplicaMonitor:
    """Background health probes and `/metrics` scrapes for one replica, on the gateway's control
    client (`control_client.open_control_client`); each request is bounded by its `timeout_s`."""

    def __init__(
        self,
        replica: ReplicaState,
        client: ControlClient,
        health: HealthConfig,
        scrape: ScrapeConfig,
        on_engine_kv: Callable[[ReplicaState], None] | None = None,
        on_lost: Callable[[ReplicaState, str], None] | None = None,
        received: Callable[[str], int] | None = None,
    ) -> None:
        """`on_engine_kv(replica)`: the engine reported its KV cache geometry for the first time,
        or another one (`replica.engine_kv`), in its `cache_config_info` metric. `on_lost(replica,
        why)`: its prefix cache is gone (ReplicaState.lost). `received(url)`: the bytes the
        request path has received from a replica so far (`HttpClient.received`): while they
        move, the replica is heard from."""
        self.replica = replica
        self.client = client
        self.health = health
        self.scrape = scrape
        replica.on_engine_kv = on_engine_kv
        replica.on_lost = on_lost
        self._received = received
        self._received_last = -1
        self._tasks: list[asyncio.Task[None]] = []
        self._scrape_failing = False
        self.models_refresh_s = 5.0  # pools.<p>.lora.refresh_s

    def start(self) -> None:
        self._tasks.append(
            asyncio.create_task(self._probe_loop(), name=f"probe:{self.replica.name}")
        )
        if self.scrape.enabled:
            self._tasks.append(
                asyncio.create_task(self._scrape_loop(), name=f"scrape:{self.replica.name}")
            )

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    def listen(self) -> None:
        """The replica is heard from if the request path received bytes from it since the last
        look."""
        if self._received is not None:
            got = self._received(self.replica.url)
            if got != self._received_last:
                if self._received_last >= 0:
                    self.replica.heard()
                self._received_last = got

    async def probe_once(self) -> bool:
        r = self.replica
        self.listen()
        busy = False
        try:
            status = await status_of(
                self.client, r.url + self.health.path, timeout_s=self.health.timeout_s
            )
            r.heard()
            ok = status == 200
            why = f"health probe answered {status}"
        except CONTROL_ERRORS as exc:
            ok = False
            busy = isinstance(exc, TimeoutError | UpstreamConnectTimeout)
            why = "health probe timed out" if busy else f"health probe failed ({type(exc).__name__})"
        if ok:
            r.succeeded()
        elif r.failed(why, busy):
            r.lost("its health probes failed until its circuit opened")
        elif not busy and r.circuit.state != CLOSED and not r.kv_lost:
            # its requests opened the circuit (a stream broken mid-answer, connects refused):
            # a probe that fails outright, not slowly, says the engine is gone too
            r.lost("its health probe failed with its circuit open")
        return ok

    async def scrape_once(self) -> LoadSample | None:
        r = self.replica
        try:
            reply = await fetch(
                self.client, "GET", r.url + self.scrape.path, timeout_s=self.scrape.timeout_s
            )
            text = reply.text() if reply.status == 200 else None
            why = f"HTTP {reply.status}"
            r.heard()
        except _SCRAPE_ERRORS as exc:
            text, why = None, type(exc).__name__
        self.listen()
        if text is None:
            if not self._scrape_failing:
                log.warning("replica %s: metrics scrape failing (%s)", r.name, why)
                self._scrape_failing = True
            return None
        if self._scrape_failing:
            log.info("replica %s: metrics scrape recovered", r.name)
            self._scrape_failing = False
        sample = parse_metrics(text)
        lora = parse_lora_info(text) if LORA_INFO in text else None
        now = time.monotonic()
        r.took_scrape(sample, lora, now)
        r.own_scrape = (r.own_scrape[0] + 1 if r.own_scrape else 1, now, sample, lora)
        return sample

    async def _probe_loop(self) -> None:
        while True:
            await self.probe_once()
            await asyncio.sleep(self.health.interval_s)

    async def _scrape_loop(self) -> None:
        models_at = 0.0
        while True:
            if self.replica.scrapes_here():  # with shared load, one gateway of the fleet does
                await self.scrape_once()
            if time.monotonic() >= models_at:  # /v1/models: adapters and context, every refresh_s
                models_at = time.monotonic() + self.models_refresh_s
                await self.refresh_models()
            await asyncio.sleep(self.scrape.interval_s)

    async def refresh_models(self) -> None:
        """The replica's `/v1/models`: its LoRA adapters and its context (`max_model_len`)."""
        r = self.replica
        cards = await refresh_models(self.client, r.url, r.lora, r.lora_max)
        if cards is not None:
            r.max_model_len = context_length(cards)


def context_length(cards: list[dict[str, Any]]) -> int | None:
    """The longest context the `/v1/models` cards report (vLLM and SGLang: `max_model_len` on
    each base model's card; an adapter's is null: it runs in its parent's)."""
    lens = [
        n for c in cards
        if isinstance(n := c.get("max_model_len"), int) and not isinstance(n, bool) and n > 0
    ]  # fmt: skip
    return max(lens) if lens else None
