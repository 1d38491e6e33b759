"""Send a routed request to its replicas in ranked order until one answers, and relay that answer.

A failed attempt (connect error, timeout or 502/503/504 before the first byte) is counted on its
replica and the next candidate is dispatched, up to the pool's `retries` (a failed trial of a
half-open replica does not use one up) and within `timeouts.total_s` for the whole request.
Nothing is retried once a byte has reached the client. Each dispatch's outcome goes back to its
replica, the policy and the index exactly once (`Dispatch`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson

from gateway.api.streams import StreamTap
from gateway.config import PoolConfig, TimeoutsConfig
from gateway.errors import (
    GatewayError,
    NoReplicaAvailable,
    ServerBusy,
    UpstreamError,
    UpstreamTimeout,
    sse_error_event,
)
from gateway.forwarding.outbound import Forwarded, Links, Outbound
from gateway.forwarding.relay import (
    Opened,
    Retryable,
    attempt_outcome,
    normalize_error_body,
    open_upstream,
    read_stream,
    relay_stream,
    response_headers,
    send_whole,
)
from gateway.forwarding.resume import (
    NoClient,
    Resumer,
    StreamResume,
    streamed_body,
    trigger_of,
    wants_ids,
    whole_answer,
    with_ids,
)
from gateway.routing.router import Dispatch
from gateway.transport.writer import ResponseWriter

if TYPE_CHECKING:
    from gateway.forwarding.lora_placement import LoraPlacement

class Failover:
    """The plain pool's forwarder: the ranked candidates in turn (a managed LoRA adapter loaded
    on each first, `LoraPlacement.place`) until one answers."""

    def __init__(self, links: Links, lora: LoraPlacement) -> None:
        self.gw = links
        self.lora = lora
        self.resumer = Resumer(links)

    async def forward(
        self, out: Outbound, first: Dispatch, writer: ResponseWriter, fwd: Forwarded
    ) -> Forwarded:
        """Try the ranked replicas in turn until one answers; never retry after the first byte."""
        gw, pc, req = self.gw, out.pool.config, out.req
        skipped: frozenset[str] = frozenset()  # replicas whose adapter load failed
        if pc.lora.manage:  # the adapter loaded on the pick (or the next placement) first
            first, skipped = await self.lora.place(
                gw.session, out.router, out.pool, out.routing, first, out.expose_errors,
                lambda: gw.notify_capacity(out.pool.name),  # a failed placement's slot is free
            )  # fmt: skip
        path = fwd.path = out.kind.path
        fwd.method = out.kind.method
        failures: list[tuple[str, Retryable]] = []
        fired: list[str] = []  # the timeout that ended each timed-out attempt
        deadline = time.monotonic() + pc.timeouts.total_s  # the whole request, retries included
        assert out.routing.decision is not None
        ranked = out.routing.decision.ranked
        if skipped:  # after the placement, the rest of the ranking but the failed loads
            placed = first.replica.name
            candidates = iter([n for n in ranked if n != placed and n not in skipped])
        else:
            candidates = iter(ranked[1:])
        retries = pc.retries
        attempt: Dispatch | None = first
        state = self.resumable(out)
        body = out.body
        stream = req.stream
        if state is not None and state.refused is None and wants_ids(req, pc.resume.engine):
            if req.stream:
                body = with_ids(body, req.body)  # the ids a resume continues from
            else:  # `resume.whole`: streamed from the engine, answered whole
                body, stream = streamed_body(orjson.loads(body)), True
        elif state is not None and not req.stream:
            state = None  # a whole answer resumes only by ids
        while attempt is not None:
            current = attempt
            name = current.replica.name
            fwd.tried.append(name)
            t_sent = time.perf_counter_ns()
            fwd.t_sent = fwd.t_sent or t_sent
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    fired.append("total_s")
                    await current.failed("timeout (total_s)")
                    break
                try:
                    opened = await open_upstream(
                        gw.upstream, current.replica.url, path, body, out.headers,
                        pc.timeouts, stream, left, gw.answers, out.answers_cap,
                        method=out.kind.method, json_answer=out.kind.json_answer,
                    )  # fmt: skip
                except ServerBusy:  # the gateway's own answer budget, not the replica's fault
                    await current.finished(True, True, None)
                    raise
                except Retryable as exc:
                    await current.failed(exc.reason, exc.busy)
                    failures.append((name, exc))
                    outcome = attempt_outcome(exc)
                    fwd.attempts.append(
                        (name, current.replica.url, t_sent, time.perf_counter_ns(), exc.status or 0, outcome)
                    )  # fmt: skip
                    spent = (time.perf_counter_ns() - t_sent) / 1e9
                    which = timeout_fired(exc.reason, pc.timeouts, req.stream, left, spent)
                    if which is not None:
                        fired.append(which)
                    gw.metrics.attempts.labels(out.pool.name, name, outcome).inc()
                    if current.view.circuit != "half_open":  # a failed trial uses no retry
                        retries -= 1
                    nxt = next(candidates, None) if retries >= 0 else None
                    attempt = await out.router.dispatch(out.pool, out.routing, nxt) if nxt else None
                    continue
                fwd.t_first = time.perf_counter_ns()
                fwd.replica, fwd.status = name, opened.status
                fwd.predicted_tokens, fwd.engine_block = current.receipt_inputs()
                fwd.attempts.append((name, current.replica.url, t_sent, 0, opened.status, None))
                current.prefilled()
                try:
                    await self.deliver(out, opened, writer, fwd, state, current)
                finally:
                    opened.free()  # the answer is with the client (or never will be)
                # a 4xx is the request's fault, not the replica's: only 5xx and broken streams
                # count (a stream resumed elsewhere broke here; a drained one did not)
                broke_here = fwd.outcome == "broken_mid_stream" or (
                    bool(fwd.resumes) and fwd.resumes[0][2] != "drain"
                )
                ok = opened.status < 500 and not broke_here
                # the replica's own TTFT (sent -> first byte), not the client's: no queue time in it
                ttft_s = (fwd.t_first - t_sent) / 1e9 if req.stream and fwd.status == 200 else None
                await current.finished(
                    ok, fwd.status == 200, ttft_s, f"upstream {fwd.outcome}", fwd.cached_tokens
                )
                return fwd
            finally:
                current.done()
                gw.notify_capacity(out.pool.name)
        fwd.error = _all_failed(failures, fired, pc, out.expose_errors)
        return fwd

    def resumable(self, out: Outbound) -> StreamResume | None:
        """The resume of a chat or completions request when its pool resumes (docs/resume.md):
        a stream's; a non-streamed one's with `resume.whole`."""
        req, cfg = out.req, out.pool.config.resume
        if not cfg.enabled or out.kind.name not in ("chat", "completions"):
            return None
        if not req.stream and not cfg.whole:
            return None
        return StreamResume(cfg, req, asked_ids=req.body.get("return_token_ids") is True)

    async def deliver(
        self, out: Outbound, opened: Opened, writer: ResponseWriter, fwd: Forwarded,
        state: StreamResume | None = None, current: Dispatch | None = None,
    ) -> None:  # fmt: skip
        """Relay the chosen replica's answer and read its usage; a stream that breaks mid-way
        resumes on another replica when it can (`state`)."""
        status = opened.status
        extra = out.answer_headers()
        if status != 200:
            body, kind = normalize_error_body(status, opened.first, out.expose_errors)
            await send_whole(opened, writer, extra, body)
            fwd.outcome, fwd.error_type = "upstream_error", kind
            fwd.t_last = time.perf_counter_ns()
            return
        usage: Any
        row = out.kind
        learn = out.learn
        if not out.req.stream and state is not None:  # streamed from the engine: whole here
            usage = await self._whole(out, opened, writer, fwd, state, current)
        elif out.req.stream:
            strip = not out.req.include_usage
            tap = row.tap(strip) if state is None or state.refused else state.tap(strip)
            early = None if learn is None else _learn_early(tap, fwd, learn)
            if state is not None and current is not None:
                state.watch(current.replica, opened.resp, out.pool)
            try:
                broke = await relay_stream(
                    opened, writer, extra, tap, early, live=self.gw.live_streams,
                    keep_open=state is not None,
                )  # fmt: skip
            finally:
                if state is not None:
                    state.unwatch()
            fwd.t_last = time.perf_counter_ns()
            usage = tap.usage
            if broke is not None and state is not None:
                broke, usage = await self._resume(out, state, tap, broke, writer, fwd)
            if broke is not None:
                fwd.outcome, fwd.error_type = "broken_mid_stream", broke.type
            learned, fwd.answer_id = fwd.answer_id, getattr(tap, "answer_id", None)
            if learn is not None and learned is None and fwd.answer_id is not None:
                await learn(fwd.answer_id, fwd.replica)  # its id came after the first chunk
        else:
            if row.sticky and opened.parsed is not None:
                rid = opened.parsed.get("id")
                fwd.answer_id = rid if isinstance(rid, str) else None
                if learn is not None and fwd.answer_id is not None:
                    await learn(fwd.answer_id, fwd.replica)
            await send_whole(opened, writer, extra)
            fwd.t_last = time.perf_counter_ns()
            usage = row.usage(opened.parsed) if opened.parsed is not None else None
        if isinstance(usage, dict):
            fwd.input_tokens, fwd.output_tokens, fwd.cached_tokens = row.counts(usage)
            if fwd.resumes:  # the first replica never told its cache: its receipt is unreported
                fwd.cached_tokens = None


    async def _resume(
        self, out: Outbound, state: StreamResume, tap: StreamTap, broke: GatewayError,
        writer: ResponseWriter, fwd: Forwarded,
    ) -> tuple[GatewayError | None, Any]:  # fmt: skip
        """Resume a stream that broke (the client's still open): the error it ends with (None:
        it ended properly) and the answer's usage."""
        failed = fwd.replica
        if self.gw.live_streams.closing:  # the gateway is going down: no new upstream now
            still: GatewayError | None = broke
        else:
            trigger = trigger_of(broke, tap.broken, state.drained)
            if fwd.attempts:  # the attempt that broke ends here, broken
                name, url, t0, _, status, _ = fwd.attempts[-1]
                fwd.attempts[-1] = (name, url, t0, fwd.t_last, status, "broken_mid_stream")
            still = await self.resumer.resume(
                out, state, broke, trigger, writer, fwd, failed, tap.last_ns or time.time_ns()
            )
        await writer.end(sse_error_event(still) if still is not None else b"")
        return still, state.ledger.usage if still is None else tap.usage


    async def _whole(
        self, out: Outbound, opened: Opened, writer: ResponseWriter, fwd: Forwarded,
        state: StreamResume, current: Dispatch | None,
    ) -> Any:  # fmt: skip
        """A non-streamed answer the engine streams (`resume.whole`): collected into the
        ledger, resumed on another replica if it breaks, then answered whole; its usage."""
        tap = state.tap(strip_usage=True)
        if current is not None:
            state.watch(current.replica, opened.resp, out.pool)
        try:
            broke = await read_stream(opened.resp, tap, None, opened.first, what="answer")
        finally:
            state.unwatch()
        fwd.t_last = time.perf_counter_ns()
        if broke is not None:
            trigger = trigger_of(broke, tap.broken, state.drained)
            if fwd.attempts:
                name, url, t0, _, status, _ = fwd.attempts[-1]
                fwd.attempts[-1] = (name, url, t0, fwd.t_last, status, "broken_mid_stream")
            broke = await self.resumer.resume(
                out, state, broke, trigger, NoClient(), fwd, fwd.replica,  # type: ignore[arg-type]
                tap.last_ns or time.time_ns(),
            )
        if broke is not None:
            fwd.outcome, fwd.error_type = "broken_mid_stream", broke.type
            fwd.error = broke  # nothing reached the client: the pipeline answers the error
            return None
        headers = [(k, v) for k, v in response_headers(opened.resp, out.answer_headers())
                   if k != b"content-type"]  # fmt: skip
        headers.append((b"content-type", b"application/json"))
        await writer.whole(200, headers, whole_answer(state.ledger))
        fwd.t_last = time.perf_counter_ns()
        return state.ledger.usage


