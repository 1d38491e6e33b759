"""The routing vocabulary: what a policy is asked (RoutedRequest, ReplicaView), what it answers.

The gateway fills these in; policies never import from the gateway.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class RoutedRequest:
    """One request as the router sees it, after parsing and hashing."""

    request_id: str
    model: str
    scope: str  # keeps models / LoRA adapters / cache salts apart in the index
    pool: str
    prompt_tokens: int  # estimate before routing
    block_hashes: Sequence[int]  # chained prefix hashes, full blocks only
    tokens_per_block: float  # converts blocks to (estimated) tokens
    max_tokens: int | None = None
    session_key: str | None = None  # stickiness key (header or `user`), when the client sent one
    priority: str = "interactive"
    tenant: str = "anonymous"
    # the model is a LoRA adapter some replica of the pool serves (or the gateway places): a
    # replica that lists no adapters cannot serve it (vLLM answers 404)
    adapter: bool = False
    # the replica holding state this request continues (a /v1/responses follow-up of a response
    # it made): first when it survives the filters (reason `previous_response`)
    home: str | None = None

    @property
    def n_blocks(self) -> int:
        return len(self.block_hashes)


@dataclass(frozen=True, slots=True)
class LoraView:
    """What the gateway knows of one replica's LoRA adapters (gateway/fleet/lora.py; docs/lora.md).

    `served`: adapters it can serve now (its `/v1/models` cards with a `parent`). `loadable`:
    adapters the gateway may load on it for this request (managed placement, within the
    bound on replicas per adapter; empty otherwise); `managed`: every adapter it places.
    `resident`: adapters believed on its GPU, least recently used first (those with requests in
    flight, per `vllm:lora_requests_info` and the gateway's own counts, then the ones it used
    last). `inflight`: requests in flight per adapter (the gateway's own, or the metric's 1 when
    only the metric names one). `max_loras`: its GPU adapter slots (the metric's `max_lora`).
    """

    served: frozenset[str] = frozenset()
    base: frozenset[str] = frozenset()  # its base models (cards without a parent)
    max_loras: int = 1
    resident: tuple[str, ...] = ()
    inflight: Mapping[str, int] = field(default_factory=dict)
    loadable: frozenset[str] = frozenset()
    # the share of this replica's recent requests each resident adapter had (decayed): what
    # evicting it would cost in reloads
    demand: Mapping[str, float] = field(default_factory=dict)
    managed: frozenset[str] = frozenset()  # adapters the gateway places (managed placement)

    def can_serve(self, adapter: str) -> bool:
        return adapter in self.served or adapter in self.loadable


@dataclass(slots=True)
class ReplicaView:
    """A snapshot of one replica, taken when the request is routed; plugins only read it.

    Not frozen on purpose: the gateway builds one per replica per request, and a frozen
    dataclass's __init__ costs several times more.

    `waiting`, `running` and `kv_usage` come from the last `/metrics` scrape and are None when
    unknown (never scraped, or the scrape is too old): unknown is not idle. `inflight`,
    `inflight_prompt_tokens` and `placed_blocks` are the gateway's counts, fresher than any
    scrape: every dispatch counts at once. When gateways share their load (`fleet:`) they are
    this gateway's own plus the other gateways' as of their last tick.
    """

    name: str
    url: str = ""
    pool: str = ""
    healthy: bool = True
    circuit: str = "closed"  # closed | open | half_open
    draining: bool = False
    models: frozenset[str] = frozenset()  # empty: serves whatever the pool serves
    inflight: int = 0
    inflight_prompt_tokens: int = 0  # uncached prompt tokens sent, not yet prefilled
    max_inflight: int = 64
    waiting: int | None = None
    running: int | None = None
    kv_usage: float | None = None  # 0..1
    hit_blocks: int = 0  # leading blocks of this request's chain the index says it holds
    ttft_ewma_s: float | None = None  # recent observed TTFT
    placed_blocks: int = 0  # blocks new to this replica the gateway has routed to it, ever
    lora: LoraView | None = None  # None: the replica reports no LoRA adapters
    # blocks after `hit_blocks` its lower KV tiers hold, by tier ("cpu", "disk", "shared"):
    # loadable instead of recomputed (docs/tiers.md); None: no tier knowledge
    tier_hits: Mapping[str, int] | None = None
    # what its engine measured of its loads from each lower tier (gateway/fleet/tier_load.py): tier ->
    # (seconds per byte, seconds per token), one of them 0; n tokens load in
    # n x (kv_bytes_per_token x first + second) seconds. vLLM's transfer counters give seconds
    # per byte, LMCache's store seconds per token. None: the engine reports no such load
    tier_load_rates: Mapping[str, tuple[float, float]] | None = None
    # the engine's KV in tokens (its cache_config_info; None: not reported), and the prompt
    # tokens of the requests the gateway has in flight there: the KV they hold until they end
    kv_tokens: int | None = None
    inflight_kv_tokens: int = 0
    # the leading tokens of this request's prompt whose KV the requests in flight here already
    # hold (a shared prefix is held once: it needs no room of its own); set by the router
    kv_shared_tokens: int = 0

    def kv_waits(self, prompt_tokens: int) -> int:
        """How many of the requests in flight here must end before a prompt of `prompt_tokens`
        fits beside the rest in the engine's KV (each taken to hold their mean share): 0 when
        it fits, or the KV size is not known. An engine admits a request only when its KV has
        room for it, so where long prompts fill the KV a new one waits for those ahead to
        finish, decode included, whatever its prefix hit."""
        kv, held, n = self.kv_tokens, self.inflight_kv_tokens, self.inflight
        need = prompt_tokens - self.kv_shared_tokens
        if kv is None or n <= 0 or held + need <= kv:
            return 0
        over = held + need - kv
        return min(n, -(-over * n // held)) if held > 0 else 0

    @property
    def load(self) -> int:
        """Requests ahead of a new one: the scraped queue when fresher, else the gateway's count."""
        scraped = (self.waiting or 0) + (self.running or 0)
        inflight = self.inflight
        return inflight if inflight >= scraped else scraped  # max() without the call: hot path


@dataclass(frozen=True, slots=True)
class Outcome:
    """What happened to a routed request; fed back to plugins that learn (e.g. the TTFT scorer)."""

    replica: str
    prompt_tokens: int
    predicted_hit_tokens: int
    load_at_dispatch: int
    queued_prompt_tokens_at_dispatch: int
    ttft_s: float | None
    ok: bool = True
    session_key: str | None = None  # the request's session_key, so affinity follows failover
    adapter_load: bool | None = None  # a LoRA adapter had to be loaded for it (None: no adapter)
    tier_tokens: Mapping[str, int] | None = None  # predicted tokens to load per lower tier
    # the prefix tokens the replica reported served from cache (usage.prompt_tokens_details;
    # P/D: the prefill leg's); None: it did not say
    cached_tokens: int | None = None
    tokens_per_block: float = 0.0  # the request's block in tokens (0: unknown)
    kv_waits: int = 0  # requests in flight that had to end before it fit (ReplicaView.kv_waits)
    # its prefix hit was a prefix placed there and not yet prefilled (it waited for the rest of
    # that prefill, not for the whole queue counted at dispatch)
    rides: bool = False

    def credited_cached_tokens(self) -> int | None:
        """`cached_tokens`, plus the part of the prediction an engine never reports as cached:
        the block that holds the prompt's last token (vLLM recomputes it for its logits), so a
        prompt that hit in full is not read as a miss of one block. None: not reported."""
        cached = self.cached_tokens
        if cached is None:
            return None
        predicted = self.predicted_hit_tokens + sum((self.tier_tokens or {}).values())
        tpb = self.tokens_per_block
        reportable = (self.prompt_tokens - 1) // tpb * tpb if tpb > 0 else self.prompt_tokens
        return cached + max(0, predicted - max(0, int(reportable)))

    def served_in_full(self) -> bool:
        """The replica reported serving every predicted prefix token (GPU hit and lower tiers);
        False when it fell short or did not say."""
        cached = self.credited_cached_tokens()
        predicted = self.predicted_hit_tokens + sum((self.tier_tokens or {}).values())
        return cached is not None and cached >= predicted


@dataclass(slots=True)
class Decision:
    """The policy's answer: replicas in order of preference (first is the pick) and why."""

    ranked: list[str]
    reason: str
    policy: str
    scores: dict[str, dict[str, float]] = field(default_factory=dict)  # replica -> scorer -> [0,1]
    totals: dict[str, float] = field(default_factory=dict)
    filtered: dict[str, str] = field(default_factory=dict)  # replica -> why it was removed
    predicted_hit_blocks: int = 0

    @property
    def replica(self) -> str | None:
        return self.ranked[0] if self.ranked else None

    def explain(self) -> Mapping[str, object]:
        return {
            "policy": self.policy,
            "reason": self.reason,
            "ranked": list(self.ranked),
            "scores": self.scores,
            "totals": self.totals,
            "filtered": self.filtered,
            "predicted_hit_blocks": self.predicted_hit_blocks,
        }
