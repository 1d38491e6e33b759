"""The request path: one short method whose lines are the steps, and what it records at the end.

parse → render → pick pool → limit → hash + match (gateway.router) → admission → choose →
dispatch → forward (fail over). Every step stamps a time on the request's `Ctx`; `finish` turns
the Ctx into metrics and a trace.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from policies.types import Decision

from .config import TimeoutsConfig
from .errors import (
    GatewayError,
    NoReplicaAvailable,
    NotFound,
    ServerBusy,
    UpstreamError,
    UpstreamTimeout,
)
from .openai import Kind, ParsedRequest, parse_body
from .proxy import (
    Opened,
    Retryable,
    normalize_error_body,
    open_upstream,
    relay_stream,
    send_whole,
    with_stream_usage,
)
from .ratelimit import Rule, costs_for, rate_limited
from .ratelimit import headers as ratelimit_headers
from .router import Dispatch, RouteInput, Routing, cache_salt
from .runtime import Gateway, Pool
from .streams import StreamTap
from .tenants import Tenant, requested_priority
from .tracing import RequestTrace

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

UPSTREAM_PATHS: dict[Kind, bytes] = {
    "chat": b"/v1/chat/completions",
    "completions": b"/v1/completions",
}


@dataclass(slots=True)
class Ctx:
    """What one request did, stamped as it goes (perf_counter_ns times; 0 = did not happen)."""

    t_in: int
    trace: RequestTrace | None = None
    request_id: str = ""
    model: str = ""
    pool: str = "none"
    replica: str = "none"
    policy: str = ""
    reason: str = ""
    stream: bool = False
    status: int = 0
    outcome: str = "ok"
    error_type: str | None = None
    tried: list[str] = field(default_factory=list)
    tenant: str = "anonymous"
    priority: str = ""
    charged: list[tuple[Rule, int]] = field(
        default_factory=list
    )  # token rules and what was charged
    t_route: int = 0
    stages: tuple[int, int, int] = (0, 0, 0)  # ns spent hashing, matching, choosing
    t_queue: int = 0
    t_admitted: int = 0
    t_routed: int = 0
    t_sent: int = 0
    t_first: int = 0
    t_last: int = 0
    prompt_tokens: int = 0
    prompt_blocks: int = 0
    predicted_hit_blocks: int = 0
    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None


class Pipeline:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    async def handle(
        self,
        kind: Kind,
        raw: bytes,
        headers: dict[bytes, bytes],
        tenant: Tenant,
        send: Send,
        ctx: Ctx,
    ) -> None:
        """`tenant`: identified by the endpoint from the headers, before the body was read."""
        gw = self.gw
        router = gw.router
        req = parse_body(kind, raw)
        ctx.model, ctx.stream = req.model, req.stream
        ctx.priority = gw.tenants.priority_for(
            tenant, requested_priority(headers.get(b"x-priority"), req.body)
        )
        prompt = router.prompt(req)
        tokens = prompt[1]
        pool = self.pick_pool(req, tokens)
        ctx.pool, ctx.prompt_tokens = pool.name, tokens
        rid = headers.get(b"x-request-id")
        ctx.request_id = rid.decode("latin-1")[:128] if rid else os.urandom(16).hex()
        extra = [(b"x-request-id", ctx.request_id.encode("latin-1"))]
        extra += await self.limit(tenant, req, tokens, ctx)
        if not pool.any_available():
            raise NoReplicaAvailable(
                f"No replica of pool '{pool.name}' is available (all circuits open or draining)",
                retry_after=pool.config.health.interval_s,
            )
        session = headers.get(b"x-session-id")
        inp = RouteInput(
            ctx.request_id,
            tenant.name,
            ctx.priority,
            session.decode("latin-1") if session else None,
            tenant.cache_salt,
        )
        ctx.t_route = time.perf_counter_ns()
        routing = router.prepare(req, pool, inp, prompt)
        await router.match(pool, routing)  # outside admission: a Redis round trip queues no one
        ctx.t_queue = time.perf_counter_ns()
        async with gw.admission.slot(
            pool.name, tenant.name, tenant.weight, ctx.priority, pool.has_capacity
        ) as waited:
            ctx.t_admitted = time.perf_counter_ns()
            gw.metrics.queue_wait.labels(pool.name, ctx.priority).observe(waited)
            decision = router.choose(pool, routing)
            ctx.t_routed = time.perf_counter_ns()
            self.count_decision(pool, routing, decision, ctx)
            if decision.replica is None:
                raise NoReplicaAvailable(
                    f"No replica of pool '{pool.name}' can take the request now ({_why(decision)})",
                    retry_after=pool.config.health.interval_s,
                )
            first = await router.dispatch(pool, routing, decision.ranked[0])  # before the next
        if gw.config.server.expose_upstream_errors and headers.get(b"x-gateway-explain") in (
            b"1",
            b"true",
        ):
            extra.append((b"x-gateway-decision", orjson.dumps(decision.explain())))
        body = self.upstream_body(req, ctx.priority, tenant.cache_salt)
        await self.forward(req, routing, pool, first, body, send, extra, ctx)

    async def limit(
        self, tenant: Tenant, req: ParsedRequest, tokens: int, ctx: Ctx
    ) -> list[tuple[bytes, bytes]]:
        """Charge the tenant's buckets (requests, prompt estimate + max_tokens); 429 when empty.

        A request that can never fit a bucket (max_tokens deeper than it) gets a 429 that says
        so. `ctx.charged` is what each token bucket gave: `finish` gives back no more than that.
        """
        limiter = self.gw.limiter
        rules = tenant.rules(req.model) if limiter is not None else []
        if not rules:
            return []
        assert limiter is not None
        costs = costs_for(rules, tokens, req.max_tokens)
        verdict = await limiter.acquire(tenant.name, rules, costs)
        if not verdict.allowed:
            for name in verdict.blocked:
                self.gw.metrics.limited.labels(tenant.name, name).inc()
            raise rate_limited(
                verdict, tenant.name, prompt_tokens=tokens, max_tokens=req.max_tokens
            )
        ctx.charged = [  # a degraded verdict (backend down) took nothing
            (r, 0 if verdict.degraded else int(c))
            for r, c in zip(rules, costs, strict=True)
            if r.unit == "tokens"
        ]
        return ratelimit_headers(verdict)

    def upstream_body(self, req: ParsedRequest, priority: str, tenant_salt: str | None) -> bytes:
        """The body as sent on: unchanged bytes unless the gateway must add or remove a field."""
        body = req.raw
        changes: dict[str, Any] = {}
        if tenant_salt is not None:  # the engine keeps this tenant's KV apart from others'
            changes["cache_salt"] = cache_salt(req, tenant_salt)
        if "priority" in req.body:
            # the engine's priority is the gateway's to set: a class name is ours, and a client's
            # integer would jump the engine's queue past the class the gateway gave it
            changes["priority"] = None
        if self.gw.config.admission.forward_priority:
            changes["priority"] = self.gw.tenants.vllm_priority(priority)
        if req.stream and not req.include_usage:
            if not changes:
                return with_stream_usage(
                    req.raw, req.body
                )  # for our accounting; stripped on the way out
            changes["stream_options"] = {
                **(req.body.get("stream_options") or {}),
                "include_usage": True,
            }
        if changes:
            merged = {**req.body, **changes}
            body = orjson.dumps(
                {k: v for k, v in merged.items() if v is not None or k not in changes}
            )
        return body

    # --- the steps ---------------------------------------------------------------------------
    def pick_pool(self, req: ParsedRequest, prompt_tokens: int) -> Pool:
        name = self.gw.config.pool_for(req.model, prompt_tokens)
        if name is None:
            model = req.model if len(req.model) <= 64 else req.model[:64] + "…"
            raise NotFound(
                f"The model `{model}` does not exist.", param="model", code="model_not_found"
            )
        return self.gw.pools[name]

    async def forward(
        self,
        req: ParsedRequest,
        routing: Routing,
        pool: Pool,
        first: Dispatch,
        body: bytes,
        send: Send,
        extra: list[tuple[bytes, bytes]],
        ctx: Ctx,
    ) -> None:
        """Try the ranked replicas in turn until one answers; never retry after the first byte."""
        pc = pool.config
        path = UPSTREAM_PATHS[req.kind]
        up_headers = [
            (b"content-type", b"application/json"),
            (b"accept-encoding", b"identity"),
            (b"x-request-id", routing.routed.request_id.encode("latin-1")),
        ]
        if pc.upstream_api_key is not None:
            up_headers.append(
                (b"authorization", b"Bearer " + pc.upstream_api_key.get_secret_value().encode())
            )
        if ctx.trace is not None:
            up_headers.append((b"traceparent", ctx.trace.traceparent().encode()))
            state = ctx.trace.tracestate()
            if state:
                up_headers.append((b"tracestate", state.encode()))
        failures: list[str] = []
        fired: list[str] = []  # the timeout that ended each timed-out attempt
        deadline = (
            time.monotonic() + pc.timeouts.total_s
        )  # total_s bounds the whole request, retries included
        assert routing.decision is not None
        router = self.gw.router
        attempt: Dispatch | None = first
        candidates = iter(routing.decision.ranked[1:])
        retries = pc.retries  # a failed trial of a half-open replica does not use one up
        while attempt is not None:
            current = attempt
            name = current.replica.name
            ctx.tried.append(name)
            t_sent = time.perf_counter_ns()
            ctx.t_sent = ctx.t_sent or t_sent
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    fired.append("total_s")
                    await current.failed("timeout (total_s)")
                    break
                try:
                    opened = await open_upstream(
                        self.gw.upstream,
                        current.replica.url,
                        path,
                        body,
                        up_headers,
                        pc.timeouts,
                        req.stream,
                        left,
                        self.gw.answers,
                        self.gw.config.server.max_answer_bytes_in_flight,
                    )
                except ServerBusy:  # the gateway's own answer budget, not the replica's fault
                    await current.finished(True, True, None)
                    raise
                except Retryable as exc:
                    await current.failed(exc.reason)
                    failures.append(f"{name}: {exc.reason}")
                    spent = (time.perf_counter_ns() - t_sent) / 1e9
                    which = _timeout_fired(exc.reason, pc.timeouts, req.stream, left, spent)
                    if which is not None:
                        fired.append(which)
                    self.gw.metrics.attempts.labels(pool.name, name, _attempt_outcome(exc)).inc()
                    if current.view.circuit != "half_open":
                        retries -= 1
                    nxt = next(candidates, None) if retries >= 0 else None
                    attempt = await router.dispatch(pool, routing, nxt) if nxt else None
                    continue
                ctx.t_first = time.perf_counter_ns()
                ctx.replica, ctx.status = name, opened.resp.status
                current.prefilled()
                try:
                    await self.deliver(req, opened, send, extra, ctx)
                finally:
                    opened.free()  # the answer is with the client (or never will be)
                ok = opened.resp.status < 500 and ctx.outcome == "ok"
                # the replica's own TTFT (sent -> first byte), not the client's: no queue time in it
                ttft_s = (ctx.t_first - t_sent) / 1e9 if req.stream and ctx.status == 200 else None
                await current.finished(
                    ok, ctx.status == 200, ttft_s, f"upstream {ctx.outcome}"
                )
                return
            finally:
                current.done()
                self.gw.admission.notify(pool.name)
        detail = "; ".join(failures) if self.gw.config.server.expose_upstream_errors else ""
        n = len(failures)
        if fired:
            limits = ", ".join(f"{t} ({getattr(pc.timeouts, t):g} s)" for t in dict.fromkeys(fired))
            raise UpstreamTimeout(
                f"No replica answered in time: {limits} ran out "
                f"({n} attempt{'' if n == 1 else 's'}). {detail}".strip()
            )
        raise UpstreamError(f"All {n} attempted replicas failed. {detail}".strip())

    async def deliver(
        self,
        req: ParsedRequest,
        opened: Opened,
        send: Send,
        extra: list[tuple[bytes, bytes]],
        ctx: Ctx,
    ) -> None:
        """Relay the chosen replica's answer and read its usage."""
        status = opened.resp.status
        if status != 200:
            body = normalize_error_body(
                status, opened.first, self.gw.config.server.expose_upstream_errors
            )
            await send_whole(opened, send, extra, body)
            ctx.outcome, ctx.error_type = "upstream_error", f"upstream_{status}"
            ctx.t_last = time.perf_counter_ns()
            return
        if req.stream:
            tap = StreamTap(strip_usage=not req.include_usage)
            broke = await relay_stream(opened, send, extra, tap, live=self.gw.live_streams)
            ctx.t_last = time.perf_counter_ns()
            if broke is not None:
                ctx.outcome, ctx.error_type = "broken_mid_stream", broke.type
            usage = tap.usage
        else:
            await send_whole(opened, send, extra)
            ctx.t_last = time.perf_counter_ns()
            usage = opened.parsed.get("usage") if opened.parsed is not None else None
            usage = usage if isinstance(usage, dict) else None
        if usage is not None:
            ctx.input_tokens = _int(usage.get("prompt_tokens"))
            ctx.output_tokens = _int(usage.get("completion_tokens"))
            details = usage.get("prompt_tokens_details")
            ctx.cached_tokens = (
                _int(details.get("cached_tokens")) if isinstance(details, dict) else None
            )

    # --- what is recorded ------------------------------------------------------------------------
    def count_decision(self, pool: Pool, routing: Routing, decision: Decision, ctx: Ctx) -> None:
        m = self.gw.metrics
        routed = routing.routed
        ctx.policy, ctx.reason = decision.policy, decision.reason
        ctx.prompt_blocks, ctx.predicted_hit_blocks = (
            len(routed.block_hashes),
            decision.predicted_hit_blocks,
        )
        ctx.stages = (routing.hash_ns, routing.match_ns, routing.choose_ns)
        m.routing_time.labels(pool.name).observe(sum(ctx.stages) / 1e9)
        m.decisions.labels(pool.name, decision.policy, decision.reason).inc()
        # kept as a tuple; turned into JSON only when someone looks (/debug/decisions, /dashboard)
        self.gw.recent.append(
            (
                time.time(),
                routed.request_id,
                pool.name,
                routed.prompt_tokens,
                len(routed.block_hashes),
                decision,
            )
        )

    async def finish(self, ctx: Ctx, exc: GatewayError | None) -> None:
        """Metrics, the trace and the rate-limit correction for one request, whatever happened.

        The correction settles each token bucket on the tokens used: it gives back at most what
        was charged, and nothing when the usage is unknown (a 200 without a usable `usage`).
        """
        for f in ("input_tokens", "output_tokens", "cached_tokens"):
            if (getattr(ctx, f) or 0) < 0:  # a replica's nonsense usage counts as none
                setattr(ctx, f, None)
        used = _tokens_used(ctx)
        if ctx.charged and self.gw.limiter is not None and used is not None:
            for rule, charged in ctx.charged:
                if used != charged:
                    await self.gw.limiter.adjust(ctx.tenant, rule, max(used - charged, -charged))
        m = self.gw.metrics
        now = time.perf_counter_ns()
        if exc is not None:
            ctx.status, ctx.outcome, ctx.error_type = exc.status, "error", exc.type
            m.errors.labels(ctx.pool, exc.type).inc()
        elif ctx.outcome != "ok" and ctx.error_type:
            m.errors.labels(ctx.pool, ctx.error_type).inc()
        pool, replica = ctx.pool, ctx.replica
        e2e = (now - ctx.t_in) / 1e9
        m.requests.labels(pool, replica, str(ctx.status or 499), ctx.priority or "none").inc()
        m.duration.labels(pool).observe(e2e)
        served = replica != "none" and ctx.status == 200
        ttft = tpot = None
        if served:
            m.attempts.labels(pool, replica, ctx.outcome).inc()
            if ctx.stream and ctx.t_first:
                ttft = (ctx.t_first - ctx.t_in) / 1e9
                m.ttft.labels(pool, replica).observe(ttft)
                if ctx.output_tokens and ctx.output_tokens > 1 and ctx.t_last > ctx.t_first:
                    tpot = (ctx.t_last - ctx.t_first) / 1e9 / (ctx.output_tokens - 1)
                    m.tpot.labels(pool, replica).observe(tpot)
            prompt = ctx.input_tokens or ctx.prompt_tokens
            m.prompt_length.labels(pool).observe(prompt)
            m.prompt_tokens.labels(pool).inc(prompt)
            if ctx.output_tokens:
                m.output_tokens.labels(pool).inc(ctx.output_tokens)
            if ctx.prompt_blocks:
                m.prompt_blocks.labels(pool).inc(ctx.prompt_blocks)
                m.predicted_hit_blocks.labels(pool).inc(ctx.predicted_hit_blocks)
            if ctx.cached_tokens is not None and ctx.input_tokens:
                m.observed_prompt_tokens.labels(pool).inc(ctx.input_tokens)
                m.observed_cached_tokens.labels(pool).inc(ctx.cached_tokens)
        elif replica != "none":
            m.attempts.labels(pool, replica, f"status_{ctx.status // 100}xx").inc()
        if pool != "none":
            self.gw.window.observe(
                pool,
                replica,
                ttft_s=ttft,
                tpot_s=tpot,
                e2e_s=e2e,
                prompt_tokens=ctx.input_tokens or ctx.prompt_tokens,
                prompt_blocks=ctx.prompt_blocks if served else 0,
                predicted_hit_blocks=ctx.predicted_hit_blocks if served else 0,
                cached_tokens=ctx.cached_tokens,
                input_tokens=ctx.input_tokens,
                ok=exc is None and ctx.outcome == "ok",
            )
        if ctx.trace is not None:
            self._finish_trace(ctx, now)

    def _finish_trace(self, ctx: Ctx, now: int) -> None:
        tr = ctx.trace
        assert tr is not None
        ep = tr.epoch_ns
        queue = (ep(ctx.t_queue), ep(ctx.t_admitted)) if ctx.t_admitted else None
        # hash + match run before the admission queue, choose after it (in stage attributes)
        route = (ep(ctx.t_route), ep(ctx.t_queue)) if ctx.t_queue else None
        prefill = (ep(ctx.t_sent), ep(ctx.t_first)) if ctx.t_first else None
        decode = (
            (ep(ctx.t_first), ep(ctx.t_last)) if ctx.stream and ctx.t_last and ctx.t_first else None
        )
        tr.finish(
            queue=queue,
            route=route,
            prefill=prefill,
            decode=decode,
            end_ns=ep(now),
            attrs={
                "model": ctx.model,
                "tenant": ctx.tenant,
                "priority": ctx.priority or None,
                "pool": ctx.pool,
                "replica": ctx.replica if ctx.replica != "none" else None,
                "policy": ctx.policy or None,
                "route_reason": ctx.reason or None,
                "prompt_tokens_estimated": ctx.prompt_tokens,
                "prompt_blocks": ctx.prompt_blocks,
                "predicted_cached_blocks": ctx.predicted_hit_blocks,
                "route_hash_us": ctx.stages[0] // 1000 if ctx.t_routed else None,
                "route_match_us": ctx.stages[1] // 1000 if ctx.t_routed else None,
                "route_choose_us": ctx.stages[2] // 1000 if ctx.t_routed else None,
                "input_tokens": ctx.input_tokens,
                "output_tokens": ctx.output_tokens,
                "retries": max(0, len(ctx.tried) - 1),
                "replicas_tried": ctx.tried or None,
                "outcome": ctx.outcome,
                "status_code": ctx.status or None,
            },
            error_type=ctx.error_type if ctx.outcome != "ok" else None,
        )


