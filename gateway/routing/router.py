"""The routing unit, two verbs: `route(request, pool) -> Routing` (hash the prompt, match the
index) and `choose(pool, routing) -> Decision` (recheck, views, policy). Then `dispatch` counts
the choice.

The pipeline, the forwarders and every benchmark drive this one object; it decides, it does
not send. What a decision depends on enters it as an input, never as an edit afterwards: the
replica holding a `/v1/responses` follow-up's state (`RouteInput.home`, ranked first by the
policy), the managed LoRA offer (`choose(..., offer)`: a `LoraOffer`, the adapters each replica
may load for this request, made by gateway/forwarding/lora_placement.py), and a
disaggregated pool's pair (the prefill replica by the pool's policy, the decode replica by
`policies.pd_decode.rank_decode`: a `PdDecision`). A `Dispatch` counts the choice on its replica
at once (in-flight load and the prompt's blocks in the index) and feeds the outcome back to the
replica's state, the policy and the index.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import orjson

from gateway.api.kinds import KINDS, PromptOf
from gateway.api.openai import ParsedRequest
from gateway.errors import NoReplicaAvailable, NotFound
from gateway.fleet.lora import unserved
from policies.pd_decode import rank_decode
from policies.types import Decision, Outcome, ReplicaView, RoutedRequest
from prefix_index.chunking import scope_key

if TYPE_CHECKING:
    from gateway.fleet.pools import Pool
    from gateway.fleet.replicas import ReplicaState
    from prefix_index.base import PrefixIndex
    from prefix_index.chunking import Chunker


COLD_KEY_BLOCKS = 64  # a new prefix's key: the chain hash of its first 64 blocks (or fewer)


class Routing:
    """What the router holds for one request between hashing and dispatch (a disaggregated
    pool's: its prefill set's, with the decode set's in `decode` once chosen)."""

    __slots__ = (
        "routed", "prompt", "hits", "epoch", "decision", "views", "hash_ns", "match_ns", "choose_ns",
        "tiers", "decode",
    )  # fmt: skip

    def __init__(self, routed: RoutedRequest, prompt: str | Sequence[int], hash_ns: int) -> None:
        self.routed = routed
        self.prompt = prompt
        self.hits: dict[str, int] = {}
        self.tiers: dict[str, dict[str, int]] = {}  # lower-tier blocks after the GPU hits
        self.epoch = -1  # the pool's dispatch count when the index answered
        self.decision: Decision | None = None
        self.views: list[ReplicaView] = []
        self.hash_ns = hash_ns
        self.match_ns = 0
        self.choose_ns = 0
        self.decode: Routing | None = None  # a disaggregated pool's decode set's routing


@dataclass(slots=True)
class PdDecision(Decision):
    """A disaggregated pool's decision: the prefill policy's, with the decode picker's beside
    it (both in explain(): the decision header and /debug/decisions)."""

    decode: Decision | None = None

    def explain(self) -> dict[str, object]:
        out = dict(Decision.explain(self))
        out["prefill_replica"] = self.replica
        if self.decode is not None:
            out["decode"] = dict(self.decode.explain())
            out["decode_replica"] = self.decode.replica
        return out


def decision_header(routing: Routing) -> tuple[bytes, bytes]:
    """`x-gateway-decision`: the decision's explanation (every candidate's scores, the reason)."""
    assert routing.decision is not None
    return b"x-gateway-decision", orjson.dumps(routing.decision.explain())


_NO_ADAPTERS: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class LoraOffer:
    """Managed LoRA placement's offer for one request (gateway/forwarding/lora_placement.py's
    `LoraPlacement.offer`): every adapter the pool's placement manages, and by replica name the
    ones it may load there for this request (a replica not named may load none). An input of
    `Router.choose`, which the policy reads as its views' `loadable`."""

    managed: frozenset[str]
    loadable: Mapping[str, frozenset[str]]

    def apply(self, pool: Pool) -> None:
        for r in pool.replicas:
            r.lora.set_loadable(self.loadable.get(r.name, _NO_ADAPTERS), self.managed)


@dataclass(slots=True)
class RouteInput:
    """The parts of a request routing reads, besides its parsed body."""

    request_id: str
    tenant: str = "anonymous"
    priority: str = "interactive"
    session_key: str | None = None
    tenant_salt: str | None = None  # the tenant's cache salt (config), joined to the client's
    home: str | None = None  # the replica holding the state this request continues (responses)


def cache_salt(req: ParsedRequest, tenant_salt: str | None) -> str | None:
    """The `cache_salt` the engine gets (and the scope uses): the tenant's, then the client's."""
    salt = req.body.get("cache_salt")
    client = salt if isinstance(salt, str) and salt else None
    if tenant_salt is None:
        return client
    return tenant_salt if client is None else f"{tenant_salt}/{client}"


class Prompt(NamedTuple):
    """The prompt as the engine sees it (text or ids), its estimated tokens, and the ns the
    rendering took (counted in the hash stage)."""

    text: str | Sequence[int]
    tokens: int
    render_ns: int


class Router:
    """Hash and match (`route`), then choose (`choose`), each timed; `dispatch` counts a pick.

    One router per snapshot: its chunker and index are the snapshot's (a reload or the
    tokens-mode fallback makes a new snapshot, and so a new router).
    """

    __slots__ = ("chunker", "index")

    def __init__(self, chunker: Chunker, index: PrefixIndex | None) -> None:
        self.chunker = chunker
        self.index = index

    def prompt(self, req: ParsedRequest, of: PromptOf | None = None) -> Prompt:
        """What of `req` is hashed and its estimated tokens, by its kind's `prompt` (`of`, else
        the row of `req.kind` in the kinds table): "" when the kind routes by load alone."""
        t0 = time.perf_counter_ns()
        text, tokens = (of or KINDS[req.kind].prompt)(req, self.chunker)
        return Prompt(text, tokens, time.perf_counter_ns() - t0)

    # --- route: hash + match ---------------------------------------------------------------
    async def route(
        self, req: ParsedRequest, pool: Pool, prompt: Prompt, inp: RouteInput
    ) -> Routing:
        """Which replicas of `pool` hold how much of the prompt (a disaggregated pool: its
        prefill set's), asked outside admission so that a Redis round trip queues no one. A 503
        when no replica is available, a 404 for a LoRA adapter no replica serves."""
        target = pool.pd.prefill if pool.pd is not None else pool
        if not target.any_available():
            raise NoReplicaAvailable(
                f"No replica of pool '{pool.name}' is available (all circuits open)",
                retry_after=pool.config.health.interval_s,
            )
        if req.model and unserved((r.lora for r in target.replicas), req.model):
            raise NotFound(  # a LoRA pool, and no replica lists this adapter (docs/lora.md)
                f"The model `{req.model[:64]}` does not exist: no replica of pool "
                f"'{pool.name}' serves it.", param="model", code="model_not_found",
            )  # fmt: skip
        routing = self.prepare(req, target, inp, prompt)
        await self.match(target, routing)
        return routing

    def prepare(
        self,
        req: ParsedRequest,
        pool: Pool,
        inp: RouteInput,
        prompt: Prompt,
    ) -> Routing:
        """Scope and block hashes of `prompt` (none when the pool's policy ignores them)."""
        t0 = time.perf_counter_ns()
        text, tokens, render_ns = prompt
        chunker = self.chunker
        scope = scope_key(req.model, salt=cache_salt(req, inp.tenant_salt))
        hashes: list[int] = []
        if pool.policy.needs_prefix:
            hashes = (
                chunker.hash_text(scope, text)
                if isinstance(text, str)
                else chunker.hash_tokens(scope, text)
            )
        routed = RoutedRequest(
            request_id=inp.request_id,
            model=req.model,
            scope=scope,
            pool=pool.name,
            prompt_tokens=tokens,
            block_hashes=hashes,
            tokens_per_block=chunker.tokens_per_block,
            max_tokens=req.max_tokens,
            session_key=inp.session_key if inp.session_key is not None else req.user,
            priority=inp.priority,
            tenant=inp.tenant,
            adapter=bool(req.model) and any(r.lora.is_adapter(req.model) for r in pool.replicas),
            home=inp.home,
        )
        return Routing(routed, text, render_ns + time.perf_counter_ns() - t0)

    async def match(self, pool: Pool, routing: Routing) -> None:
        """Ask the index which replica holds the longest run of the chain (outside admission)."""
        t0 = time.perf_counter_ns()
        index = self.index
        routed = routing.routed
        routing.epoch = pool.dispatches
        if routed.block_hashes and index is not None:
            routing.hits = await index.match(
                routed.scope, routed.block_hashes, [r.name for r in pool.replicas]
            )
        routing.match_ns = time.perf_counter_ns() - t0

    # --- choose ----------------------------------------------------------------------------
    def choose(
        self, pool: Pool, routing: Routing, offer: LoraOffer | None = None, now: float | None = None
    ) -> Decision:
        """The policy's ranking of the pool's replicas as they are now (`offer`: managed LoRA
        placement's, shown to the policy in the views); a disaggregated pool's pair (`PdDecision`, the decode set's
        routing in `routing.decode`). A decision with no replica is still returned (it is
        recorded); `dispatch_decision` refuses it."""
        if pool.pd is None:
            if offer is not None:
                offer.apply(pool)
            return self._choose(pool, routing, now)
        return self._choose_pair(pool, routing, now)

    def _choose(self, pool: Pool, routing: Routing, now: float | None = None) -> Decision:
        t0 = time.perf_counter_ns()
        now = time.monotonic() if now is None else now
        hits = routing.hits
        if routing.epoch != pool.dispatches:  # others were dispatched since the match
            hits = routing.hits = self._recheck(pool, routing)
        get = hits.get
        routing.views = [r.view(get(r.name, 0), now) for r in pool.replicas]
        hashes, prompt = routing.routed.block_hashes, routing.routed.prompt_tokens
        if hashes:  # the prefix the requests in flight there hold needs no KV of its own
            tpb = routing.routed.tokens_per_block
            for r, v in zip(pool.replicas, routing.views, strict=True):
                kv = v.kv_tokens
                if kv is not None and v.inflight_kv_tokens + prompt > kv and r.kv_blocks:
                    v.kv_shared_tokens = min(prompt, int(r.kv_held(hashes) * tpb))
        tiers = None if self.index is None else self.index.match_tiers  # docs/tiers.md
        if tiers is not None and routing.routed.block_hashes:
            routing.tiers = tiers(routing.routed.scope, routing.routed.block_hashes, hits)
            for v in routing.views:
                v.tier_hits = routing.tiers.get(v.name)
        decision = routing.decision = pool.policy.choose(routing.routed, routing.views)
        routing.choose_ns = time.perf_counter_ns() - t0
        return decision

    def _choose_pair(self, pool: Pool, routing: Routing, now: float | None) -> PdDecision:
        """The prefill replica by the pool's policy (prefix hit + prefill queue, over the
        prefill set), the decode replica by `rank_decode` (decode batch, KV headroom from the
        engine's `cache_config_info` and the scraped usage)."""
        assert pool.pd is not None
        pdec = self._choose(pool.pd.prefill, routing, now)
        decode = pool.pd.decode
        # vLLM's decode side keeps the pulled blocks in its prefix cache (it pulls only what it
        # lacks, §1.2): the index records them there too; SGLang's is not known to, so it does not
        keep = pool.pd.protocol == "vllm-nixl"
        routed = routing.routed if keep else dataclasses.replace(routing.routed, block_hashes=())
        droute = routing.decode = Routing(routed, routing.prompt, 0)
        now = time.monotonic() if now is None else now
        droute.views = [r.view(0, now) for r in decode.replicas]
        kv = {r.name: (r.engine_kv[1] if r.engine_kv else None) for r in decode.replicas}
        ddec = droute.decision = rank_decode(routed, droute.views, kv)
        both = PdDecision(
            pdec.ranked, pdec.reason, pdec.policy, pdec.scores, pdec.totals,
            {**pdec.filtered, **ddec.filtered}, pdec.predicted_hit_blocks, decode=ddec,
        )  # fmt: skip
        routing.decision = both
        return both

    def _recheck(self, pool: Pool, routing: Routing) -> dict[str, int]:
        """The match again from what this process knows without a round trip (the memory index,
        or the Redis backend's local view of this gateway's own writes), merged with the first
        answer: a request that waited in admission behind a burst on its prefix sees the burst."""
        routed, index = routing.routed, self.index
        if not routed.block_hashes or index is None:
            return routing.hits
        fresh = index.match_local(routed.scope, routed.block_hashes, [r.name for r in pool.replicas])
        if fresh is None:
            return routing.hits
        old = routing.hits
        return {name: max(n, old.get(name, 0)) for name, n in fresh.items()}

    # --- dispatch --------------------------------------------------------------------------
    async def dispatch_decision(self, pool: Pool, routing: Routing) -> Dispatched:
        """Count the decision's pick (a disaggregated pool's: its prefill and its decode
        replica): a 503 when the decision has none."""
        decision = routing.decision
        assert decision is not None
        pd = pool.pd
        droute = routing.decode
        dname = None
        if pd is not None and droute is not None and isinstance(decision, PdDecision):
            dname = decision.decode.replica if decision.decode is not None else None
        if decision.replica is None or (pd is not None and dname is None):
            why = "; ".join(sorted(set(decision.filtered.values())))
            if pd is None:
                raise NoReplicaAvailable(
                    f"No replica of pool '{pool.name}' can take the request now "
                    f"({why or 'the pool has no replicas'})",
                    retry_after=pool.config.health.interval_s,
                )
            role = "prefill" if decision.replica is None else "decode"
            raise NoReplicaAvailable(
                f"No {role} replica of pool '{pool.name}' can take the request now "
                f"({why or 'a set has no replicas'})",
                retry_after=pool.config.health.interval_s,
            )
        if pd is None:
            return await self.dispatch(pool, routing, decision.replica)
        assert droute is not None and dname is not None
        p = await self.dispatch(pd.prefill, routing, decision.replica)
        d = await self.dispatch(pd.decode, droute, dname)
        return PdDispatch(p, d, droute)

    async def dispatch(self, pool: Pool, routing: Routing, name: str) -> Dispatch:
        """Count a dispatch of the request to replica `name` (the pick, or a failover): its
        in-flight load, and its chain in the index (the memory index and the Redis backend's
        local view take it before this returns, so the next request of a burst sees it)."""
        view = next(v for v in routing.views if v.name == name)
        pool.dispatches += 1
        d = Dispatch(self.index, pool, pool.by_name[name], view, routing.routed)
        await d.record()
        return d


class Dispatch:
    """One dispatch to one replica: counted at once, its outcome fed back exactly once.

    At dispatch the replica's in-flight counts grow and the index records the prompt's chain
    for it, so a burst on a new prefix sticks to the replica that will hold it. The blocks the
    replica was not known to hold are unconfirmed until the attempt succeeds: a failed attempt
    removes them again.
    """

    __slots__ = (
        "index", "pool", "replica", "view", "routed", "hit_tokens", "uncached", "queued", "cold", "rides",
        "_prefilled", "_done", "_settled", "_unrecords", "adapter_load", "kv_chain",
    )  # fmt: skip

    def __init__(
        self,
        index: PrefixIndex | None,
        pool: Pool,
        replica: ReplicaState,
        view: ReplicaView,
        routed: RoutedRequest,
    ) -> None:
        self.index, self.pool, self.replica, self.view, self.routed = (
            index, pool, replica, view, routed,
        )  # fmt: skip
        hit = min(routed.prompt_tokens, int(view.hit_blocks * routed.tokens_per_block))
        self.hit_tokens, self.uncached = hit, routed.prompt_tokens - hit
        # the prefill it queues there: what the replica recomputes. Tokens it holds on a lower
        # tier are loaded, not recomputed (tens of ms, docs/tiers.md); counted as queued prefill
        # they taught the ttft scorer that a queued token costs next to nothing on a replica that
        # served tier hits, and it piled requests onto that replica (issue 42)
        tiers = self.tier_tokens()
        self.queued = self.uncached - (sum(tiers.values()) if tiers else 0)
        self._prefilled = self._done = self._settled = False
        self._unrecords = replica.unrecords
        # a new prefix for this replica: keyed by the chain's first COLD_KEY_BLOCKS blocks, so
        # that a peer gateway placing the same prefix here at the same moment (both decided
        # before either's blocks reached the shared index) is counted once across the fleet
        hashes = routed.block_hashes
        new_prefix = bool(hashes) and not view.hit_blocks
        key = hashes[min(len(hashes), COLD_KEY_BLOCKS) - 1] if hashes else None
        self.cold = key if new_prefix else None
        # its hit is a prefix placed here and not yet prefilled: it waits for the rest of that
        # prefill, which the queued count overstates (issue 42), so its TTFT teaches nothing
        self.rides = not new_prefix and key is not None and key in replica.cold
        # the KV it holds there until it ends, a prefix that requests in flight there hold
        # counted once (by its chain), where the engine reports its KV size (issue 42)
        self.kv_chain = hashes if view.kv_tokens is not None else ()
        replica.dispatched(self.queued, max(0, routed.n_blocks - view.hit_blocks), self.cold,
                           routed.prompt_tokens, self.kv_chain, routed.tokens_per_block)  # fmt: skip
        # a LoRA adapter: counted in flight there; None for a model that is no adapter of it
        lora = replica.lora
        self.adapter_load = lora.dispatched(routed.model) if lora.is_adapter(routed.model) else None

    async def record(self) -> None:
        """The replica will hold the prompt's blocks: count them in the index now, without
        waiting for a remote backend (its local view and the memory index have them at once)."""
        routed, index = self.routed, self.index
        if index is None or not routed.block_hashes:
            return
        if not index.record_nowait(routed.scope, self.replica.name, routed.block_hashes):
            await index.record(routed.scope, self.replica.name, routed.block_hashes)

    def prefilled(self) -> None:
        """The first token arrived: the prompt is no longer queued prefill work."""
        if not self._prefilled:
            self._prefilled = True
            self.replica.prefilled(self.queued, self.cold)

    async def failed(self, why: str, busy: bool = False) -> None:
        """The attempt failed before an answer: the replica's breaker counts it (unless it timed
        out, `busy`, on a replica still heard from: `ReplicaState.failed`) and the blocks
        recorded at dispatch that it did not hold before go again."""
        if self._settled:
            return
        self._settled = True
        self.replica.failed(why, busy)
        await self._unrecord()

    async def finished(
        self,
        ok: bool,
        served: bool,
        ttft_s: float | None,
        why: str = "",
        cached_tokens: int | None = None,
    ) -> None:
        """The answer ended. `ok`: the replica behaved (its breaker counts a success); `served`:
        it answered 200, so it holds the prompt's blocks (else they leave the index).
        `cached_tokens`: the prefix hit it reported (None: it did not say); a served answer
        with one feeds the pool's by-tier audit of what was predicted (docs/tiers.md)."""
        if self._settled:
            return
        self._settled = True
        replica = self.replica
        if ok:
            replica.succeeded()
        else:
            replica.failed(why or "upstream error")
        if not served:
            await self._unrecord()
        elif replica.unrecords != self._unrecords:  # a failed sibling took our blocks out
            await self.record()
        if ttft_s is not None:
            replica.observe_ttft(ttft_s)
        v, tiers = self.view, self.tier_tokens()
        outcome = Outcome(
            replica.name,
            self.routed.prompt_tokens,
            self.hit_tokens,
            v.load,
            v.inflight_prompt_tokens,
            ttft_s,
            ok=ok,
            session_key=self.routed.session_key,
            adapter_load=self.adapter_load,
            tier_tokens=tiers,
            cached_tokens=cached_tokens,
            tokens_per_block=self.routed.tokens_per_block,
            kv_waits=v.kv_waits(self.routed.prompt_tokens),
            rides=self.rides,
        )
        self.pool.policy.observe(outcome)
        cached = outcome.credited_cached_tokens()
        if served and cached is not None and (self.hit_tokens or tiers):
            self.pool.audit.observe(self.hit_tokens, tiers, cached)

    def receipt_inputs(self) -> tuple[int | None, int | None]:
        """For the route receipt, once this dispatch answered: its predicted hit (None: the
        pool's policy does not hash) and the engine's KV block as it last reported it."""
        kv = self.replica.engine_kv
        return self.hit_tokens if self.pool.policy.needs_prefix else None, kv[0] if kv else None

    async def abandoned(self) -> None:
        """The request does not go to this replica after all (managed placement could not load
        its adapter there): the blocks recorded at dispatch go again, the adapter's placement is
        taken back, and neither the replica's breaker nor the policy hears of it. `done` still
        releases the in-flight count."""
        if self._settled:
            return
        self._settled = True
        if self.adapter_load is not None:
            self.replica.lora.unplaced(self.routed.model)
        await self._unrecord()

    def tier_tokens(self) -> dict[str, int] | None:
        """Tokens this dispatch expects to load per lower tier (the view's `tier_hits`)."""
        tiers = self.view.tier_hits
        if not tiers:
            return None
        tpb, left = self.routed.tokens_per_block, self.uncached
        out: dict[str, int] = {}
        for tier, blocks in tiers.items():
            out[tier] = min(left, int(blocks * tpb))
            left -= out[tier]
        return out

    def done(self) -> None:
        """Release the in-flight count (always, exactly once)."""
        if not self._done:
            self._done = True
            self.prefilled()
            self.replica.finished(self.routed.prompt_tokens, self.kv_chain,
                                  self.routed.tokens_per_block)  # fmt: skip
            if self.adapter_load is not None:
                self.replica.lora.finished(self.routed.model)

    async def _unrecord(self) -> None:
        routed, known = self.routed, self.view.hit_blocks
        if self.index is not None and len(routed.block_hashes) > known:
            self.replica.unrecords += 1
            await self.index.evict(routed.scope, self.replica.name, routed.block_hashes[known:])


@dataclass(slots=True)
class PdDispatch:
    """A disaggregated pool's first pair: the prefill and the decode dispatch, and the decode
    set's routing (its failover candidates)."""

    prefill: Dispatch
    decode: Dispatch
    droute: Routing


Dispatched = Dispatch | PdDispatch
