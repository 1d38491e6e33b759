"""The routers the benchmark compares inside the discrete-event simulator.

`GatewayRouter` is the gateway's routing step with its real parts: the chunker, a `MemoryIndex`,
`ReplicaState` views, the policy from `build_policy`, and the gateway's in-flight accounting.
`Clairvoyant` is a reference that reads the engines' true caches and queues. `ROUTERS` names
them all; a later variant (e.g. an index fed by KV events) is one more entry there.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.config import Config, parse_config
from gateway.replicas import ReplicaState
from gateway.scrape import LoadSample
from policies import Outcome, RoutedRequest, build_policy
from policies.registry import DEFAULT_POLICY
from prefix_index.chunking import Chunker, make_chunker, render_chat, render_chatml, scope_key
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
    return parse_config({"pools": {POOL: pool}})


def _as_u32(tokens: Sequence[int]) -> Sequence[int]:
    """array("q") token ids as array("I") with one C-level copy (ids are < 2**32), so the
    chunker's own conversion to u32 bytes is a memcpy instead of a loop; same ids, same hashes."""
    if isinstance(tokens, array) and tokens.typecode == "q" and sys.byteorder == "little":
        out = array("I")
        out.frombytes(memoryview(tokens).cast("B").cast("I")[::2].tobytes())
        return out
    return tokens


@dataclass(slots=True)
class _Dispatch:
    """One request in flight: what the gateway's `_Attempt` keeps."""

    replica: ReplicaState
    routed: RoutedRequest
    hit_tokens: int
    uncached: int
    load: int
    queued: int
    prefilled: bool = False