def _why(decision: Decision) -> str:
    if not decision.filtered:
        return "the pool has no replicas"
    return "; ".join(sorted(set(decision.filtered.values())))


_TIMEOUTS = ("connect_s", "first_byte_s", "idle_s", "total_s")
_EARLY_S = 0.005  # timers fire a little early or late; `spent` also counts the send


def _timeout_fired(
    reason: str, timeouts: TimeoutsConfig, stream: bool, left_s: float, spent_s: float
) -> str | None:
    """Which of a pool's timeouts ended a failed attempt; None when it was no timeout.

    A reason that names one wins. A connect that timed out is connect_s. Otherwise the attempt
    had `left_s` of total_s: if it ran that long, total_s fired. Else a non-streamed request
    waited its headers under total_s too, so its body stalled: idle_s. A stream waited under
    first_byte_s, or under idle_s once the headers came (only when idle_s is the shorter, and
    only before first_byte_s had passed).
    """
    if reason.startswith("connection") and "timed out" in reason:
        return "connect_s"
    if not reason.startswith("timeout"):
        return None
    named = [t for t in _TIMEOUTS if t in reason]
    if named:
        return named[0]
    if spent_s >= left_s - _EARLY_S:
        return "total_s"
    if not stream:
        return "idle_s"
    if timeouts.idle_s < timeouts.first_byte_s and spent_s < timeouts.first_byte_s - _EARLY_S:
        return "idle_s"
    return "first_byte_s"


def _tokens_used(ctx: Ctx) -> int | None:
    """Tokens a request used as far as the limits go: 0 when no replica served it or the replica
    refused it (no generation), None when a 200 came without a usable usage."""
    if ctx.replica == "none" or ctx.status != 200:
        return 0
    if ctx.output_tokens is None:
        return None
    return (ctx.input_tokens or ctx.prompt_tokens) + ctx.output_tokens


def _attempt_outcome(exc: Retryable) -> str:
    if exc.status is not None:
        return f"status_{exc.status}"
    if exc.reason.startswith("timeout"):
        return "timeout"
    return "connect_error" if exc.reason.startswith("connection") else "closed_early"


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None