def _learn_early(
    tap: Any, fwd: Forwarded, learn: Callable[[str, str], Awaitable[None]]
) -> Callable[[], Awaitable[None]]:
    """What runs once a sticky stream's first chunk is on its way: its answer id (the
    `response.created` event) learned, before the client can continue it."""

    async def early() -> None:
        fwd.answer_id = getattr(tap, "answer_id", None)
        if fwd.answer_id is not None:
            await learn(fwd.answer_id, fwd.replica)

    return early


def _all_failed(
    failures: list[tuple[str, Retryable]], fired: list[str], pc: PoolConfig, expose: bool
) -> GatewayError:
    """The error for a request no attempted replica answered: 504 naming the timeouts that fired;
    503 with Retry-After when every replica answered 503 (all overloaded); else 502. Which
    replicas were tried and why each failed (hosts in connect errors) only with `expose`."""
    detail = "; ".join(f"{name}: {exc.reason}" for name, exc in failures) if expose else ""
    n = len(failures)
    attempts = f"{n} attempt{'' if n == 1 else 's'}"
    if fired:
        limits = ", ".join(f"{t} ({getattr(pc.timeouts, t):g} s)" for t in dict.fromkeys(fired))
        return UpstreamTimeout(
            f"No replica answered in time: {limits} ran out ({attempts}). {detail}".strip()
        )
    if n and all(exc.status == 503 for _, exc in failures):
        return NoReplicaAvailable(
            f"Every attempted replica is overloaded (503, {attempts}); retry later. {detail}".strip(),
            code="replicas_overloaded",
            retry_after=pc.health.interval_s,
        )
    return UpstreamError(f"All {n} attempted replicas failed. {detail}".strip())


_TIMEOUTS = ("connect_s", "first_byte_s", "idle_s", "total_s")
_EARLY_S = 0.005  # timers fire a little early or late; `spent` also counts the send


def timeout_fired(
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
