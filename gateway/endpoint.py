"""The ASGI endpoint for an OpenAI proxy path: read the body, run the pipeline, answer errors once.

A client that disconnects cancels the request at once (its upstream socket is closed, so the engine
aborts), and every request is recorded exactly once, whatever happened to it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from .errors import BadRequest, GatewayError, PayloadTooLarge, RequestTimeout, error_body
from .openai import Kind
from .pipeline import Ctx, Pipeline

log = logging.getLogger("gateway")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

WATCH_AFTER_S = 0.02  # a client that leaves is noticed within this long (then at once)
DRAIN_BYTES = 1 << 20  # an over-limit body this close to the limit is read and dropped, see below


class ClientGone(Exception):
    """The client disconnected before its request body was read."""


async def read_body(scope: Scope, receive: Receive, limit: int, timeout_s: float = 30.0) -> bytes:
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
        try:
            async with asyncio.timeout(timeout_s):  # a client that stops sending is let go
                msg = await receive()
        except TimeoutError:
            raise RequestTimeout(f"No request body data for {timeout_s:g} s") from None
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
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers.extend((k.encode(), v.encode()) for k, v in exc.headers().items())
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class ProxyEndpoint:
    def __init__(self, pipeline: Pipeline, kind: Kind) -> None:
        self.pipeline = pipeline
        self.kind = kind

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctx = Ctx(time.perf_counter_ns())
        pipeline = self.pipeline
        headers = dict(scope["headers"])
        tracing = pipeline.gw.tracing
        if tracing.enabled:
            ctx.trace = tracing.start(headers, time.time_ns())
        try:
            server = pipeline.gw.config.server
            raw = await read_body(scope, receive, server.max_body_bytes, server.body_timeout_s)
        except ClientGone:
            ctx.outcome = "client_disconnected"
            await pipeline.finish(ctx, None)
            return
        except GatewayError as exc:  # 413 or a bad Content-Length: the rest of the body is unread
            await pipeline.finish(ctx, exc)
            await send_error(send, exc, close=True)
            return

        started = False

        async def tracked_send(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            started = True
            await send(message)

        task = asyncio.current_task()
        assert task is not None
        state = {"done": False, "gone": False}

        async def watch_disconnect() -> None:
            msg = await receive()
            if msg["type"] == "http.disconnect" and not state["done"]:
                state["gone"] = True
                task.cancel()

        # most requests finish before this fires: no watcher task for them at all
        watchers: list[asyncio.Task[None]] = []
        timer = asyncio.get_running_loop().call_later(
            WATCH_AFTER_S, lambda: watchers.append(asyncio.ensure_future(watch_disconnect()))
        )
        error: GatewayError | None = None
        try:
            await pipeline.handle(self.kind, raw, headers, tracked_send, ctx)
        except GatewayError as exc:
            error = exc
            if not started:
                await send_error(send, exc)
        except asyncio.CancelledError:
            if not state["gone"]:
                raise
            task.uncancel()
            ctx.outcome, ctx.error_type = "client_disconnected", "client_disconnected"
        except Exception:
            log.exception("unexpected error on %s", scope.get("path"))
            error = GatewayError("Internal gateway error")
            if not started:
                await send_error(send, error)
        finally:
            state["done"] = True
            timer.cancel()
            for w in watchers:
                w.cancel()
        await pipeline.finish(ctx, error)
