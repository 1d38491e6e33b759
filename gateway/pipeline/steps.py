"""The request path: `handle` is the steps, one call each, every one returning what it found.

parse → identify → pick the pool → limit → route (hash + index match) → admit (queue, choose,
dispatch) → forward (the pool's forwarder: fail over or run the P/D legs, relay) → `finish`
(settle the limits, record metrics and the trace). Everything a request reads comes from the one
`Snapshot` it took when it arrived. The steps return what they found and `handle`, `admit` and
`finish` write it into the request's `Record`; its docstring names each field's one writer.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from gateway.api.kinds import EndpointKind
from gateway.api.openai import ParsedRequest
from gateway.errors import GatewayError
from gateway.fleet.pools import Pool
from gateway.forwarding.failover import Failover
from gateway.forwarding.lora_placement import LoraPlacement
from gateway.forwarding.outbound import Outbound, upstream_body, upstream_headers
from gateway.forwarding.pd import PD_KINDS, PdForwarder
from gateway.limits.ratelimit import Rule, costs_for, rate_limited
from gateway.limits.ratelimit import headers as ratelimit_headers
from gateway.limits.tenants import Tenant, requested_priority
from gateway.pipeline.record import Ended, Record, Recorder
from gateway.routing.router import Dispatched, PdDispatch, RouteInput, Routing
from gateway.routing.sticky import Homes
from gateway.runtime.snapshot import Snapshot, pick_pool
from gateway.transport.writer import ResponseWriter
from gateway.types import Headers

if TYPE_CHECKING:
    from gateway.runtime.gateway import Gateway

RawHeaders = dict[bytes, bytes]


class Pipeline:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        self.recorder = Recorder(gateway)
        self.homes = Homes(lambda: gateway.fleet)  # /v1/responses: which replica made each
        self.lora = LoraPlacement()  # managed LoRA placement (pools.<p>.lora.manage)
        self.lora.register(gateway.metrics.registry)
        self.failover = Failover(gateway, self.lora)  # a plain pool's forwarder
        self.pd = PdForwarder(gateway, self.failover)  # a disaggregated pool's

    async def handle(
        self, snap: Snapshot, kind: EndpointKind, raw: bytes, headers: RawHeaders, tenant: Tenant,
        writer: ResponseWriter, rec: Record,
    ) -> None:  # fmt: skip
        """One request of `kind` on `snap`; `tenant` was identified by the endpoint before the body."""
        req = kind.parse(raw, headers.get(b"content-type"))
        rec.model, rec.stream = req.model, req.stream
        rec.priority = snap.tenants.priority_for(tenant, requested_priority(headers.get(b"x-priority"), req.body))
        prompt = snap.router.prompt(req, kind.prompt)
        pool = pick_pool(snap, req, prompt.tokens)
        if pool.pd is not None and kind.name not in PD_KINDS:
            pool = pool.pd.decode  # nothing to disaggregate (embeddings, tokenize): the decode set
        rec.pool, rec.prompt_tokens = pool.name, prompt.tokens
        rec.charged, limited = await self.limit(snap, tenant, req, prompt.tokens, pool if kind.generates else None)
        home = await self.homes.home(req.body.get("previous_response_id"), pool) if kind.sticky else None
        rec.t_route = time.perf_counter_ns()
        routing = await snap.router.route(req, pool, prompt, route_input(rec, headers, tenant, home))
        rec.t_queue = time.perf_counter_ns()
        first = await self.admit(snap, pool, tenant, routing, rec)
        extra: Headers = [(b"x-request-id", rec.request_id.encode("latin-1")), *limited]
        ctype = headers.get(b"content-type") if kind.client_content_type else None
        server = snap.config.server
        engine_priority = (
            snap.tenants.vllm_priority(rec.priority) if snap.config.admission.forward_priority else None
        )
        out = Outbound(
            snap.router, pool, req, routing,
            upstream_body(req, engine_priority, tenant.cache_salt, kind.fields),
            upstream_headers(pool, rec.request_id, rec.trace, ctype), extra, server.expose_upstream_errors,
            server.max_answer_bytes_in_flight, kind, self.learner(pool) if kind.sticky else None,
            explain=explained(snap, headers),
        )  # fmt: skip
        if isinstance(first, PdDispatch):  # the pool's forwarder: P/D legs, or plain failover
            sent = await self.pd.forward(out, first, writer, rec.sent)
        else:
            sent = await self.failover.forward(out, first, writer, rec.sent)
        if sent.error is not None:
            raise sent.error

    # --- the steps -------------------------------------------------------------------------------
    async def limit(
        self, snap: Snapshot, tenant: Tenant, req: ParsedRequest, tokens: int,
        generating: Pool | None = None,
    ) -> tuple[list[tuple[Rule, int]], Headers]:  # fmt: skip
        """Charge the tenant's buckets (requests; prompt estimate + max_tokens for each choice,
        `n` or `best_of` per prompt); 429 when short.

        A request of a kind that generates (`generating`: its pool) and sets no max_tokens is
        charged a bound on its answer (`Pool.answer_bound`). A request that can never fit a
        bucket (max_tokens deeper than it) gets a 429 that says so. Returns what each token
        bucket gave (`finish` settles it on the answer's usage) and the `x-ratelimit-*` headers.
        """
        limiter = snap.limiter
        rules = tenant.rules(req.model) if limiter is not None else []
        if limiter is None or not rules:
            return [], []
        unset = 0
        if generating is not None and req.max_tokens is None:
            unset = generating.answer_bound(tokens)
        costs = costs_for(rules, tokens, req.max_tokens, unset, req.choices)
        verdict = await limiter.acquire(tenant.name, rules, costs)
        if not verdict.allowed:
            for name in verdict.blocked:
                self.gw.metrics.limited.labels(tenant.name, name).inc()
            raise rate_limited(
                verdict, tenant.name, prompt_tokens=tokens, max_tokens=req.max_tokens,
                choices=req.choices,
            )  # fmt: skip
        charged = [  # a degraded verdict (backend down) took nothing
            (r, 0 if verdict.degraded else int(c))
            for r, c in zip(rules, costs, strict=True)
            if r.unit == "tokens"
        ]
        return charged, ratelimit_headers(verdict)

    async def admit(
        self, snap: Snapshot, pool: Pool, tenant: Tenant, routing: Routing, rec: Record
    ) -> Dispatched:
        """Wait for a slot in the pool's admission queue, then the routing unit's choice and its
        dispatch (before the next request is admitted, so that it sees this one's load and
        blocks). A 503 when the decision has no replica (recorded all the same)."""
        slot = snap.admission.slot(pool.name, tenant.name, tenant.weight, rec.priority, pool.has_capacity)
        async with slot as waited:
            rec.t_admitted = time.perf_counter_ns()
            self.recorder.queue_wait(pool.name, rec.priority, waited)
            offer = self.lora.offer(pool, routing.routed.model)  # managed LoRA: who may load it
            decision = snap.router.choose(pool, routing, offer)
            rec.t_routed = time.perf_counter_ns()
            rec.routed(routing, decision)
            self.recorder.decision(pool, routing, decision)
            return await snap.router.dispatch_decision(pool, routing)

    async def finish(
        self, snap: Snapshot, rec: Record, exc: GatewayError | None, ended: Ended | None = None
    ) -> None:
        """Settle the limits and record the request, whatever happened to it: how it ended is
        `exc`'s (answered with that error), else `ended` (the endpoint's word: the client left,
        the answer was cut short), else the forwarder's (`rec.sent`).

        Each token bucket is settled on the tokens used: it gets back at most what was charged,
        and nothing when the usage is unknown (a 200 without a usable `usage`).
        """
        rec.ended(exc, ended)
        used = rec.tokens_used()
        if rec.charged and snap.limiter is not None and used is not None:
            for rule, charged in rec.charged:
                if used != charged:
                    await snap.limiter.adjust(rec.tenant, rule, max(used - charged, -charged))
        self.recorder.record(snap, rec)

    def learner(self, pool: Pool) -> Callable[[str, str], Awaitable[None]]:
        """How a sticky answer's id is learned: its home (the replica that made it, in `pool`),
        for this gateway and the fleet."""

        async def learn(answer_id: str, replica: str) -> None:
            made = pool.by_name.get(replica)
            if made is not None:
                await self.homes.learn(answer_id, pool, made)

        return learn


def route_input(rec: Record, headers: RawHeaders, tenant: Tenant, home: str | None) -> RouteInput:
    session = headers.get(b"x-session-id")
    key = session.decode("latin-1") if session else None
    return RouteInput(rec.request_id, tenant.name, rec.priority, key, tenant.cache_salt, home)


def explained(snap: Snapshot, headers: RawHeaders) -> bool:
    """The client asked for the decision header, and the operator lets it see such detail."""
    asked = headers.get(b"x-gateway-explain") in (b"1", b"true")
    return asked and snap.config.server.expose_upstream_errors
