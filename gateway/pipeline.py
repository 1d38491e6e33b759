"""The request path: `handle` is the steps, one call each, every one returning what it found.

parse → pick the pool → limit → route (hash + index match) → admit (queue, choose, dispatch) →
forward (fail over, relay) → `finish` (settle the limits, record metrics and the trace).
Everything a request reads comes from the one `Snapshot` it took when it arrived.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import orjson

from .errors import GatewayError, NoReplicaAvailable, NotFound
from .failover import Failover, Outbound
from .kinds import EndpointKind
from .lora import unserved
from .lora_placement import LoraPlacement
from .openai import ParsedRequest
from .pd import PD_KINDS, PdFlow
from .pools import Pool
from .proxy import with_stream_usage
from .ratelimit import Rule, costs_for, rate_limited
from .ratelimit import headers as ratelimit_headers
from .record import Record, Recorder
from .router import Dispatch, Prompt, RouteInput, Routing, cache_salt
from .snapshot import Snapshot
from .sticky import Homes
from .tenants import Tenant, requested_priority
from .types import Headers, Send

if TYPE_CHECKING:
    from .runtime import Gateway

RawHeaders = dict[bytes, bytes]


class Pipeline:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        self.failover = Failover(gateway)
        self.recorder = Recorder(gateway)
        self.homes = Homes(lambda: gateway.fleet)  # /v1/responses: which replica made each
        self.lora = LoraPlacement()  # managed LoRA placement (pools.<p>.lora.manage)
        self.lora.register(gateway.metrics.registry)
        self.pd = PdFlow(gateway, self.failover, self.recorder)  # disaggregated pools

    async def handle(
        self, snap: Snapshot, kind: EndpointKind, raw: bytes, headers: RawHeaders, tenant: Tenant,
        send: Send, rec: Record,
    ) -> None:  # fmt: skip
        """One request of `kind` on `snap`; `tenant` was identified by the endpoint before the body."""
        req = kind.parse(raw, headers.get(b"content-type"))
        asked = requested_priority(headers.get(b"x-priority"), req.body)
        rec.model, rec.stream = req.model, req.stream
        rec.priority = snap.tenants.priority_for(tenant, asked)
        prompt = snap.router.prompt(req, kind.prompt)
        pool = pick_pool(snap, req, prompt.tokens)
        rec.pool, rec.prompt_tokens = pool.name, prompt.tokens
        extra: Headers = [(b"x-request-id", rec.request_id.encode("latin-1"))]
        rec.charged, limit_headers = await self.limit(
            snap, tenant, req, prompt.tokens, pool if kind.generates else None
        )
        extra += limit_headers
        if pool.pd is not None:  # a disaggregated pool (gateway/pd.py)
            if kind.name in PD_KINDS:
                inp = route_input(rec, headers, tenant)
                return await self.pd.handle(
                    self, snap, pool, kind, req, prompt, inp, tenant, send, rec, extra,
                    explained(snap, headers),
                )  # fmt: skip
            pool = pool.pd.decode  # nothing to disaggregate (embeddings, tokenize): the decode set
        routing = await self.route(snap, pool, req, prompt, route_input(rec, headers, tenant), rec)
        home = None
        if kind.sticky:  # the replica holding the response this one continues, any gateway's
            home = await self.homes.home(req.body.get("previous_response_id"), pool)
        first = await self.admit(snap, pool, tenant, routing, rec, home)
        if pool.config.lora.manage:  # the adapter loaded on the pick (or the next) first
            first = await self.lora.place(
                self.gw.session, snap.router, pool, routing, first,
                snap.config.server.expose_upstream_errors,
                lambda: self.gw.notify_capacity(pool.name),  # a failed placement's slot is free
            )  # fmt: skip
        if explained(snap, headers):
            extra.append(decision_header(routing))
        body = upstream_body(snap, req, rec.priority, tenant.cache_salt, kind.fields)
        ctype = headers.get(b"content-type") if kind.client_content_type else None
        out = Outbound(
            snap.router, pool, req, routing, body, upstream_headers(pool, rec, ctype), extra,
            snap.config.server.expose_upstream_errors, snap.config.server.max_answer_bytes_in_flight,
            kind, self.learner(pool) if kind.sticky else None,
        )  # fmt: skip
        sent = await self.failover.forward(out, first, send, rec.sent)
        if sent.error is not None:
            raise sent.error

    def learner(self, pool: Pool) -> Callable[[str, str], Awaitable[None]]:
        """How a sticky answer's id is learned: its home (the replica that made it, in `pool`),
        for this gateway and the fleet."""

        async def learn(answer_id: str, replica: str) -> None:
            made = pool.by_name.get(replica)
            if made is not None:
                await self.homes.learn(answer_id, pool, made)

        return learn

    # --- the steps -------------------------------------------------------------------------------
    async def limit(
        self, snap: Snapshot, tenant: Tenant, req: ParsedRequest, tokens: int,
        generating: Pool | None = None,
    ) -> tuple[list[tuple[Rule, int]], Headers]:  # fmt: skip
        """Charge the tenant's buckets (requests, prompt estimate + max_tokens); 429 when empty.

        A request of a kind that generates (`generating`: its pool) and sets no max_tokens is
        charged a bound on its answer (`answer_bound`). A request that can never fit a bucket
        (max_tokens deeper than it) gets a 429 that says so. Returns what each token bucket
        gave (`finish` settles it on the answer's usage) and the `x-ratelimit-*` headers.
        """
        limiter = snap.limiter
        rules = tenant.rules(req.model) if limiter is not None else []
        if limiter is None or not rules:
            return [], []
        unset = 0
        if generating is not None and req.max_tokens is None:
            unset = answer_bound(generating, tokens)
        costs = costs_for(rules, tokens, req.max_tokens, unset)
        verdict = await limiter.acquire(tenant.name, rules, costs)
        if not verdict.allowed:
            for name in verdict.blocked:
                self.gw.metrics.limited.labels(tenant.name, name).inc()
            raise rate_limited(verdict, tenant.name, prompt_tokens=tokens, max_tokens=req.max_tokens)
        charged = [  # a degraded verdict (backend down) took nothing
            (r, 0 if verdict.degraded else int(c))
            for r, c in zip(rules, costs, strict=True)
            if r.unit == "tokens"
        ]
        return charged, ratelimit_headers(verdict)

    async def route(
        self, snap: Snapshot, pool: Pool, req: ParsedRequest, prompt: Prompt, inp: RouteInput,
        rec: Record,
    ) -> Routing:  # fmt: skip
        """Hash the prompt and ask the index, outside admission (a Redis round trip queues no one)."""
        if not pool.any_available():
            raise NoReplicaAvailable(
                f"No replica of pool '{pool.name}' is available (all circuits open)",
                retry_after=pool.config.health.interval_s,
            )
        if req.model and unserved((r.lora for r in pool.replicas), req.model):
            raise NotFound(  # a LoRA pool, and no replica lists this adapter (docs/lora.md)
                f"The model `{req.model[:64]}` does not exist: no replica of pool "
                f"'{pool.name}' serves it.", param="model", code="model_not_found",
            )  # fmt: skip
        rec.t_route = time.perf_counter_ns()
        routing = snap.router.prepare(req, pool, inp, prompt)
        await snap.router.match(pool, routing)
        rec.t_queue = time.perf_counter_ns()
        return routing

    async def admit(
        self, snap: Snapshot, pool: Pool, tenant: Tenant, routing: Routing, rec: Record,
        home: str | None = None,
    ) -> Dispatch:  # fmt: skip
        """Wait for a slot in the pool's admission queue, choose a replica, dispatch to it (before
        the next request is admitted, so that it sees this one's load and blocks). `home`: the
        replica holding the response this one continues, first while the policy keeps it."""
        slot = snap.admission.slot(pool.name, tenant.name, tenant.weight, rec.priority, pool.has_capacity)
        async with slot as waited:
            rec.t_admitted = time.perf_counter_ns()
            self.recorder.queue_wait(pool.name, rec.priority, waited)
            self.lora.offer(pool, routing.routed.model)
            decision = snap.router.choose(pool, routing)
            if home is not None and home in decision.ranked:
                decision.ranked.remove(home)
                decision.ranked.insert(0, home)
                decision.reason = "previous_response"
            rec.t_routed = time.perf_counter_ns()
            rec.routed(routing, decision)
            self.recorder.decision(pool, routing, decision)
            if decision.replica is None:
                why = "; ".join(sorted(set(decision.filtered.values()))) or "the pool has no replicas"
                raise NoReplicaAvailable(
                    f"No replica of pool '{pool.name}' can take the request now ({why})",
                    retry_after=pool.config.health.interval_s,
                )
            return await snap.router.dispatch(pool, routing, decision.replica)

    async def finish(self, snap: Snapshot, rec: Record, exc: GatewayError | None) -> None:
        """Settle the limits and record the request, whatever happened to it.

        Each token bucket is settled on the tokens used: it gets back at most what was charged,
        and nothing when the usage is unknown (a 200 without a usable `usage`).
        """
        if exc is not None:
            rec.failed(exc)
        used = rec.tokens_used()
        if rec.charged and snap.limiter is not None and used is not None:
            for rule, charged in rec.charged:
                if used != charged:
                    await snap.limiter.adjust(rec.tenant, rule, max(used - charged, -charged))
        self.recorder.record(snap, rec)


def answer_bound(pool: Pool, prompt_tokens: int) -> int:
    """What the answer of a request without max_tokens may cost: the pool's
    `default_max_tokens`, no more than the engine's context leaves after the prompt (its
    `max_model_len` from /v1/models); 0 when neither is known (the prompt alone is charged)."""
    default = pool.config.default_max_tokens
    context = pool.max_model_len()
    room = None if context is None else max(0, context - prompt_tokens)
    if default is None:
        return room or 0
    return default if room is None else min(default, room)


def pick_pool(snap: Snapshot, req: ParsedRequest, prompt_tokens: int) -> Pool:
    """The route's pool for the model; a request naming no model (kinds where vLLM allows that)
    goes to the default pool: the first route that takes any model, else the first pool."""
    config = snap.config
    name = config.pool_for(req.model, prompt_tokens) if req.model else default_pool(snap, prompt_tokens)
    if name is None:
        model = req.model if len(req.model) <= 64 else req.model[:64] + "…"
        raise NotFound(f"The model `{model}` does not exist.", param="model", code="model_not_found")
    return snap.pools[name]


def default_pool(snap: Snapshot, prompt_tokens: int) -> str:
    config = snap.config
    for route in config.routes:
        if route.match.matches("", prompt_tokens):
            return route.pool
    return next(iter(config.pools))


class _Ids:
    """New request ids: 16 random hex digits drawn once per process (again in a forked child),
    then a counter: unique across processes and gateways without a getrandom call per request."""

    __slots__ = ("prefix", "count")

    def __init__(self) -> None:
        self.reseed()

    def reseed(self) -> None:
        self.prefix = os.urandom(8).hex()
        self.count = itertools.count()

    def new(self) -> str:
        return f"{self.prefix}{next(self.count):016x}"


_IDS = _Ids()
os.register_at_fork(after_in_child=_IDS.reseed)


def request_id(headers: RawHeaders) -> str:
    """The client's X-Request-Id (bounded), else a new one (32 hex digits, unique, not secret);
    sent to the replica and back."""
    rid = headers.get(b"x-request-id")
    return rid.decode("latin-1")[:128] if rid else _IDS.new()


def route_input(rec: Record, headers: RawHeaders, tenant: Tenant) -> RouteInput:
    session = headers.get(b"x-session-id")
    key = session.decode("latin-1") if session else None
    return RouteInput(rec.request_id, tenant.name, rec.priority, key, tenant.cache_salt)


def explained(snap: Snapshot, headers: RawHeaders) -> bool:
    """The client asked for the decision header, and the operator lets it see such detail."""
    asked = headers.get(b"x-gateway-explain") in (b"1", b"true")
    return asked and snap.config.server.expose_upstream_errors


def decision_header(routing: Routing) -> tuple[bytes, bytes]:
    assert routing.decision is not None
    return b"x-gateway-decision", orjson.dumps(routing.decision.explain())


def upstream_headers(pool: Pool, rec: Record, content_type: bytes | None = None) -> Headers:
    """`content_type`: the client's, for a body sent on as it came (multipart, passthrough)."""
    out = [
        (b"content-type", content_type or b"application/json"),
        (b"accept-encoding", b"identity"),
        (b"x-request-id", rec.request_id.encode("latin-1")),
    ]
    key = pool.config.upstream_api_key
    if key is not None:
        out.append((b"authorization", b"Bearer " + key.get_secret_value().encode()))
    if rec.trace is not None:
        out.append((b"traceparent", rec.trace.traceparent().encode()))
        state = rec.trace.tracestate()
        if state:
            out.append((b"tracestate", state.encode()))
    return out


