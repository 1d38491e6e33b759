"""The routers the benchmark compares inside the discrete-event simulator.

`DesRouter` is the gateway's own routing unit (`gateway.router.Router` on a real `Gateway` built
from config: chunker, MemoryIndex, ReplicaState views, the pool's policy, dispatch accounting),
fed each request's OpenAI body exactly as a client sends it; the DES only plays the clock and the
scrapes. `Clairvoyant` is a reference that reads the engines' true caches and queues. `ROUTERS`
names them all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.api.openai import parse_body
from gateway.config import Config, parse_config
from gateway.fleet.scrape import LoadSample
from gateway.routing.router import Dispatch, LoraOffer, RouteInput
from gateway.runtime.gateway import Gateway
from policies import build_policy
from policies.registry import DEFAULT_POLICY
from prefix_index.chunking import scope_key
from prefix_index.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEventApplier,
)
from prefix_index.memory import MemoryIndex
from simulator.des import Cluster, ReplicaLoad, SimRequest
from simulator.sequence import Status

MODEL = "bench-model"
POOL = "bench"


def gateway_config(
    n_replicas: int, policy: str | dict[str, Any], capacity_blocks: int | None = None
) -> Config:
    """The config a gateway in front of this cluster would load: defaults, plus the pool's KV
    size (`capacity_blocks`, in index blocks) when given."""
    pool: dict[str, Any] = {
        "replicas": [
            {"url": f"http://10.0.0.{i + 1}:8000", "name": f"r{i}"} for i in range(n_replicas)
        ],
        "policy": policy,
    }
    if capacity_blocks is not None:
        pool["capacity_blocks"] = capacity_blocks
    return parse_config({"pools": {POOL: pool}, "tracing": {"exporter": "none"}})


def body_of(req: SimRequest) -> tuple[str, bytes]:
    """The endpoint and raw body a client sent for `req`: its own (`meta["kind"]`, `meta["raw"]`),
    a chat body for a chat work item (`meta["item"]`), or, for a token-level workload,
    `/v1/completions` with the prompt's token ids."""
    raw = req.meta.get("raw")
    if raw is not None:
        return req.meta["kind"], raw
    item = req.meta.get("item")
    if item is not None:
        chat = {"model": MODEL, "messages": list(item.messages), "max_tokens": req.max_tokens,
                "stream": True}  # fmt: skip
        return "chat", orjson.dumps(chat)
    body = {"model": MODEL, "prompt": list(req.prompt_tokens), "max_tokens": req.max_tokens,
            "stream": True}  # fmt: skip
    return "completions", orjson.dumps(body)


