"""The ASGI endpoint for a proxied path (one per endpoint kind, `gateway/api/kinds.py`): check the
key, read the body, run the pipeline, answer errors once.

The API key is checked before a byte of the body is read, and the whole body must arrive within
`server.body_timeout_s`; the bytes of all bodies held at once are capped (`BodyBudget`). A client
that disconnects cancels the request at once (its upstream socket is closed, so the engine
aborts), and every request is recorded exactly once, whatever happened to it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import nullcontext
from typing import Protocol

from gateway.api.kinds import EndpointKind
from gateway.errors import (
    BadRequest,
    GatewayError,
    PayloadTooLarge,
    RequestTimeout,
    error_body,
)
from gateway.limits.budgets import BodyBudget, shutting_down
from gateway.limits.tenants import Tenant
from gateway.pipeline.record import Ended, Record, request_id
from gateway.pipeline.steps import Pipeline, RawHeaders
from gateway.runtime.snapshot import Snapshot
from gateway.transport import delays
from gateway.transport.protocol import body_buffered
from gateway.transport.writer import ResponseWriter
from gateway.types import Receive, Scope, Send

log = logging.getLogger("gateway")

WATCH_AFTER_S = 0.02  # a client that leaves is noticed within this long (then at once)...
WATCH_TICK_S = 0.01  # ...or this much later
DRAIN_BYTES = 1 << 20  # an over-limit body this close to the limit is read and dropped, see below
REFUSED_DRAIN_S = 1.0  # the most time spent dropping the body of a request refused before it


class ClientGone(Exception):
    """The client disconnected before its request body was read."""


def declared_length(scope: Scope) -> int:
    """The Content-Length header, -1 when there is none (chunked); 400 when it is not a number."""
    for k, v in scope["headers"]:
        if k == b"content-length":
            try:
                return int(v)
            except ValueError:
                raise BadRequest("Invalid Content-Length header") from None
    return -1


async def read_body(
    scope: Scope,
    receive: Receive,
    limit: int,
    timeout_s: float = 30.0,
    budget: BodyBudget | None = None,
    cap: int | None = None,
) -> bytes:
    """The whole request body, refusing (413) as soon as it passes `limit`; never buffered past it.

    `timeout_s` is the deadline for the whole body, not for each piece: a client trickling a byte
    at a time is let go (408) as surely as one that stops. With a `budget`, the body's bytes are
    charged to it as they arrive (503 past `cap`) and stay charged once it is returned: the caller
    releases `len(body)` when the request is done; on any error they are released here.

    A body that overshoots by at most DRAIN_BYTES is read on and dropped before the 413 goes out, so
    the client, still writing, can read the answer instead of a connection reset; a larger one is
    refused at once, unread.
    """
    declared = declared_length(scope)
    if declared > limit + DRAIN_BYTES:
        raise PayloadTooLarge(f"Request body of {declared} bytes exceeds the {limit}-byte limit")
    if budget is not None and declared > 0:
        budget.check(declared, cap)  # a body that cannot fit now is refused before it is read
    taken = 0
    try:
        parts: list[bytes] = []
        size = 0
        # a client too slow to send it is let go; a body already in needs no deadline
        deadline = nullcontext() if body_buffered(receive) else asyncio.timeout(timeout_s)
        try:
            async with deadline:
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        raise ClientGone
                    chunk: bytes = msg.get("body", b"")
                    size += len(chunk)
                    more = msg.get("more_body", False)
                    if size > limit:
                        await _drain(receive, more, size, limit)
                        raise PayloadTooLarge(f"Request body exceeds the {limit}-byte limit")
                    if budget is not None and chunk:
                        budget.take(len(chunk), cap)
                        taken += len(chunk)
                    if not more and not parts:
                        return chunk  # the usual case: the whole body in one message, no copy
                    parts.append(chunk)
                    if not more:
                        return b"".join(parts)
        except TimeoutError:
            raise RequestTimeout(
                f"The request body did not arrive within {timeout_s:g} s"
            ) from None
    except BaseException:
        if budget is not None:
            budget.release(taken)
        raise


async def _drain(receive: Receive, more: bool, size: int, limit: int) -> None:
    while more and size <= limit + DRAIN_BYTES:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ClientGone
        size += len(msg.get("body", b""))
        more = msg.get("more_body", False)
    if more:
        raise PayloadTooLarge(f"Request body exceeds the {limit}-byte limit")


async def discard_body(scope: Scope, receive: Receive, within_s: float) -> bool:
    """Read and drop a refused request's body, if it is small and quick, so that the client can
    read the refusal rather than a connection reset; give up past DRAIN_BYTES or `within_s`.
    True when the whole body was read (the connection can be kept).

    Nothing is kept. A client that waits for `100 Continue` is not invited to send its body.
    """
    for k, v in scope["headers"]:
        if k == b"expect" and v.lower() == b"100-continue":
            return False
    try:
        if declared_length(scope) > DRAIN_BYTES:
            return False
    except BadRequest:
        return False
    size = 0
    try:
        async with asyncio.timeout(within_s):
            while size <= DRAIN_BYTES:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return False
                size += len(msg.get("body", b""))
                if not msg.get("more_body", False):
                    return True
    except TimeoutError:
        pass
    return False


async def send_error(writer: ResponseWriter, exc: GatewayError, close: bool = False) -> None:
    """The error's OpenAI-shaped answer (`close`: and the connection's end)."""
    headers = [(b"content-type", b"application/json")]
    headers.extend((k.encode(), v.encode()) for k, v in exc.headers().items())
    await writer.whole(exc.status, headers, error_body(exc), close=close)


class _Watch:
    """Cancels a request's task when its client disconnects, from WATCH_AFTER_S into it on (a
    task reading `receive`); the many requests that end before never start one."""

    __slots__ = ("receive", "task", "watcher", "done", "gone")

    def __init__(self, receive: Receive, task: asyncio.Task[object]) -> None:
        self.receive, self.task = receive, task
        self.watcher: asyncio.Task[None] | None = None
        self.done = self.gone = False

    def start(self) -> None:
        if not self.done:
            self.watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        msg = await self.receive()
        if msg["type"] == "http.disconnect" and not self.done:
            self.gone = True
            self.task.cancel()

    def stop(self) -> None:
        self.done = True
        if self.watcher is not None:
            self.watcher.cancel()


class Run(Protocol):
    """What runs a request once its key is checked and its body read (`Pipeline.handle`)."""

    async def __call__(
        self, snap: Snapshot, kind: EndpointKind, raw: bytes, headers: RawHeaders, tenant: Tenant,
        writer: ResponseWriter, rec: Record, /,
    ) -> None: ...  # fmt: skip


class ProxyEndpoint:
    def __init__(
        self, pipeline: Pipeline, kind: EndpointKind, bodies: BodyBudget, run: Run | None = None
    ) -> None:
        """`run`: what serves the request once its body is read; the pipeline's steps unless
        given (`/v1/responses/{id}`'s by-id forward)."""
        self.pipeline = pipeline
        self.kind = kind
        self.bodies = bodies
        self.run: Run = pipeline.handle if run is None else run
        self._watching: delays.FixedDelay | None = None  # the loop's WATCH_AFTER_S deadlines

    async def refuse(self, send: Send, exc: GatewayError) -> None:
        """Answer `exc` without reading the body (full request slots), recorded like any request."""
        snap = self.pipeline.gw.current
        rec = Record(time.perf_counter_ns(), snapshot=snap.version, request_id=request_id({}),
                     path=self.kind.path.decode())
        await self.pipeline.finish(snap, rec, exc)
        await send_error(ResponseWriter(send), exc, close=True)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pipeline = self.pipeline
        snap = pipeline.gw.current  # the one snapshot this request runs on, start to end
        headers = dict(scope["headers"])
        # the id first: a request refused before its body is read is logged under it too
        rec = Record(
            time.perf_counter_ns(), snapshot=snap.version, request_id=request_id(headers),
            path=scope["path"],
        )  # fmt: skip
        tracing = pipeline.gw.tracing
        if tracing.enabled:
            rec.trace = tracing.start(headers, time.time_ns())
        server = snap.config.server
        try:
            # the key first: a client without one gets no memory and no time for its body
            tenant = snap.tenants.identify(headers.get(b"authorization"))
            rec.tenant = tenant.name
        except GatewayError as exc:
            await pipeline.finish(snap, rec, exc)
            read = await discard_body(scope, receive, min(REFUSED_DRAIN_S, server.body_timeout_s))
            await send_error(ResponseWriter.current(send), exc, close=not read)
            return
        try:
            raw = await read_body(
                scope,
                receive,
                server.max_body_bytes,
                server.body_timeout_s,
                self.bodies,
                server.max_body_bytes_in_flight,
            )
        except ClientGone:
            await pipeline.finish(snap, rec, None, ("client_disconnected", None))
            return
        except GatewayError as exc:  # 413, 408, 503 or a bad Content-Length: the rest is unread
            await pipeline.finish(snap, rec, exc)
            await send_error(ResponseWriter(send), exc, close=True)
            return
        try:
            await self._handle(snap, scope, receive, send, raw, headers, tenant, rec)
        finally:
            self.bodies.release(len(raw))

    async def _handle(
        self, snap: Snapshot, scope: Scope, receive: Receive, send: Send, raw: bytes,
        headers: RawHeaders, tenant: Tenant, rec: Record,
    ) -> None:  # fmt: skip
        pipeline = self.pipeline
        writer = ResponseWriter.current(send)  # the one way this request's answer leaves
        task = asyncio.current_task()
        assert task is not None
        watch = _Watch(receive, task)
        watching = self._watching
        if watching is None or watching.loop is not task.get_loop():
            watching = self._watching = delays.shared(task.get_loop(), WATCH_AFTER_S, WATCH_TICK_S)
        watching.arm(watch, watch.start)  # most requests end before: no watcher task for them
        error: GatewayError | None = None
        ended: Ended | None = None  # how it ended, when neither an error nor the forwarder says
        try:
            await self.run(snap, self.kind, raw, headers, tenant, writer, rec)
        except GatewayError as exc:
            error = exc
            if not writer.started:
                await send_error(writer, exc)
        except asyncio.CancelledError:
            if not watch.gone:  # the server cancelled it: its graceful shutdown ran out
                await self._cancelled(snap, writer, rec)
                raise
            task.uncancel()
            ended = ("client_disconnected", "client_disconnected")
        except Exception:
            log.exception("unexpected error on %s", scope.get("path"))
            error = GatewayError("Internal gateway error")
            if not writer.started:
                await send_error(writer, error)
        finally:
            watching.disarm(watch)
            watch.stop()
        await pipeline.finish(snap, rec, error, ended)

    async def _cancelled(self, snap: Snapshot, writer: ResponseWriter, rec: Record) -> None:
        """The request's task was cancelled by the server (its graceful shutdown ran out): the
        client still gets one answer (a 503 when nothing of one was sent; uvicorn would send a
        plain-text 500) and the request its line in the request log."""
        error = shutting_down()
        started = writer.started
        # the answer began: it ends cut short; else the client gets the error
        ended: Ended | None = ("broken_mid_stream", error.type) if started else None
        try:
            if not started:
                await send_error(writer, error, close=True)
        finally:
            await self.pipeline.finish(snap, rec, None if started else error, ended)
