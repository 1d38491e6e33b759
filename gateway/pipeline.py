"""The request path as one short method whose lines are the steps, and the state it runs on.

parse → pick pool → hash → match → choose → forward (fail over) → record. Each step is timed; the
objects it uses are built once by `Gateway` and passed down, never read from globals.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import orjson
from prefix_index.chunking import Chunker, make_chunker, render_chat, scope_key

from policies import Policy, build_policy
from policies.types import Decision, Outcome, ReplicaView, RoutedRequest
from prefix_index import PrefixIndex, open_index

from .config import Config, PoolConfig
from .errors import (
    BadRequest,
    GatewayError,
    NoReplicaAvailable,
    NotFound,
    PayloadTooLarge,
    UpstreamError,
    UpstreamTimeout,
    error_body,
)
from .openai import Kind, ParsedRequest, parse_body
from .proxy import (
    Opened,
    Retryable,
    make_session,
    normalize_error_body,
    open_upstream,
    relay_stream,
    send_whole,
    with_stream_usage,
)
from .replicas import ReplicaMonitor, ReplicaState
from .streams import StreamTap
from .telemetry import Metrics

log = logging.getLogger("gateway")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

UPSTREAM_PATHS: dict[Kind, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


class ClientGone(Exception):
    """The client disconnected before its request body was read."""


@dataclass(slots=True)
class Pool:
    name: str
    config: PoolConfig
    replicas: list[ReplicaState]
    policy: Policy
    by_name: dict[str, ReplicaState]


class Gateway:
    """Everything the request path needs, built from one Config."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.metrics = Metrics()
        self.chunker: Chunker = make_chunker(
            config.index.chunking.mode,
            block_bytes=config.index.chunking.block_bytes,
            tokenizer=config.index.chunking.tokenizer,
            block_size=config.index.chunking.block_size,
        )
        self.pools: dict[str, Pool] = {}
        for i, (name, pc) in enumerate(config.pools.items()):
            replicas = [ReplicaState.from_config(name, pc, rc) for rc in pc.replicas]
            self.pools[name] = Pool(
                name, pc, replicas, build_policy(pc.policy, seed=i), {r.name: r for r in replicas}
            )
        self.metrics.watch_replicas(self.all_replicas)
        self.recent: deque[dict[str, Any]] = deque(maxlen=100)
        self.index: PrefixIndex | None = None
        self._monitors: list[ReplicaMonitor] = []
        self._session = None

    def all_replicas(self) -> list[ReplicaState]:
        return [r for p in self.pools.values() for r in p.replicas]

    async def start(self) -> None:
        ic = self.config.index
        self.index = open_index(
            ic.backend, redis_url=ic.redis_url, capacity_blocks=ic.capacity_blocks, ttl_s=ic.ttl_s
        )
        set_capacity = getattr(self.index, "set_capacity", None)
        timeouts = [p.config.timeouts.connect_s for p in self.pools.values()]
        self._session = make_session(max(timeouts))
        for pool in self.pools.values():
            for r in pool.replicas:
                if set_capacity is not None and r.capacity_blocks:
                    set_capacity(r.name, r.capacity_blocks)
                m = ReplicaMonitor(r, self._session, pool.config.health, pool.config.scrape)
                m.start()
                self._monitors.append(m)

    async def stop(self) -> None:
        for m in self._monitors:
            await m.stop()
        self._monitors.clear()
        if self.index is not None:
            await self.index.aclose()
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> Any:
        assert self._session is not None, "Gateway.start() was not awaited"
        return self._session

    # --- the steps ---------------------------------------------------------------------------
    def pick_pool(self, req: ParsedRequest, prompt_tokens: int) -> Pool:
        name = self.config.pool_for(req.model, prompt_tokens)
        if name is None:
            raise NotFound(
                f"The model `{req.model}` does not exist.", param="model", code="model_not_found"
            )
        return self.pools[name]

    def hash_prompt(self, req: ParsedRequest) -> tuple[str, list[int], int]:
        """(scope, chained block hashes, estimated prompt tokens)."""
        salt = req.body.get("cache_salt")
        scope = scope_key(req.model, salt=salt if isinstance(salt, str) else None)
        if req.kind == "chat":
            text: str | None = render_chat(req.messages)
        else:
            prompt = req.prompt
            if isinstance(prompt, list) and isinstance(prompt[0], list | str):
                prompt = prompt[0]  # a batch: route by its first prompt
            text = prompt if isinstance(prompt, str) else None
            if text is None:
                return scope, self.chunker.hash_tokens(scope, prompt), len(prompt)
        return scope, self.chunker.hash_text(scope, text), self.chunker.estimate_tokens(text)

    async def route(self, pool: Pool, routed: RoutedRequest) -> tuple[Decision, list[ReplicaView]]:
        names = [r.name for r in pool.replicas]
        hits: dict[str, int] = {}
        if routed.block_hashes and self.index is not None:
            hits = await self.index.match(routed.scope, routed.block_hashes, names)
        now = time.monotonic()
        views = [r.view(hits.get(r.name, 0), now) for r in pool.replicas]
        return pool.policy.choose(routed, views), views

    async def handle(
        self, kind: Kind, raw: bytes, headers: dict[bytes, bytes], send: Send, t_in: float
    ) -> None:
        req = parse_body(kind, raw)
        scope, hashes, prompt_tokens = self.hash_prompt(req)
        pool = self.pick_pool(req, prompt_tokens)
        session = headers.get(b"x-session-id")
        routed = RoutedRequest(
            request_id=(headers.get(b"x-request-id") or uuid.uuid4().hex.encode()).decode(
                "latin-1"
            ),
            model=req.model,
            scope=scope,
            pool=pool.name,
            prompt_tokens=prompt_tokens,
            block_hashes=hashes,
            tokens_per_block=self.chunker.tokens_per_block,
            max_tokens=req.max_tokens,
            session_key=session.decode("latin-1") if session else req.user,
        )
        decision, views = await self.route(pool, routed)
        self._count_decision(pool, routed, decision, time.perf_counter() - t_in)
        if decision.replica is None:
            raise NoReplicaAvailable(
                f"No replica of pool '{pool.name}' can take the request now ({_why(decision)})",
                retry_after=pool.config.health.interval_s,
            )
        explain = headers.get(b"x-gateway-explain") in (b"1", b"true")
        extra = [(b"x-request-id", routed.request_id.encode("latin-1"))]
        if explain:
            extra.append((b"x-gateway-decision", orjson.dumps(decision.explain())))
        await self.forward(req, routed, pool, decision, views, send, extra, t_in)

    async def forward(
        self,
        req: ParsedRequest,
        routed: RoutedRequest,
        pool: Pool,
        decision: Decision,
        views: list[ReplicaView],
        send: Send,
        extra: list[tuple[bytes, bytes]],
        t_in: float,
    ) -> None:
        """Try the ranked replicas in turn until one answers; never retry after the first byte."""
        pc = pool.config
        url_path = UPSTREAM_PATHS[req.kind]
        up_headers = {
            "content-type": "application/json",
            "accept-encoding": "identity",
            "x-request-id": routed.request_id,
        }
        if pc.upstream_api_key is not None:
            up_headers["authorization"] = "Bearer " + pc.upstream_api_key.get_secret_value()
        body = req.raw
        if req.stream and not req.include_usage:
            body = with_stream_usage(
                req.raw, req.body
            )  # usage for our accounting; stripped on the way out
        by_view = {v.name: v for v in views}
        failures: list[str] = []
        timed_out = False
        for name in decision.ranked[: pc.retries + 1]:
            replica = pool.by_name[name]
            view = by_view[name]
            hit_tokens = min(routed.prompt_tokens, int(view.hit_blocks * routed.tokens_per_block))
            uncached = routed.prompt_tokens - hit_tokens
            replica.dispatched(uncached)
            prefilled = False
            try:
                try:
                    opened = await open_upstream(
                        self.session,
                        replica.url + url_path,
                        body,
                        up_headers,
                        pc.timeouts,
                        req.stream,
                    )
                except Retryable as exc:
                    replica.failed(exc.reason)
                    failures.append(f"{name}: {exc.reason}")
                    timed_out = timed_out or exc.reason.startswith("timeout")
                    self.metrics.attempts.labels(pool.name, name, _outcome(exc)).inc()
                    continue
                ttft = time.perf_counter() - t_in
                replica.prefilled(uncached)
                prefilled = True
                await self._deliver(req, routed, pool, replica, opened, send, extra, ttft)
                if opened.resp.status < 500:
                    replica.succeeded()
                else:
                    replica.failed(f"upstream status {opened.resp.status}")
                pool.policy.observe(
                    Outcome(
                        replica=name,
                        prompt_tokens=routed.prompt_tokens,
                        predicted_hit_tokens=hit_tokens,
                        load_at_dispatch=view.load,
                        queued_prompt_tokens_at_dispatch=view.inflight_prompt_tokens,
                        ttft_s=ttft,
                        ok=opened.resp.status == 200,
                    )
                )
                self.metrics.duration.labels(pool.name).observe(time.perf_counter() - t_in)
                return
            finally:
                if not prefilled:
                    replica.prefilled(uncached)
                replica.finished()
        detail = "; ".join(failures) if self.config.server.expose_upstream_errors else ""
        n = len(failures)
        if timed_out:
            raise UpstreamTimeout(f"All {n} attempted replicas timed out. {detail}".strip())
        raise UpstreamError(f"All {n} attempted replicas failed. {detail}".strip())

    async def _deliver(
        self,
        req: ParsedRequest,
        routed: RoutedRequest,
        pool: Pool,
        replica: ReplicaState,
        opened: Opened,
        send: Send,
        extra: list[tuple[bytes, bytes]],
        ttft: float,
    ) -> None:
        status = opened.resp.status
        m = self.metrics
        if status == 200:
            m.ttft.labels(pool.name, replica.name).observe(ttft)
            replica.observe_ttft(ttft)
            if req.stream:
                tap = StreamTap(strip_usage=not req.include_usage)
                broke = await relay_stream(opened, send, extra, tap)
                outcome = "ok" if broke is None else "broken_mid_stream"
                if broke is not None:
                    replica.failed("broken mid-stream")
            else:
                await send_whole(opened, send, extra)
                outcome = "ok"
            if self.index is not None and routed.block_hashes:
                await self.index.record(routed.scope, replica.name, routed.block_hashes)
        else:
            body = normalize_error_body(
                status, opened.first, self.config.server.expose_upstream_errors
            )
            await send_whole(opened, send, extra, body)
            outcome = f"status_{status // 100}xx"
        m.attempts.labels(pool.name, replica.name, outcome).inc()
        m.requests.labels(pool.name, replica.name, str(status)).inc()

    def _count_decision(
        self, pool: Pool, routed: RoutedRequest, decision: Decision, elapsed: float
    ) -> None:
        m = self.metrics
        m.routing_time.labels(pool.name).observe(elapsed)
        m.decisions.labels(pool.name, decision.policy, decision.reason).inc()
        if routed.block_hashes:
            m.prompt_blocks.labels(pool.name).inc(len(routed.block_hashes))
            m.predicted_hit_blocks.labels(pool.name).inc(decision.predicted_hit_blocks)
        self.recent.append(
            {
                "t": time.time(),
                "request_id": routed.request_id,
                "pool": pool.name,
                "prompt_tokens": routed.prompt_tokens,
                "blocks": len(routed.block_hashes),
                **decision.explain(),
            }
        )