def upstream_body(
    snap: Snapshot, req: ParsedRequest, priority: str, tenant_salt: str | None,
    fields: frozenset[str] = frozenset({"cache_salt", "priority"}),
) -> bytes:  # fmt: skip
    """The body as sent on: unchanged bytes unless the gateway must add or remove a field.
    `fields`: the engine fields the gateway may set for this kind (none: the body goes as it came)."""
    if not fields:
        return req.raw
    changes: dict[str, object] = {}
    if tenant_salt is not None and "cache_salt" in fields:  # the engine keeps this tenant's KV apart
        changes["cache_salt"] = cache_salt(req, tenant_salt)
    if "priority" in req.body:
        # the engine's priority is the gateway's to set: a class name is ours, and a client's
        # integer would jump the engine's queue past the class the gateway gave it
        changes["priority"] = None
    if snap.config.admission.forward_priority:
        changes["priority"] = snap.tenants.vllm_priority(priority)
    if req.stream and not req.include_usage:
        if not changes:  # for our accounting; stripped on the way out
            return with_stream_usage(req.raw, req.body)
        changes["stream_options"] = {**(req.body.get("stream_options") or {}), "include_usage": True}
    if not changes:
        return req.raw
    merged = {**req.body, **changes}
    return orjson.dumps({k: v for k, v in merged.items() if v is not None or k not in changes})
