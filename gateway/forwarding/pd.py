"""A disaggregated (prefill/decode) pool's request, on the pair routing chose (`Router.choose`: a
`PdDispatch`): run the legs the engines' protocol asks for, relay the decode replica's answer
(docs/pd.md).

`vllm-nixl` (serial; ../shared/reference/pd-lora-tiers.md §1.2-1.6): the prefill leg is the
client's body, non-streamed, `max_tokens: 1`, no `stream_options`/`min_tokens`, with
`kv_transfer_params.do_remote_decode: true`; its answer's `kv_transfer_params` go, unchanged,
into the original body for the decode leg, whose answer is relayed byte for byte. Both legs carry
the same `X-Request-Id`. A null `kv_transfer_params` is a 502 (never a silent local recompute).

`sglang` (concurrent; §2.3-2.4): the same body to both with `bootstrap_host` (the prefill
replica's host), `bootstrap_port` (its set's `bootstrap_port`, else null) and a random
`bootstrap_room`; the decode's answer is the client's. Either leg failing first cancels the other.

Failure rules: a prefill that fails before any byte moves to the next prefill replica; a decode
that fails before any byte moves to the next decode replica with a fresh prefill; a client that
leaves cancels the request task, which closes whichever leg's socket is open (the engine aborts
it); nothing is retried once a byte reached the client.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import orjson

from gateway.errors import UpstreamError
from gateway.forwarding.failover import Failover, _all_failed
from gateway.forwarding.outbound import Forwarded, Links, Outbound
from gateway.forwarding.relay import Opened, Retryable, attempt_outcome, open_upstream
from gateway.routing.router import Dispatch, PdDispatch
from gateway.telemetry.pd_metrics import PdMetrics
from gateway.transport.writer import ResponseWriter

if TYPE_CHECKING:
    from gateway.fleet.pools import Pool

PD_KINDS = frozenset(
    {"chat", "completions"}
)  # what a P/D pool disaggregates (the rest: decode set)
PREFILL_KV = {  # what the prefill leg's kv_transfer_params are (the reference proxies agree, §1.3)
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}  # fmt: skip


@dataclass(slots=True)
class _Leg:
    """The request as both legs need it."""

    out: Outbound  # the decode leg's (deliver() relays through it)
    base: dict[str, Any]  # the body as the aggregated path would send it, parsed
    fwd: Forwarded
    deadline: float
    failures: list[tuple[str, Retryable]] = field(default_factory=list)
    fired: list[str] = field(default_factory=list)


class PdForwarder:
    """A disaggregated pool's forwarder, beside the plain one (`Failover`): the pipeline's steps
    are the same; `Pipeline.handle` hands a `PdDispatch` (a P/D pool's choice) to this one."""

    def __init__(self, links: Links, failover: Failover) -> None:
        self.gw, self.failover = links, failover
        self.metrics = PdMetrics(links.metrics.registry)

    # --- forward --------------------------------------------------------------------------------
    async def forward(
        self, out: Outbound, first: PdDispatch, writer: ResponseWriter, fwd: Forwarded
    ) -> Forwarded:
        """Run the legs until the decode replica answers or every candidate failed."""
        pool = out.pool
        p, d, droute = first.prefill, first.decode, first.droute
        assert pool.pd is not None and out.routing.decision is not None and droute.decision
        fwd.path, fwd.method = out.kind.path, out.kind.method
        leg = _Leg(out, orjson.loads(out.body), fwd, time.monotonic() + pool.config.timeouts.total_s)
        p_next = _candidates(out.routing.decision.ranked[1:], pool.pd.prefill.config.retries)
        d_next = _candidates(droute.decision.ranked[1:], pool.pd.decode.config.retries)
        sglang = pool.pd.protocol == "sglang"
        current: list[Dispatch] = [p, d]
        try:
            while True:
                step = await (
                    self._sglang(leg, p, d, writer) if sglang else self._vllm(leg, p, d, writer)
                )
                if step is None:
                    return fwd
                role, fresh_prefill = step
                if "total_s" in leg.fired:  # no time left for anyone
                    break
                if role == "prefill":
                    name = next(p_next, None)
                    if name is None:
                        break
                    p = await out.router.dispatch(pool.pd.prefill, out.routing, name)
                else:
                    name = next(d_next, None)
                    if name is None:
                        break
                    d = await out.router.dispatch(pool.pd.decode, droute, name)
                    if fresh_prefill:  # the prefill leg ran for the failed pair: a fresh one
                        p = await out.router.dispatch(pool.pd.prefill, out.routing, p.replica.name)
                current += [p, d]
        finally:
            for disp in current:
                disp.done()
            self.gw.notify_capacity(pool.name)
        fwd.error = _all_failed(leg.failures, leg.fired, pool.config, out.expose_errors)
        return fwd

    async def _vllm(self, leg: _Leg, p: Dispatch, d: Dispatch, writer: ResponseWriter) -> _Step | None:
        """One prefill-then-decode try; None: the client got an answer (or an error)."""
        body = {
            k: v
            for k, v in leg.base.items()
            if k not in ("stream_options", "min_tokens", "min_completion_tokens")
        }
        body.update(stream=False, max_tokens=1, kv_transfer_params=dict(PREFILL_KV))
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        t0 = time.perf_counter_ns()
        try:
            opened = await self._open(leg, p, "prefill", orjson.dumps(body), stream=False)
        except Retryable as exc:
            return await self._failed(leg, p, "prefill", exc, t0)
        t1 = time.perf_counter_ns()
        self._attempt(leg, p, "prefill", t0, t1, opened.status, None)
        if opened.status != 200:  # the request's own error (4xx), or a 500: the client's answer
            await self._relay(leg, p, opened, writer)
            return None
        kv = opened.parsed.get("kv_transfer_params") if opened.parsed else None
        if not isinstance(kv, dict):
            self.metrics.legs.labels(
                leg.out.pool.name, "prefill", p.replica.name, "no_kv_params"
            ).inc()
            await p.finished(False, False, None, "no kv_transfer_params")
            raise UpstreamError(
                f"The prefill replica '{p.replica.name}' answered without kv_transfer_params "
                "(null): it did not hand its KV over (is it started with a NIXL --kv-transfer-config?). "
                "The gateway does not let the decode replica recompute the prompt silently."
            )
        await self._prefilled(leg, p, opened, t0, t1)
        dbody = orjson.dumps({**leg.base, "kv_transfer_params": kv})
        t2 = time.perf_counter_ns()
        try:
            dopen = await self._open(leg, d, "decode", dbody, stream=leg.out.req.stream)
        except Retryable as exc:
            return await self._failed(leg, d, "decode", exc, t2, ran_prefill=True)
        if leg.out.req.stream and dopen.status == 200:
            self.metrics.transfer.labels(leg.out.pool.name, d.replica.name).observe(
                (time.perf_counter_ns() - t1) / 1e9
            )
        leg.fwd.pd_prefill = (t0, t1)
        await self._deliver(leg, d, dopen, writer, t2)
        return None

    async def _sglang(self, leg: _Leg, p: Dispatch, d: Dispatch, writer: ResponseWriter) -> _Step | None:
        """Both legs at once with one bootstrap room; the decode's answer is the client's."""
        pool = leg.out.pool
        assert pool.pd is not None
        host, port = urlsplit(p.replica.url).hostname, _bootstrap_port(pool, p.replica.name)
        room: Any = random.getrandbits(63)
        fields: dict[str, Any] = {
            "bootstrap_host": host,
            "bootstrap_port": port,
            "bootstrap_room": room,
        }
        prompt = leg.base.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):  # a batch
            fields = {
                "bootstrap_host": [host] * len(prompt), "bootstrap_port": [port] * len(prompt),
                "bootstrap_room": [random.getrandbits(63) for _ in prompt],
            }  # fmt: skip
        body = orjson.dumps({**leg.base, **fields})
        t0 = time.perf_counter_ns()
        pt = asyncio.ensure_future(self._open(leg, p, "prefill", body, stream=False, json=False))
        dt = asyncio.ensure_future(self._open(leg, d, "decode", body, stream=leg.out.req.stream))
        try:
            await asyncio.wait((pt, dt), return_when=asyncio.FIRST_COMPLETED)
            if pt.done() and (pt.exception() is not None or pt.result().status != 200):
                dt.cancel()
                exc = pt.exception()
                if isinstance(exc, Retryable):
                    return await self._failed(leg, p, "prefill", exc, t0)
                if exc is not None:
                    raise exc
                self._attempt(
                    leg, p, "prefill", t0, time.perf_counter_ns(), pt.result().status, None
                )
                await self._relay(leg, p, pt.result(), writer)
                return None
            try:
                dopen = await dt
            except Retryable as exc:
                pt.cancel()
                return await self._failed(leg, d, "decode", exc, t0)
            if pt.done() and pt.exception() is None:
                t1 = time.perf_counter_ns()
                self._attempt(leg, p, "prefill", t0, t1, pt.result().status, None)
                await self._prefilled(leg, p, pt.result(), t0, t1)
                leg.fwd.pd_prefill = (t0, t1)
            await self._deliver(leg, d, dopen, writer, t0)
            if not pt.done():  # the decode answered: the prefill leg ends with it, or is dropped
                try:
                    async with asyncio.timeout(1.0):
                        popen = await pt
                    self._attempt(leg, p, "prefill", t0, time.perf_counter_ns(), popen.status, None)
                    await self._prefilled(leg, p, popen, t0, time.perf_counter_ns())
                except (Retryable, TimeoutError) as exc:
                    await p.finished(True, True, None, str(exc))
            return None
        finally:
            for t in (pt, dt):
                if not t.done():
                    t.cancel()

    # --- the parts ------------------------------------------------------------------------------
    async def _open(
        self, leg: _Leg, disp: Dispatch, role: str, body: bytes, *, stream: bool, json: bool = True
    ) -> Opened:
        left = leg.deadline - time.monotonic()
        if left <= 0:
            leg.fired.append("total_s")
            raise Retryable("timeout (total_s)")
        pd = leg.out.pool.pd
        assert pd is not None
        timeouts = (pd.prefill if role == "prefill" else pd.decode).config.timeouts
        leg.fwd.tried.append(disp.replica.name)
        leg.fwd.t_sent = leg.fwd.t_sent or time.perf_counter_ns()
        # the decode's answer is the client's: a whole one is charged to the answer budget
        budget, cap = (self.gw.answers, leg.out.answers_cap) if role == "decode" else (None, None)
        return await open_upstream(
            self.gw.upstream, disp.replica.url, leg.out.kind.path, body, leg.out.headers, timeouts,
            stream, left, budget, cap, json_answer=json,
        )  # fmt: skip

    async def _failed(
        self,
        leg: _Leg,
        disp: Dispatch,
        role: str,
        exc: Retryable,
        t0: int,
        ran_prefill: bool = False,
    ) -> _Step:
        await disp.failed(exc.reason, exc.busy)
        leg.failures.append((f"{disp.replica.name} ({role})", exc))
        outcome = attempt_outcome(exc)
        self._attempt(leg, disp, role, t0, time.perf_counter_ns(), exc.status or 0, outcome)
        self.gw.metrics.attempts.labels(leg.out.pool.name, disp.replica.name, outcome).inc()
        return role, ran_prefill

    def _attempt(
        self,
        leg: _Leg,
        disp: Dispatch,
        role: str,
        t0: int,
        t1: int,
        status: int,
        outcome: str | None,
    ) -> None:
        r = disp.replica
        leg.fwd.attempts.append(
            (r.name, r.url, t0, t1 if role == "prefill" or outcome else 0, status, outcome)
        )
        self.metrics.legs.labels(
            leg.out.pool.name,
            role,
            r.name,
            outcome or ("ok" if status == 200 else f"status_{status}"),
        ).inc()

    async def _prefilled(self, leg: _Leg, p: Dispatch, opened: Opened, t0: int, t1: int) -> None:
        usage = opened.parsed.get("usage") if opened.parsed else None
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        got = details.get("cached_tokens") if isinstance(details, dict) else None
        cached = got if isinstance(got, int) else None
        if cached is not None:
            leg.fwd.cached_tokens = cached  # the real prefix hit is the prefill's
        p.prefilled()
        # they audit the prefill set's prediction (docs/tiers.md); the decode leg's answer
        # counts the KV it was handed, no prefix hit of its own: its dispatch gets none
        await p.finished(True, True, (t1 - t0) / 1e9, cached_tokens=cached)
        p.done()  # the prefill replica's part is over (its blocks wait for the transfer)
        self.metrics.prefill.labels(leg.out.pool.name, p.replica.name).observe((t1 - t0) / 1e9)

    async def _deliver(
        self, leg: _Leg, d: Dispatch, opened: Opened, writer: ResponseWriter, t_sent: int
    ) -> None:
        fwd = leg.fwd
        fwd.t_first = time.perf_counter_ns()
        fwd.replica, fwd.status = d.replica.name, opened.status
        self._attempt(leg, d, "decode", t_sent, 0, opened.status, None)
        d.prefilled()
        cached = fwd.cached_tokens
        try:
            await self.failover.deliver(leg.out, opened, writer, fwd)
        finally:
            opened.free()
        if cached is not None:
            fwd.cached_tokens = cached
        ok = opened.status < 500 and fwd.outcome != "broken_mid_stream"
        ttft = (fwd.t_first - t_sent) / 1e9 if leg.out.req.stream and opened.status == 200 else None
        await d.finished(ok, opened.status == 200, ttft, f"upstream {fwd.outcome}")

    async def _relay(self, leg: _Leg, p: Dispatch, opened: Opened, writer: ResponseWriter) -> None:
        """A prefill leg's error answer is the client's (the decode leg is not sent)."""
        fwd = leg.fwd
        fwd.t_first = time.perf_counter_ns()
        fwd.replica, fwd.status = p.replica.name, opened.status
        await self.failover.deliver(leg.out, opened, writer, fwd)
        await p.finished(opened.status < 500, False, None, "upstream error")


_Step = tuple[str, bool]  # the leg that failed; True: a decode retry needs a fresh prefill


def _candidates(ranked: list[str], retries: int) -> Iterator[str]:
    for i, name in enumerate(ranked):
        if i >= retries:
            return
        yield name


def _bootstrap_port(pool: Pool, replica: str) -> int | None:
    """The prefill replica's bootstrap port: its own, else its set's; None (JSON null) if neither."""
    pc = pool.config.prefill
    if pc is None:
        return None
    own = next((r.bootstrap_port for r in pc.replicas if r.display_name == replica), None)
    return own if own is not None else pc.bootstrap_port