def _why(decision: Decision) -> str:
    if not decision.filtered:
        return "the pool has no replicas"
    reasons = sorted(set(decision.filtered.values()))
    return "; ".join(reasons)


def _outcome(exc: Retryable) -> str:
    if exc.status is not None:
        return f"status_{exc.status}"
    if exc.reason.startswith("timeout"):
        return "timeout"
    return "connect_error" if exc.reason.startswith("connection") else "closed_early"


DRAIN_BYTES = 1 << 20  # an over-limit body this close to the limit is read and dropped, see below


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole request body, refusing (413) as soon as it passes `limit`; never buffered past it.

    A body that overshoots by at most DRAIN_BYTES is read on and dropped before the 413 goes out, so
    the client, still writing, can read the answer instead of a connection reset; a larger one is
    refused at once, unread.
    """
    declared = -1
    for k, v in scope["headers"]:
        if k == b"content-length":
            try:
                declared = int(v)
            except ValueError:
                raise BadRequest("Invalid Content-Length header") from None
            break
    if declared > limit + DRAIN_BYTES:
        raise PayloadTooLarge(f"Request body of {declared} bytes exceeds the {limit}-byte limit")
    parts: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ClientGone
        chunk = msg.get("body", b"")
        size += len(chunk)
        more = msg.get("more_body", False)
        if size > limit:
            await _drain(receive, more, size, limit)
            raise PayloadTooLarge(f"Request body exceeds the {limit}-byte limit")
        if not more and not parts:
            return chunk  # the usual case: the whole body in one message, no copy
        parts.append(chunk)
        if not more:
            return b"".join(parts)


async def _drain(receive: Receive, more: bool, size: int, limit: int) -> None:
    while more and size <= limit + DRAIN_BYTES:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ClientGone
        size += len(msg.get("body", b""))
        more = msg.get("more_body", False)
    if more:
        raise PayloadTooLarge(f"Request body exceeds the {limit}-byte limit")


async def send_error(send: Send, exc: GatewayError, close: bool = False) -> None:
    body = error_body(exc)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    headers.extend((k.encode(), v.encode()) for k, v in exc.headers().items())
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class ProxyEndpoint:
    """ASGI endpoint for one OpenAI path: reads the body, runs the pipeline, maps errors."""

    def __init__(self, gateway: Gateway, kind: Kind) -> None:
        self.gw = gateway
        self.kind = kind

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        t_in = time.perf_counter()
        gw = self.gw
        started = False

        async def tracked_send(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            raw = await read_body(scope, receive, gw.config.server.max_body_bytes)
        except ClientGone:
            return
        except GatewayError as exc:  # 413 (connection closed: the body may be left unread) or 400
            gw.metrics.errors.labels("none", exc.type).inc()
            gw.metrics.requests.labels("none", "none", str(exc.status)).inc()
            await send_error(send, exc, close=True)
            return

        task = asyncio.current_task()
        assert task is not None
        gone = False

        async def watch_disconnect() -> None:
            nonlocal gone
            msg = await receive()
            if msg["type"] == "http.disconnect" and not done:
                gone = True
                task.cancel()

        done = False
        watcher = asyncio.create_task(watch_disconnect())
        headers = dict(scope["headers"])
        try:
            await gw.handle(self.kind, raw, headers, tracked_send, t_in)
        except GatewayError as exc:
            gw.metrics.errors.labels("none", exc.type).inc()
            if not started:
                gw.metrics.requests.labels("none", "none", str(exc.status)).inc()
                await send_error(send, exc)
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()
        except Exception:
            log.exception("unexpected error on %s", scope.get("path"))
            if not started:
                await send_error(send, GatewayError("Internal gateway error"))
        finally:
            done = True
            watcher.cancel()
