"""The request as it goes to the replicas (`Outbound`: the body as sent on, the headers both
ways) and what forwarding it did (`Forwarded`, filled in as it goes): what the pipeline hands a
forwarder (`Failover`, `PdForwarder`) and what the recorder reads back."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import orjson

from gateway.api.kinds import EndpointKind
from gateway.api.openai import ParsedRequest
from gateway.fleet.pools import Pool
from gateway.forwarding.relay import with_stream_usage
from gateway.routing.router import Router, Routing, cache_salt, decision_header
from gateway.types import Headers

if TYPE_CHECKING:
    from gateway.errors import GatewayError
    from gateway.limits.budgets import AnswerBudget, LiveStreams
    from gateway.telemetry.metrics import Metrics
    from gateway.telemetry.tracing import RequestTrace
    from gateway.transport.client import HttpClient
    from gateway.transport.control import ControlClient


class Links(Protocol):
    """What a forwarder sends with and reports to: the parts of the gateway that outlive
    snapshots (gateway/runtime/gateway.py's `Gateway` is one), read at each request."""

    @property
    def upstream(self) -> HttpClient: ...  # the request path's client

    @property
    def session(self) -> ControlClient: ...  # the control client (LoRA loads)

    @property
    def answers(self) -> AnswerBudget: ...  # answer bytes held

    @property
    def live_streams(self) -> LiveStreams: ...  # the streams a shutdown ends

    @property
    def metrics(self) -> Metrics: ...

    def notify_capacity(self, pool: str) -> None: ...  # wake the pool's admission queue


@dataclass(slots=True)
class Outbound:
    """The request as it goes to the replicas, and the headers its answer gets."""

    router: Router  # the request's snapshot's (failover dispatches through it)
    pool: Pool
    req: ParsedRequest
    routing: Routing
    body: bytes  # as sent on (gateway fields set)
    headers: Headers  # to the replica
    extra: Headers  # to the client, on the answer
    expose_errors: bool  # server.expose_upstream_errors
    answers_cap: int | None  # server.max_answer_bytes_in_flight
    kind: EndpointKind  # the endpoint's row: upstream path and method, stream tap, usage
    # a sticky kind's answer id and the replica that made it, learned before the client can
    # send a follow-up (a whole answer before it is sent, a stream at its first chunk)
    learn: Callable[[str, str], Awaitable[None]] | None = None
    explain: bool = False  # the answer carries x-gateway-decision (the decision as it was sent)

    def answer_headers(self) -> Headers:
        """The headers the client's answer gets besides the replica's."""
        if not self.explain:
            return self.extra
        return [*self.extra, decision_header(self.routing)]


@dataclass(slots=True)
class Forwarded:
    """What forwarding did, filled in as it goes (so a client that leaves mid-way still has it
    recorded). `error`: every attempt failed (nothing reached the client)."""

    tried: list[str] = field(default_factory=list)
    replica: str = "none"
    status: int = 0
    outcome: str = "ok"  # ok | upstream_error | broken_mid_stream
    error_type: str | None = None
    t_sent: int = 0  # perf_counter_ns of the first attempt
    t_first: int = 0  # the answer's first byte
    t_last: int = 0  # its last byte
    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    # the route receipt's inputs (gateway/telemetry/receipt.py): the index's hit on the replica that
    # answered, in the gateway's tokens (None: the pool's policy does not hash), and the engine's
    # KV block in tokens as it last reported it (None: not scraped)
    predicted_tokens: int | None = None
    engine_block: int | None = None
    answer_id: str | None = None  # a sticky kind's answer id (`/v1/responses`: the response's)
    error: GatewayError | None = None
    path: bytes = b""  # the upstream path and method (the client's, for every proxied kind)
    method: bytes = b"POST"
    # one per attempt that went on the wire, in order, for its trace span: (replica, its URL,
    # t_start, t_end (0: the answer's, t_last), status (0: none), the failover outcome of
    # gateway_upstream_attempts_total (None: this replica answered))
    attempts: list[tuple[str, str, int, int, int, str | None]] = field(default_factory=list)
    # each resume (gateway/forwarding/resume.py): the replica that continued, the token offset it
    # resumed at, what set it off, its outcome; and the gap each cost the client (s)
    resumes: list[tuple[str, int, str, str]] = field(default_factory=list)
    resume_gaps: list[float] = field(default_factory=list)
    pd_prefill: tuple[int, int] = (0, 0)  # a P/D request's prefill leg that served (gateway/forwarding/pd.py)



def upstream_headers(
    pool: Pool, request_id: str, trace: RequestTrace | None, content_type: bytes | None = None
) -> Headers:
    """The headers to the replica: the request id, the pool's key, the trace's context.
    `content_type`: the client's, for a body sent on as it came (multipart, passthrough)."""
    out = [
        (b"content-type", content_type or b"application/json"),
        (b"accept-encoding", b"identity"),
        (b"x-request-id", request_id.encode("latin-1")),
    ]
    key = pool.config.upstream_api_key
    if key is not None:
        out.append((b"authorization", b"Bearer " + key.get_secret_value().encode()))
    if trace is not None:
        out.append((b"traceparent", trace.traceparent_bytes()))
        if trace.trace_state:  # only an incoming trace's, forwarded
            state = trace.tracestate()
            if state:
                out.append((b"tracestate", state.encode()))
    return out


def upstream_body(
    req: ParsedRequest, engine_priority: int | None, tenant_salt: str | None,
    fields: frozenset[str] = frozenset({"cache_salt", "priority"}),
) -> bytes:  # fmt: skip
    """The body as sent on: unchanged bytes unless the gateway must add or remove a field.
    `engine_priority`: the vLLM priority of the request's class, when the gateway forwards it
    (`admission.forward_priority`); `fields`: the engine fields the gateway may set for this
    kind (none: the body goes as it came)."""
    if not fields:
        return req.raw
    changes: dict[str, object] = {}
    if tenant_salt is not None and "cache_salt" in fields:  # the engine keeps this tenant's KV apart
        changes["cache_salt"] = cache_salt(req, tenant_salt)
    if "priority" in req.body:
        # the engine's priority is the gateway's to set: a class name is ours, and a client's
        # integer would jump the engine's queue past the class the gateway gave it
        changes["priority"] = None
    if engine_priority is not None:
        changes["priority"] = engine_priority
    if req.stream and not req.include_usage:
        if not changes:  # for our accounting; stripped on the way out
            return with_stream_usage(req.raw, req.body)
        changes["stream_options"] = {**(req.body.get("stream_options") or {}), "include_usage": True}
    if not changes:
        return req.raw
    merged = {**req.body, **changes}
    return orjson.dumps({k: v for k, v in merged.items() if v is not None or k not in changes})
