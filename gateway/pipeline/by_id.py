"""`GET` and `DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`: sent to the replica
that made the response (this gateway's map of response homes, else the fleet's: gateway/routing/sticky.py)
and answered as that replica answers.

The same key, limits (one request, no tokens) and request log as every proxied path; no admission
queue (they load no engine) and no failover (no other replica holds the response). An id no
gateway knows, or whose replica left the pool: an OpenAI-shaped 404 `response_not_found`; a 404
of the home replica (it no longer holds it) is answered with that same body, so one situation
reads the same through every gateway. A DELETE the replica answered 200, or any 404 of the
replica, forgets the id. Bodies go on as they came; the query string does not, as with `passthrough:` paths.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from gateway.api.kinds import EndpointKind, passthrough_kind
from gateway.errors import (
    GatewayError,
    NoReplicaAvailable,
    NotFound,
    UpstreamError,
    UpstreamTimeout,
)
from gateway.forwarding.outbound import upstream_headers
from gateway.forwarding.relay import (
    Retryable,
    attempt_outcome,
    normalize_error_body,
    open_upstream,
    send_whole,
)
from gateway.pipeline.record import Record
from gateway.pipeline.steps import Pipeline, RawHeaders

if TYPE_CHECKING:
    from gateway.limits.tenants import Tenant
    from gateway.runtime.snapshot import Snapshot
    from gateway.transport.writer import ResponseWriter

PREFIX = "/v1/responses/"
# a route name -> its kind (what the request log and traces call its method)
KINDS: dict[str, EndpointKind] = {
    "GET": passthrough_kind(b"GET", PREFIX),
    "DELETE": passthrough_kind(b"DELETE", PREFIX),
    "cancel": passthrough_kind(b"POST", PREFIX),
}


def response_route(method: str, path: str) -> str | None:
    """`GET` or `DELETE` for `/v1/responses/{id}`, `cancel` for a POST to
    `/v1/responses/{id}/cancel`; None for anything else (Starlette answers it: 404, or 405 for
    another method on these paths; its routes match ids as this does, without a slash)."""
    rest = path[len(PREFIX) :]
    if rest.endswith("/cancel"):
        rid, route = rest[:-7], "cancel" if method == "POST" else None
    else:
        rid, route = rest, method if method in ("GET", "DELETE") else None
    return route if rid and "/" not in rid else None


def response_id(path: str) -> str:
    rest = path[len(PREFIX) :]
    return rest[:-7] if rest.endswith("/cancel") else rest


async def by_id(
    pipeline: Pipeline, snap: Snapshot, kind: EndpointKind, raw: bytes, headers: RawHeaders,
    tenant: Tenant, writer: ResponseWriter, rec: Record,
) -> None:  # fmt: skip
    """Forward one by-id request to the response's home replica and relay its answer."""
    rid = response_id(rec.path)
    rec.priority = tenant.priority
    req = kind.parse(raw, headers.get(b"content-type"))
    rec.charged, extra = await pipeline.limit(snap, tenant, req, 0)  # every lookup counts
    found = await pipeline.homes.locate(rid, snap.pools)
    if found is None:
        raise not_found(rid)
    pool, replica = found
    rec.pool = pool.name
    extra.append((b"x-request-id", rec.request_id.encode("latin-1")))
    fwd = rec.sent
    fwd.path, fwd.method = rec.path.encode("latin-1"), kind.method
    pc, server = pool.config, snap.config.server
    gw = pipeline.gw
    fwd.tried.append(replica.name)
    fwd.t_sent = time.perf_counter_ns()
    try:
        opened = await open_upstream(
            gw.upstream, replica.url, fwd.path, raw,
            upstream_headers(pool, rec.request_id, rec.trace, headers.get(b"content-type")), pc.timeouts, False,
            pc.timeouts.total_s, gw.answers, server.max_answer_bytes_in_flight,
            method=kind.method, json_answer=False,
        )  # fmt: skip
    except Retryable as exc:
        replica.failed(exc.reason, exc.busy)
        outcome = attempt_outcome(exc)
        fwd.attempts.append(
            (replica.name, replica.url, fwd.t_sent, time.perf_counter_ns(), exc.status or 0, outcome)
        )  # fmt: skip
        gw.metrics.attempts.labels(pool.name, replica.name, outcome).inc()
        raise _failed(
            exc, replica.name, rid, server.expose_upstream_errors, pc.health.interval_s
        ) from None
    fwd.t_first = time.perf_counter_ns()
    fwd.replica, fwd.status = replica.name, opened.status
    fwd.attempts.append((replica.name, replica.url, fwd.t_sent, 0, opened.status, None))
    gone = opened.status == 404
    try:
        if (opened.status == 200 and kind.method == b"DELETE") or gone:
            await pipeline.homes.forget(rid)  # deleted, or gone from its replica (evicted)
        if opened.status == 200:
            await send_whole(opened, writer, extra)
        elif gone:  # answered below as any gateway answers once the id is forgotten
            opened.resp.release()
            fwd.outcome, fwd.error_type = "upstream_error", NotFound.type
        else:
            body, error_type = normalize_error_body(
                opened.status, opened.first, server.expose_upstream_errors
            )
            await send_whole(opened, writer, extra, body)
            fwd.outcome, fwd.error_type = "upstream_error", error_type
    finally:
        opened.free()
    fwd.t_last = time.perf_counter_ns()
    if opened.status < 500:
        replica.succeeded()
    else:
        replica.failed(f"upstream status {opened.status}")
    if gone:
        raise not_found(rid)


def not_found(rid: str) -> NotFound:
    """The one answer for a response no replica of the fleet holds now, whichever gateway is
    asked and whether it still knew the replica (that replica's own 404) or not."""
    return NotFound(
        f"Response with id '{rid[:64]}' not found: no gateway of this fleet knows which "
        "replica made it (unknown, expired, deleted, or its replica left the pool).",
        param="response_id", code="response_not_found",
    )  # fmt: skip


def _failed(
    exc: Retryable, replica: str, rid: str, expose: bool, retry_after: float
) -> GatewayError:
    """The answer for a home replica that did not answer: 504 on a timeout, 503 when it was
    overloaded or unreachable (the response lives there only: retry later), else 502."""
    where = f" ({replica}: {exc.reason})" if expose else ""
    what = f"The replica holding response '{rid[:64]}'"
    if exc.reason.startswith("timeout"):
        return UpstreamTimeout(f"{what} did not answer in time{where}")
    if exc.status == 503 or exc.reason.startswith("connection"):
        return NoReplicaAvailable(
            f"{what} is unavailable now; retry later{where}", retry_after=retry_after
        )
    return UpstreamError(f"{what} failed{where}")
