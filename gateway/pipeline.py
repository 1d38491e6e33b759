"""The request path: one short method whose lines are the steps, and what it records at the end.

parse → hash → pick pool → route (index match + policy) → forward (fail over) → record. Every step
stamps a time on the request's `Ctx`; `finish` turns the Ctx into metrics and a trace.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from policies.types import Decision, Outcome, ReplicaView, RoutedRequest
from prefix_index.chunking import render_chat, scope_key

from .errors import GatewayError, NoReplicaAvailable, NotFound, UpstreamError, UpstreamTimeout
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
from .runtime import Gateway, Pool
from .streams import StreamTap
from .tracing import RequestTrace

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

UPSTREAM_PATHS: dict[Kind, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


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
    t_route: int = 0
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
        self, kind: Kind, raw: bytes, headers: dict[bytes, bytes], send: Send, ctx: Ctx
    ) -> None:
        req = parse_body(kind, raw)
        ctx.model, ctx.stream = req.model, req.stream
        ctx.t_route = time.perf_counter_ns()
        scope, hashes, tokens = self.hash_prompt(req)
        pool = self.pick_pool(req, tokens)
        routed = self.routed_request(req, headers, pool, scope, hashes, tokens)
        ctx.request_id, ctx.pool, ctx.prompt_tokens = (
            routed.request_id,
            pool.name,
            routed.prompt_tokens,
        )
        decision, views = await self.route(pool, routed)
        ctx.t_routed = time.perf_counter_ns()
        self.count_decision(pool, routed, decision, ctx)
        if decision.replica is None:
            raise NoReplicaAvailable(
                f"No replica of pool '{pool.name}' can take the request now ({_why(decision)})",
                retry_after=pool.config.health.interval_s,
            )
        extra = [(b"x-request-id", routed.request_id.encode("latin-1"))]
        if headers.get(b"x-gateway-explain") in (b"1", b"true"):
            extra.append((b"x-gateway-decision", orjson.dumps(decision.explain())))
        await self.forward(req, routed, pool, decision, views, send, extra, ctx)

    # --- the steps ---------------------------------------------------------------------------
    def hash_prompt(self, req: ParsedRequest) -> tuple[str, list[int], int]:
        """The prompt's scope (model + cache salt), chained block hashes and estimated tokens."""
        chunker = self.gw.chunker
        salt = req.body.get("cache_salt")
        scope = scope_key(req.model, salt=salt if isinstance(salt, str) else None)
        if req.kind == "chat":
            text = render_chat(req.messages)
            return scope, chunker.hash_text(scope, text), chunker.estimate_tokens(text)
        prompt = req.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], list | str):
            prompt = prompt[0]  # a batch: route by its first prompt
        if isinstance(prompt, str):
            return scope, chunker.hash_text(scope, prompt), chunker.estimate_tokens(prompt)
        return scope, chunker.hash_tokens(scope, prompt), len(prompt)

    def routed_request(
        self,
        req: ParsedRequest,
        headers: dict[bytes, bytes],
        pool: Pool,
        scope: str,
        hashes: list[int],
        tokens: int,
    ) -> RoutedRequest:
        rid = headers.get(b"x-request-id")
        session = headers.get(b"x-session-id")
        return RoutedRequest(
            request_id=rid.decode("latin-1")[:128] if rid else uuid.uuid4().hex,
            model=req.model,
            scope=scope,
            pool=pool.name,
            prompt_tokens=tokens,
            block_hashes=hashes,
            tokens_per_block=self.gw.chunker.tokens_per_block,
            max_tokens=req.max_tokens,
            session_key=session.decode("latin-1") if session else req.user,
        )

    def pick_pool(self, req: ParsedRequest, prompt_tokens: int) -> Pool:
        name = self.gw.config.pool_for(req.model, prompt_tokens)
        if name is None:
            raise NotFound(
                f"The model `{req.model}` does not exist.", param="model", code="model_not_found"
            )
        return self.gw.pools[name]

    async def route(self, pool: Pool, routed: RoutedRequest) -> tuple[Decision, list[ReplicaView]]:
        hits: dict[str, int] = {}
        index = self.gw.index
        if routed.block_hashes and index is not None:
            hits = await index.match(
                routed.scope, routed.block_hashes, [r.name for r in pool.replicas]
            )
        now = time.monotonic()
        views = [r.view(hits.get(r.name, 0), now) for r in pool.replicas]
        return pool.policy.choose(routed, views), views

    async def forward(
        self,
        req: ParsedRequest,
        routed: RoutedRequest,
        pool: Pool,
        decision: Decision,
        views: list[ReplicaView],
        send: Send,
        extra: list[tuple[bytes, bytes]],
        ctx: Ctx,
    ) -> None:
        """Try the ranked replicas in turn until one answers; never retry after the first byte."""
        pc = pool.config
        path = UPSTREAM_PATHS[req.kind]
        body = req.raw
        if req.stream and not req.include_usage:
            body = with_stream_usage(
                req.raw, req.body
            )  # for our accounting; stripped on the way out
        up_headers = {
            "content-type": "application/json",
            "accept-encoding": "identity",
            "x-request-id": routed.request_id,
        }
        if pc.upstream_api_key is not None:
            up_headers["authorization"] = "Bearer " + pc.upstream_api_key.get_secret_value()
        if ctx.trace is not None:
            up_headers["traceparent"] = ctx.trace.traceparent()
            state = ctx.trace.tracestate()
            if state:
                up_headers["tracestate"] = state
        by_view = {v.name: v for v in views}
        failures: list[str] = []
        timed_out = False
        for name in decision.ranked[: pc.retries + 1]:
            replica, view = pool.by_name[name], by_view[name]
            hit_tokens = min(routed.prompt_tokens, int(view.hit_blocks * routed.tokens_per_block))
            uncached = routed.prompt_tokens - hit_tokens
            ctx.tried.append(name)
            ctx.t_sent = ctx.t_sent or time.perf_counter_ns()
            replica.dispatched(uncached)
            prefilled = False
            try:
                try:
                    opened = await open_upstream(
                        self.gw.session,
                        replica.url + path,
                        body,
                        up_headers,
                        pc.timeouts,
                        req.stream,
                    )
                except Retryable as exc:
                    replica.failed(exc.reason)
                    failures.append(f"{name}: {exc.reason}")
                    timed_out = timed_out or exc.reason.startswith("timeout")
                    self.gw.metrics.attempts.labels(pool.name, name, _attempt_outcome(exc)).inc()
                    continue
                ctx.t_first = time.perf_counter_ns()
                ctx.replica, ctx.status = name, opened.resp.status
                replica.prefilled(uncached)
                prefilled = True
                await self.deliver(req, routed, pool, opened, send, extra, ctx)
                ok = opened.resp.status < 500 and ctx.outcome == "ok"
                replica.succeeded() if ok else replica.failed(f"upstream {ctx.outcome}")
                ttft_s = (
                    (ctx.t_first - ctx.t_in) / 1e9 if req.stream and ctx.status == 200 else None
                )
                if ttft_s is not None:
                    replica.observe_ttft(ttft_s)
                pool.policy.observe(
                    Outcome(
                        name,
                        routed.prompt_tokens,
                        hit_tokens,
                        view.load,
                        view.inflight_prompt_tokens,
                        ttft_s,
                        ok=ok,
                    )
                )
                return
            finally:
                if not prefilled:
                    replica.prefilled(uncached)
                replica.finished()
        detail = "; ".join(failures) if self.gw.config.server.expose_upstream_errors else ""
        n = len(failures)
        if timed_out:
            raise UpstreamTimeout(f"All {n} attempted replicas timed out. {detail}".strip())
        raise UpstreamError(f"All {n} attempted replicas failed. {detail}".strip())

    async def deliver(
        self,
        req: ParsedRequest,
        routed: RoutedRequest,
        pool: Pool,
        opened: Opened,
        send: Send,
        extra: list[tuple[bytes, bytes]],
        ctx: Ctx,
    ) -> None:
        """Relay the chosen replica's answer; learn its blocks once it has prefilled them."""
        status = opened.resp.status
        if status != 200:
            body = normalize_error_body(
                status, opened.first, self.gw.config.server.expose_upstream_errors
            )
            await send_whole(opened, send, extra, body)
            ctx.outcome, ctx.error_type = "upstream_error", f"upstream_{status}"
            ctx.t_last = time.perf_counter_ns()
            return
        index = self.gw.index
        if req.stream:
            tap = StreamTap(strip_usage=not req.include_usage)
            if index is not None and routed.block_hashes:  # prefill is done: the replica holds them
                await index.record(routed.scope, ctx.replica, routed.block_hashes)
            broke = await relay_stream(opened, send, extra, tap)
            ctx.t_last = time.perf_counter_ns()
            if broke is not None:
                ctx.outcome, ctx.error_type = "broken_mid_stream", broke.type
            usage = tap.usage
        else:
            await send_whole(opened, send, extra)
            ctx.t_last = time.perf_counter_ns()
            if index is not None and routed.block_hashes:
                await index.record(routed.scope, ctx.replica, routed.block_hashes)
            usage = _usage_of(opened.first)
        if usage is not None:
            ctx.input_tokens = _int(usage.get("prompt_tokens"))
            ctx.output_tokens = _int(usage.get("completion_tokens"))
            details = usage.get("prompt_tokens_details")
            ctx.cached_tokens = (
                _int(details.get("cached_tokens")) if isinstance(details, dict) else None
            )

    # --- what is recorded ------------------------------------------------------------------------
    def count_decision(
        self, pool: Pool, routed: RoutedRequest, decision: Decision, ctx: Ctx
    ) -> None:
        m = self.gw.metrics
        ctx.policy, ctx.reason = decision.policy, decision.reason
        ctx.prompt_blocks, ctx.predicted_hit_blocks = (
            len(routed.block_hashes),
            decision.predicted_hit_blocks,
        )
        m.routing_time.labels(pool.name).observe((ctx.t_routed - ctx.t_route) / 1e9)
        m.decisions.labels(pool.name, decision.policy, decision.reason).inc()
        self.gw.recent.append(
            {
                "t": time.time(),
                "request_id": routed.request_id,
                "pool": pool.name,
                "prompt_tokens": routed.prompt_tokens,
                "blocks": len(routed.block_hashes),
                **decision.explain(),
            }
        )

    def finish(self, ctx: Ctx, exc: GatewayError | None) -> None:
        """Metrics and the trace for one request, whatever happened to it."""
        m = self.gw.metrics
        now = time.perf_counter_ns()
        if exc is not None:
            ctx.status, ctx.outcome, ctx.error_type = exc.status, "error", exc.type
            m.errors.labels(ctx.pool, exc.type).inc()
        elif ctx.outcome != "ok" and ctx.error_type:
            m.errors.labels(ctx.pool, ctx.error_type).inc()
        m.requests.labels(ctx.pool, ctx.replica, str(ctx.status or 499)).inc()
        m.duration.labels(ctx.pool).observe((now - ctx.t_in) / 1e9)
        if ctx.replica != "none" and ctx.status == 200:
            pool, replica = ctx.pool, ctx.replica
            m.attempts.labels(pool, replica, ctx.outcome).inc()
            if ctx.stream and ctx.t_first:
                m.ttft.labels(pool, replica).observe((ctx.t_first - ctx.t_in) / 1e9)
                if ctx.output_tokens and ctx.output_tokens > 1 and ctx.t_last > ctx.t_first:
                    m.tpot.labels(pool, replica).observe(
                        (ctx.t_last - ctx.t_first) / 1e9 / (ctx.output_tokens - 1)
                    )
            m.prompt_length.labels(pool).observe(ctx.input_tokens or ctx.prompt_tokens)
            m.prompt_tokens.labels(pool).inc(ctx.input_tokens or ctx.prompt_tokens)
            if ctx.output_tokens:
                m.output_tokens.labels(pool).inc(ctx.output_tokens)
            if ctx.prompt_blocks:
                m.prompt_blocks.labels(pool).inc(ctx.prompt_blocks)
                m.predicted_hit_blocks.labels(pool).inc(ctx.predicted_hit_blocks)
            if ctx.cached_tokens is not None and ctx.input_tokens:
                m.observed_prompt_tokens.labels(pool).inc(ctx.input_tokens)
                m.observed_cached_tokens.labels(pool).inc(ctx.cached_tokens)
        elif ctx.replica != "none":
            m.attempts.labels(ctx.pool, ctx.replica, f"status_{ctx.status // 100}xx").inc()
        if ctx.trace is not None:
            self._finish_trace(ctx, now)

    def _finish_trace(self, ctx: Ctx, now: int) -> None:
        tr = ctx.trace
        assert tr is not None
        ep = tr.epoch_ns
        route = (ep(ctx.t_route), ep(ctx.t_routed)) if ctx.t_routed else None
        prefill = (ep(ctx.t_sent), ep(ctx.t_first)) if ctx.t_first else None
        decode = (
            (ep(ctx.t_first), ep(ctx.t_last)) if ctx.stream and ctx.t_last and ctx.t_first else None
        )
        tr.finish(
            route=route,
            prefill=prefill,
            decode=decode,
            end_ns=ep(now),
            attrs={
                "model": ctx.model,
                "pool": ctx.pool,
                "replica": ctx.replica if ctx.replica != "none" else None,
                "policy": ctx.policy or None,
                "route_reason": ctx.reason or None,
                "prompt_tokens_estimated": ctx.prompt_tokens,
                "prompt_blocks": ctx.prompt_blocks,
                "predicted_cached_blocks": ctx.predicted_hit_blocks,
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


def _attempt_outcome(exc: Retryable) -> str:
    if exc.status is not None:
        return f"status_{exc.status}"
    if exc.reason.startswith("timeout"):
        return "timeout"
    return "connect_error" if exc.reason.startswith("connection") else "closed_early"


def _usage_of(body: bytes) -> dict[str, Any] | None:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    usage = data.get("usage") if isinstance(data, dict) else None
    return usage if isinstance(usage, dict) else None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None