class DesRouter:
    """`simulator.des.Router` around the gateway's routing unit, as the pipeline drives it.

    route: parse the body (`gateway.openai.parse_body`), `Router.prompt` / `prepare` (render,
    scope, hash), `decide` (index match, views, policy), `dispatch` + `record` (in-flight counts
    and the chain on the chosen replica). First token: `Dispatch.prefilled`. Finish:
    `Dispatch.finished` with the replica's TTFT (every DES request is a streamed 200), `done`.

    The DES cannot hold a request back, so when every replica is saturated (the gateway would
    queue it in admission) the request goes to the replica with the fewest in flight and is
    counted in `overflow`. `predicted[req.id]` keeps the predicted cached tokens per request.

    `clock`: how many times faster than the engines' time the gateway's clock runs, so the TTFTs
    the policy learns from are the simulated ones divided by it: 5 is what the gateway measures
    over HTTP in front of replicas simulated at speedup 5 (bench.routing_http), and what it
    would learn in front of engines 5 times faster than its scorer's prior assumes.
    """

    def __init__(
        self,
        policy: str | dict[str, Any],
        n_replicas: int,
        *,
        seed: int = 0,
        kv_tokens: int | None = None,
        label: str | None = None,
        clock: float = 1.0,
    ) -> None:
        probe = gateway_config(1, "round_robin")
        tpb = probe.index.chunking.block_bytes / 4  # bytes mode: index blocks per token estimate
        # the pool's capacity_blocks: each replica's KV size in index blocks, as an operator
        # reads it off vllm:cache_config_info (None: the index's default per replica)
        capacity = None if kv_tokens is None else int(kv_tokens // tpb)
        cfg = gateway_config(n_replicas, policy, capacity)
        self.name = label or (policy if isinstance(policy, str) else "custom")
        self.clock = clock
        self.now = 0.0
        self.gw = Gateway(cfg)
        self.gw.use_index(self._index(cfg))
        self.pool = self.gw.pools[POOL]
        self.pool.policy = build_policy(cfg.pools[POOL].policy, seed=seed)  # the run's seed
        self.router = self.gw.router
        self.replicas = self.pool.replicas
        self.slot = {r.name: i for i, r in enumerate(self.replicas)}
        self.pending: dict[str, Dispatch] = {}
        self.predicted: dict[str, int] = {}
        self.reasons: dict[str, int] = {}
        self.overflow = 0
        self.route_ns = [0, 0, 0]  # hash, match, choose: where the router's time goes
        self.offer: LoraOffer | None = None  # managed LoRA's offer for the next choice

    def _index(self, cfg: Config) -> MemoryIndex:
        index = MemoryIndex(cfg.index.capacity_blocks, cfg.index.ttl_s, clock=lambda: self.now)
        for r in self.gw.pools[POOL].replicas:
            if r.capacity_blocks:
                index.set_capacity(r.name, r.capacity_blocks)
        return index

    def _scraped(self, view: Sequence[ReplicaLoad]) -> None:
        for load in view:
            r = self.replicas[load.index]
            if r.scraped is None or r.scraped_at != load.scraped_at_s:
                r.scraped = LoadSample(
                    waiting=load.waiting, running=load.running, kv_usage=load.kv_usage
                )
                r.scraped_at = load.scraped_at_s

    async def route(self, req: SimRequest, view: Sequence[ReplicaLoad]) -> int:
        now = self.now = req.arrival_s
        self._scraped(view)
        kind, raw = body_of(req)
        parsed = parse_body(kind, raw)  # type: ignore[arg-type]
        router, pool = self.router, self.pool
        routing = await router.route(
            parsed, pool, router.prompt(parsed), RouteInput(req.id, session_key=req.meta.get("session"))
        )  # fmt: skip
        decision = router.choose(pool, routing, self.offer, now=now)
        name = decision.replica
        if name is None:
            self.overflow += 1
            name = min(self.replicas, key=lambda r: (r.inflight, self.slot[r.name])).name
            reason = "overflow"
        else:
            reason = decision.reason
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        for i, ns in enumerate((routing.hash_ns, routing.match_ns, routing.choose_ns)):
            self.route_ns[i] += ns
        d = await router.dispatch(pool, routing, name)
        self.pending[req.id] = d
        self.predicted[req.id] = d.hit_tokens
        return self.slot[name]

    def on_first_token(self, req: SimRequest, replica: int, t: float) -> None:
        self.now = t
        self.pending[req.id].prefilled()

    async def on_finish(self, req: SimRequest, replica: int, record: Any) -> None:
        self.now = record.finish_s
        d = self.pending.pop(req.id)
        await d.finished(True, True, (record.first_token_s - record.arrival_s) / self.clock)
        d.done()


class Clairvoyant:
    """Reference: the least predicted TTFT from every replica's true state (simulator only).

    For each replica: its true cached prefix of this prompt (`cached_prefix_tokens`), the
    prefill tokens still ahead in its queue (running prompts not yet computed, waiting prompts
    less what its cache holds of them now) and its running batch. Predicted TTFT =
    (queued + own uncached) x prefill time per token + the steps that takes (8K tokens a step)
    x the decode time of its batch. The least wins; ties go to more free KV.
    """

    name = "clairvoyant"

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        cfg = cluster.config
        self.perf = cfg.perf
        self.budget = cfg.max_num_batched_tokens
        self.bs = cfg.block_size
        self.overflow = 0
        self.reasons = {"clairvoyant": 0}

    def route(self, req: SimRequest, view: Sequence[ReplicaLoad]) -> int:
        t = req.arrival_s
        perf, bs = self.perf, self.bs
        tokens = req.prompt_tokens
        hashes = self.cluster.hasher(tokens)
        best: tuple[float, float, int] | None = None
        for i, e in enumerate(self.cluster.engines):
            e.sync(t)
            cache = e.cache
            own = len(tokens) - e.cached_prefix_tokens(tokens, hashes=hashes)
            queued = 0
            kv_tokens = 0
            n_run = 0
            for seq in e.requests.values():
                if seq.status is Status.RUNNING:
                    n_run += 1
                    kv_tokens += seq.num_computed
                    queued += max(0, seq.prompt_len - seq.num_computed)
                elif seq.status is Status.WAITING:
                    limit = (seq.prompt_len - 1) // bs
                    queued += seq.prompt_len - cache.longest_prefix(seq.hashes, limit) * bs
            work = queued + own
            steps = max(1, -(-work // self.budget))
            decode = perf.decode_time(n_run, kv_tokens) if n_run else 0.0
            ttft = work * perf.prefill_s_per_token + steps * (perf.step_overhead_s + decode)
            key = (ttft, cache.usage, i)
            if best is None or key < best:
                best = key
        assert best is not None
        self.reasons["clairvoyant"] += 1
        return best[2]


@dataclass(frozen=True, slots=True)
class RouterVariant:
    """A named router: `build(cluster, seed)` makes a fresh one for each run."""

    name: str
    build: Callable[[Cluster, int], Any]
    reference: bool = False  # a yardstick, not a candidate for the default


def _kv_tokens(cluster: Cluster) -> int:
    return cluster.config.num_blocks * cluster.config.block_size


def _gateway(policy: str, clock: float = 1.0) -> RouterVariant:
    name = policy if clock == 1.0 else f"{policy}@{clock:g}x"
    return RouterVariant(
        name,
        lambda c, seed: DesRouter(
            policy, len(c.engines), seed=seed, kv_tokens=_kv_tokens(c), label=name, clock=clock
        ),
    )


BASELINES = ("round_robin", "least_loaded")
CANDIDATES = ("prefix_aware", "ttft", "cost_blocks", "sticky", "sglang_cache_aware")
# the default policy learning TTFTs on a clock 5x faster than the engines' (DesRouter.clock):
# as over HTTP at speedup 5 (bench.routing_http), or in front of engines 5x faster than its prior
WALL_CLOCK = f"{DEFAULT_POLICY}@5x"
ROUTERS: dict[str, RouterVariant] = {
    **{p: _gateway(p) for p in (*BASELINES, *CANDIDATES)},
    WALL_CLOCK: _gateway(DEFAULT_POLICY, 5.0),
    "clairvoyant": RouterVariant("clairvoyant", lambda c, seed: Clairvoyant(c), reference=True),
}
DEFAULT_ROUTERS = (*BASELINES, *CANDIDATES, "clairvoyant")
GATEWAY_DEFAULT = DEFAULT_POLICY


class PreciseDesRouter(DesRouter):
    """`DesRouter` in precise mode: the index also learns what each engine really stored and
    evicted, from the engines' KV events, through the gateway's own `KvEventApplier`.

    As with `index.events.enabled` in the gateway, routed entries live `routed_ttl_s` and
    `match` answers the better of routed and engine-reported per replica. Engine blocks are
    hashed from token ids, so they line up with the gateway's chains only where the body is
    token ids (a token-level workload, `completion_ids`); elsewhere the routed entries answer.
    """

    def __init__(
        self, policy: str, cluster: Cluster, *, seed: int = 0, routed_ttl_s: float = 10.0
    ) -> None:
        self.routed_ttl_s = routed_ttl_s
        super().__init__(
            policy,
            len(cluster.engines),
            seed=seed,
            kv_tokens=_kv_tokens(cluster),
            label=f"{policy}+precise",
        )
        self.engines = cluster.engines
        for e in self.engines:
            e.cache.events = []  # the engines record KV events as a publisher would send them
        scope = scope_key(MODEL)
        chunker = self.gw.chunker
        index = self.gw.index
        assert isinstance(index, MemoryIndex)
        self.appliers = [
            KvEventApplier(index, chunker, lambda lora: scope, r.name) for r in self.replicas
        ]
        self.block_size = cluster.config.block_size

    def _index(self, cfg: Config) -> MemoryIndex:
        index = MemoryIndex(
            cfg.index.capacity_blocks, None, clock=lambda: self.now, routed_ttl_s=self.routed_ttl_s
        )
        for r in self.gw.pools[POOL].replicas:
            if r.capacity_blocks:
                index.set_capacity(r.name, r.capacity_blocks)
            index.set_precise(r.name)
        return index

    async def route(self, req: SimRequest, view: Sequence[ReplicaLoad]) -> int:
        self.now = req.arrival_s
        for engine, applier in zip(self.engines, self.appliers, strict=True):
            raw = engine.cache.events
            if raw:
                engine.cache.events = []
                await applier.apply(EventBatch(self.now, [self._event(e) for e in raw]))
        return await super().route(req, view)

    def _event(self, e: tuple[Any, ...]) -> Any:
        if e[0] == "stored":
            _, hashes, parent, token_ids = e
            return BlockStored(list(hashes), parent, list(token_ids), self.block_size)
        if e[0] == "removed":
            return BlockRemoved([e[1]])
        return AllBlocksCleared()


def _precise(policy: str) -> RouterVariant:
    return RouterVariant(f"{policy}+precise", lambda c, seed: PreciseDesRouter(policy, c, seed=seed))


ROUTERS.update({f"{p}+precise": _precise(p) for p in (DEFAULT_POLICY, "prefix_aware")})