class GatewayRouter:
    """`simulator.des.Router` that routes exactly as `gateway.pipeline` does.

    - route: hash the prompt (token ids with `hash_tokens`, or chat text rendered and hashed
      like `Pipeline.prompt_of` when the request carries a chat item), `match` in the index,
      `ReplicaState.view` per replica from the last scrape, `policy.choose`; then
      `dispatched(uncached)` on the winner (uncached = prompt - hit blocks x tokens per block).
    - first token: `prefilled(uncached)`, and the index records the chain on that replica.
    - finish: `observe_ttft`, `Outcome` to the policy (the replica's TTFT, the load and queued
      tokens of the view it was routed on), `finished()`.

    The DES cannot hold a request back, so when every replica is saturated (the gateway would
    queue it in admission) the request goes to the replica with the fewest in flight and is
    counted in `overflow`.
    """

    def __init__(
        self,
        policy: str | dict[str, Any],
        n_replicas: int,
        *,
        seed: int = 0,
        kv_tokens: int | None = None,
        label: str | None = None,
    ) -> None:
        ch = gateway_config(1, "round_robin").index.chunking
        self.chunker: Chunker = make_chunker(
            ch.mode, block_bytes=ch.block_bytes, tokenizer=ch.tokenizer, block_size=ch.block_size
        )
        self.render = render_chatml if ch.chat_template == "chatml" else render_chat
        # the pool's capacity_blocks: each replica's KV size in index blocks, as an operator
        # reads it off vllm:cache_config_info (None: the index's default per replica)
        capacity = None if kv_tokens is None else int(kv_tokens // self.chunker.tokens_per_block)
        cfg = gateway_config(n_replicas, policy, capacity)
        pc = cfg.pools[POOL]
        self.name = label or (policy if isinstance(policy, str) else "custom")
        self.now = 0.0
        self.index = MemoryIndex(cfg.index.capacity_blocks, cfg.index.ttl_s, clock=lambda: self.now)
        self.replicas = [ReplicaState.from_config(POOL, pc, rc) for rc in pc.replicas]
        for r in self.replicas:
            if r.capacity_blocks:
                self.index.set_capacity(r.name, r.capacity_blocks)
        self.names = [r.name for r in self.replicas]
        self.slot = {r.name: i for i, r in enumerate(self.replicas)}
        self.policy = build_policy(pc.policy, seed=seed)
        self.scope = scope_key(MODEL)
        self.scrape_interval_s = pc.scrape.interval_s
        self.pending: dict[str, _Dispatch] = {}
        self.reasons: dict[str, int] = {}
        self.overflow = 0

    def _scraped(self, view: Sequence[ReplicaLoad]) -> None:
        for load in view:
            r = self.replicas[load.index]
            if r.load is None or r.scraped_at != load.scraped_at_s:
                r.load = LoadSample(
                    waiting=load.waiting, running=load.running, kv_usage=load.kv_usage
                )
                r.scraped_at = load.scraped_at_s

    def _prompt(self, req: SimRequest) -> tuple[list[int], int]:
        """`Pipeline.prompt_of` + `hash_prompt`: no hashes when the policy ignores them."""
        item = req.meta.get("item")
        chunker = self.chunker
        needs = self.policy.needs_prefix
        if item is not None:  # a chat request: what the gateway sees is text
            text = self.render(item.messages)
            hashes = chunker.hash_text(self.scope, text) if needs else []
            return hashes, chunker.estimate_tokens(text)
        tokens = req.prompt_tokens
        return (chunker.hash_tokens(self.scope, _as_u32(tokens)) if needs else []), len(tokens)

    def route(self, req: SimRequest, view: Sequence[ReplicaLoad]) -> int:
        now = self.now = req.arrival_s
        self._scraped(view)
        hashes, n_tokens = self._prompt(req)
        session = req.meta.get("session")
        routed = RoutedRequest(
            req.id,
            MODEL,
            self.scope,
            POOL,
            n_tokens,
            hashes,
            self.chunker.tokens_per_block,
            max_tokens=req.max_tokens,
            session_key=session,
        )
        hits = self.index.match_now(self.scope, hashes, self.names) if hashes else {}
        views = [r.view(hits.get(r.name, 0), now) for r in self.replicas]
        decision = self.policy.choose(routed, views)
        name = decision.replica
        if name is None:
            self.overflow += 1
            name = min(self.replicas, key=lambda r: (r.inflight, self.slot[r.name])).name
            reason = "overflow"
        else:
            reason = decision.reason
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        i = self.slot[name]
        v = views[i]
        hit = min(n_tokens, int(v.hit_blocks * routed.tokens_per_block))
        replica = self.replicas[i]
        replica.dispatched(n_tokens - hit)
        self.pending[req.id] = _Dispatch(
            replica, routed, hit, n_tokens - hit, v.load, v.inflight_prompt_tokens
        )
        return i

    def on_first_token(self, req: SimRequest, replica: int, t: float) -> None:
        self.now = t
        d = self.pending[req.id]
        if not d.prefilled:
            d.prefilled = True
            d.replica.prefilled(d.uncached)
            if d.routed.block_hashes:
                self.index.record_now(self.scope, d.replica.name, d.routed.block_hashes)

    def on_finish(self, req: SimRequest, replica: int, record: Any) -> None:
        self.now = record.finish_s
        d = self.pending.pop(req.id)
        ttft = record.first_token_s - record.arrival_s
        d.replica.succeeded()
        d.replica.observe_ttft(ttft)
        self.policy.observe(
            Outcome(
                d.replica.name,
                d.routed.prompt_tokens,
                d.hit_tokens,
                d.load,
                d.queued,
                ttft,
                ok=True,
                session_key=d.routed.session_key,
            )
        )
        if not d.prefilled:  # the gateway's `done()` releases the prefill count too
            d.prefilled = True
            d.replica.prefilled(d.uncached)
        d.replica.finished()


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


def _gateway(policy: str) -> RouterVariant:
    return RouterVariant(
        policy,
        lambda c, seed: GatewayRouter(policy, len(c.engines), seed=seed, kv_tokens=_kv_tokens(c)),
    )


BASELINES = ("round_robin", "least_loaded")
CANDIDATES = ("prefix_aware", "ttft", "cost_blocks", "sticky", "sglang_cache_aware")
ROUTERS: dict[str, RouterVariant] = {
    **{p: _gateway(p) for p in (*BASELINES, *CANDIDATES)},
    "clairvoyant": RouterVariant("clairvoyant", lambda c, seed: Clairvoyant(c), reference=True),
}
DEFAULT_ROUTERS = (*BASELINES, *CANDIDATES, "clairvoyant")
GATEWAY_DEFAULT = DEFAULT_POLICY


class PreciseGatewayRouter(GatewayRouter):
    """`GatewayRouter` in precise mode: the index also learns what each engine really stored and
    evicted, from the engines' KV events, through the gateway's own `KvEventApplier`.

    As with `index.events.enabled` in the gateway, requests hash their token ids (the blocks
    line up with the engine's), routed entries live `routed_ttl_s`, and `match` answers the
    better of routed and engine-reported per replica.
    """

    def __init__(
        self, policy: str, cluster: Cluster, *, seed: int = 0, routed_ttl_s: float = 10.0
    ) -> None:
        super().__init__(
            policy,
            len(cluster.engines),
            seed=seed,
            kv_tokens=_kv_tokens(cluster),
            label=f"{policy}+precise",
        )
        self.index = MemoryIndex(
            self.index._default_capacity, None, clock=lambda: self.now, routed_ttl_s=routed_ttl_s  # noqa: SLF001
        )
        for r in self.replicas:
            if r.capacity_blocks:
                self.index.set_capacity(r.name, r.capacity_blocks)
            self.index.set_precise(r.name)
        self.engines = cluster.engines
        for e in self.engines:
            e.cache.events = []  # the engines record KV events as a publisher would send them
        self.appliers = [
            KvEventApplier(self.index, self.chunker, lambda lora: self.scope, n) for n in self.names
        ]
        self.block_size = cluster.config.block_size

    def _prompt(self, req: SimRequest) -> tuple[list[int], int]:
        tokens = req.prompt_tokens  # tokens mode: the ids the engine prefills
        return self.chunker.hash_tokens(self.scope, _as_u32(tokens)), len(tokens)

    async def route(self, req: SimRequest, view: Sequence[ReplicaLoad]) -> int:  # type: ignore[override]
        self.now = req.arrival_s
        for engine, applier in zip(self.engines, self.appliers, strict=True):
            raw = engine.cache.events
            if raw:
                engine.cache.events = []
                await applier.apply(EventBatch(self.now, [self._event(e) for e in raw]))
        return super().route(req, view)

    def _event(self, e: tuple[Any, ...]) -> Any:
        if e[0] == "stored":
            _, hashes, parent, token_ids = e
            return BlockStored(list(hashes), parent, list(token_ids), self.block_size)
        if e[0] == "removed":
            return BlockRemoved([e[1]])
        return AllBlocksCleared()


def _precise(policy: str) -> RouterVariant:
    return RouterVariant(
        f"{policy}+precise", lambda c, seed: PreciseGatewayRouter(policy, c, seed=seed)
    )


ROUTERS.update({f"{p}+precise": _precise(p) for p in (DEFAULT_POLICY, "prefix_aware")})
