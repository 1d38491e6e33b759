"""What one request did (`Record`), and its recording: metrics, the rolling window, the trace.

The pipeline's steps return values; `Pipeline.handle` writes them into the request's Record, and
`Recorder.record` turns the Record into metrics, a trace and a request log line (`gateway.access`)
once the request is over, whatever happened to it (served, refused, failed, or the client gone).
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from gateway.errors import GatewayError
from gateway.fleet.pools import Pool
from gateway.forwarding.outbound import Forwarded
from gateway.limits.ratelimit import Rule
from gateway.routing.router import Routing
from gateway.telemetry.logs import ACCESS, AccessLine, log_access
from gateway.telemetry.receipt import Receipt, receipt
from gateway.telemetry.trace import ROUTE_ATTRIBUTES, Named
from gateway.telemetry.tracing import RequestTrace
from policies.types import Decision

if TYPE_CHECKING:
    from gateway.runtime.gateway import Gateway
    from gateway.runtime.snapshot import Snapshot


Ended = tuple[str, str | None]  # (outcome, error type) of a request no error ended


@dataclass(slots=True)
class Record:
    """What one request did; perf_counter_ns times, 0 = did not happen. Each field has one
    writer, which writes it once:

    - the endpoint (`ProxyEndpoint`, gateway/http/endpoint.py) as the request arrives: `t_in`,
      `snapshot`, `request_id`, `path`, `trace`, `tenant`;
    - the request's run, `Pipeline.handle` (steps.py), or `by_id` (by_id.py) for a by-id
      request: `model`, `stream`, `priority`, `pool`, `prompt_tokens`, `charged`, `t_route`,
      `t_queue`;
    - `Pipeline.admit`: `t_admitted`, `t_routed`, and through `routed` the decision's `policy`,
      `reason`, `prompt_blocks`, `predicted_hit_blocks`, `stages`;
    - the forwarder that sends it (failover.py, pd.py, or by_id.py): `sent`, filled in as it goes;
    - `Pipeline.finish`, through `ended`: `status`, `outcome`, `error_type`;
    - `Recorder.record`: `receipt`.
    """

    t_in: int
    trace: RequestTrace | None = None
    snapshot: int = 0  # the version of the config snapshot the request ran on
    request_id: str = ""
    tenant: str = "anonymous"
    model: str = ""
    stream: bool = False
    path: str = ""  # the client's request path; empty: the upstream path (the same) stands in
    priority: str = ""
    pool: str = "none"
    prompt_tokens: int = 0
    policy: str = ""
    reason: str = ""
    prompt_blocks: int = 0
    predicted_hit_blocks: int = 0
    stages: tuple[int, int, int] = (0, 0, 0)  # ns spent hashing, matching, choosing
    t_route: int = 0
    t_queue: int = 0
    t_admitted: int = 0
    t_routed: int = 0
    charged: list[tuple[Rule, int]] = field(default_factory=list)  # token buckets: what each took
    sent: Forwarded = field(default_factory=Forwarded)
    status: int = 0  # of the answer the client got
    outcome: str = "ok"
    error_type: str | None = None
    receipt: Receipt | None = None  # predicted vs engine-reported cached tokens, once served

    def routed(self, routing: Routing, decision: Decision) -> None:
        self.policy, self.reason = decision.policy, decision.reason
        self.prompt_blocks = len(routing.routed.block_hashes)
        self.predicted_hit_blocks = decision.predicted_hit_blocks
        self.stages = (routing.hash_ns, routing.match_ns, routing.choose_ns)

    def ended(self, exc: GatewayError | None, ended: Ended | None) -> None:
        """How the request ended: answered with `exc`, else as `ended` says, else as its
        forwarder's attempts ended (`ok` when none failed, or none was made)."""
        if exc is not None:
            self.status, self.outcome, self.error_type = exc.status, "error", exc.type
        elif ended is not None:
            self.outcome, self.error_type = ended
        elif self.sent.outcome != "ok":
            self.outcome, self.error_type = self.sent.outcome, self.sent.error_type

    @property
    def queue_wait_s(self) -> float | None:
        """Time in the admission queue (None: the request never reached it)."""
        return (self.t_admitted - self.t_queue) / 1e9 if self.t_admitted else None

    @property
    def replica(self) -> str:
        return self.sent.replica

    def tokens_used(self) -> int | None:
        """Tokens the request used as far as the limits go: 0 when no replica served it or the
        replica refused it (no generation), None when a 200 came without a usable usage."""
        sent = self.sent
        if sent.replica == "none" or sent.status != 200:
            return 0
        if sent.output_tokens is None:
            return None
        return (sent.input_tokens or self.prompt_tokens) + sent.output_tokens


class _Ids:
    """New request ids: 16 random hex digits drawn once per process (again in a forked child),
    then a counter: unique across processes and gateways without a getrandom call per request."""

    __slots__ = ("prefix", "count")

    def __init__(self) -> None:
        self.reseed()

    def reseed(self) -> None:
        self.prefix = os.urandom(8).hex()
        self.count = itertools.count()

    def new(self) -> str:
        return f"{self.prefix}{next(self.count):016x}"


_IDS = _Ids()
os.register_at_fork(after_in_child=_IDS.reseed)


def request_id(headers: Mapping[bytes, bytes]) -> str:
    """The client's X-Request-Id (bounded), else a new one (32 hex digits, unique, not secret);
    sent to the replica and back."""
    rid = headers.get(b"x-request-id")
    return rid.decode("latin-1")[:128] if rid else _IDS.new()



class Recorder:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        self._labels_of = -1  # the snapshot whose server.metrics the label caps follow

    def decision(self, pool: Pool, routing: Routing, decision: Decision) -> None:
        m = self.gw.metrics
        routed = routing.routed
        m.routing_time.labels(pool.name).observe(
            (routing.hash_ns + routing.match_ns + routing.choose_ns) / 1e9
        )
        m.decisions.labels(pool.name, decision.policy, decision.reason).inc()
        # kept as a tuple; turned into JSON only when someone looks (/debug/decisions, /dashboard)
        self.gw.recent.append(
            (time.time(), routed.request_id, pool.name, routed.prompt_tokens,
             len(routed.block_hashes), decision)
        )  # fmt: skip

    def queue_wait(self, pool: str, priority: str, waited_s: float) -> None:
        self.gw.metrics.queue_wait.labels(pool, priority).observe(waited_s)

    def record(self, snap: Snapshot, rec: Record) -> None:
        """Metrics, the window, the trace and the log line of one finished request (`snap`: the
        snapshot it ran on, whose request-log settings apply)."""
        m = self.gw.metrics
        now = time.perf_counter_ns()
        sent = rec.sent
        if snap.version != self._labels_of:
            self._labels_of = snap.version
            m.models.limit = m.tenants.limit = snap.config.server.metrics.max_label_values
        status = rec.status or sent.status
        if rec.outcome != "ok" and rec.error_type:
            m.errors.labels(rec.pool, rec.error_type).inc()
        pool, replica = rec.pool, sent.replica
        e2e = (now - rec.t_in) / 1e9
        # a model that matched no route is the client's word only: it takes no label value
        model = m.models(rec.model[:128]) if pool != "none" else "none"
        tenant = m.tenants(rec.tenant)
        priority = rec.priority or "none"
        m.requests.labels(pool, replica, str(status or 499), priority, model, tenant).inc()
        m.duration.labels(pool).observe(e2e)
        served = replica != "none" and status == 200
        ttft = tpot = None
        prompt = sent.input_tokens or rec.prompt_tokens
        if served:
            m.attempts.labels(pool, replica, rec.outcome).inc()
            if rec.stream and sent.t_first:
                ttft = (sent.t_first - rec.t_in) / 1e9
                m.ttft.labels(pool, replica).observe(ttft)
                out = sent.output_tokens
                if out and out > 1 and sent.t_last > sent.t_first:
                    tpot = (sent.t_last - sent.t_first) / 1e9 / (out - 1)
                    m.tpot.labels(pool, replica).observe(tpot)
            m.prompt_length.labels(pool).observe(prompt)
            m.prompt_tokens.labels(pool, model, tenant).inc(prompt)
            if sent.output_tokens:
                m.output_tokens.labels(pool, model, tenant).inc(sent.output_tokens)
            if rec.prompt_blocks:
                m.prompt_blocks.labels(pool).inc(rec.prompt_blocks)
                m.predicted_hit_blocks.labels(pool).inc(rec.predicted_hit_blocks)
            if sent.cached_tokens is not None and sent.input_tokens:
                m.observed_prompt_tokens.labels(pool).inc(sent.input_tokens)
                m.observed_cached_tokens.labels(pool).inc(sent.cached_tokens)
            if sent.predicted_tokens is not None:
                rec.receipt = self.receipt(snap, rec)
                m.receipts.labels(pool, rec.receipt.verdict).inc()
                if (error := rec.receipt.error) is not None:
                    m.receipt_error.labels(pool).observe(error)
        elif replica != "none":
            m.attempts.labels(pool, replica, f"status_{status // 100}xx").inc()
        if pool != "none":
            self.gw.window.observe(
                pool,
                replica,
                ttft_s=ttft,
                tpot_s=tpot,
                e2e_s=e2e,
                prompt_tokens=prompt,
                prompt_blocks=rec.prompt_blocks if served else 0,
                predicted_hit_blocks=rec.predicted_hit_blocks if served else 0,
                cached_tokens=sent.cached_tokens,
                input_tokens=sent.input_tokens,
                ok=rec.outcome == "ok",
            )
        if rec.trace is not None:
            _finish_trace(rec, rec.trace, status, now)
        if ACCESS.isEnabledFor(logging.INFO):
            self.log(snap, rec, status or 499, e2e, ttft)

    @staticmethod
    def receipt(snap: Snapshot, rec: Record) -> Receipt:
        """The served request's route receipt (gateway/telemetry/receipt.py)."""
        sent, chunker = rec.sent, snap.chunker
        assert sent.predicted_tokens is not None
        block = sent.engine_block or int(chunker.tokens_per_block)
        bytes_block = None if chunker.mode == "tokens" else chunker.tokens_per_block
        return receipt(sent.predicted_tokens, rec.prompt_tokens, sent.input_tokens,
                       sent.cached_tokens, block, bytes_block)  # fmt: skip

    def log(
        self, snap: Snapshot, rec: Record, status: int, total_s: float, ttft_s: float | None
    ) -> None:
        """The request's line in the request log, unless the sample or its tenant leaves it out.
        Counts, times and names only: never a prompt, a body or a key."""
        sample = snap.config.server.request_log.sample
        if sample < 1.0 and (sample <= 0.0 or random.random() >= sample):
            return
        if rec.tenant in snap.tenants.unlogged:
            return
        sent = rec.sent
        prompt = sent.input_tokens if sent.input_tokens is not None else rec.prompt_tokens or None
        queue_s = rec.queue_wait_s
        log_access(
            AccessLine(  # the values in logs.ACCESS_FIELDS order
                (
                    rec.request_id, rec.tenant, rec.model[:128], rec.pool, sent.replica, status,
                    rec.outcome, rec.error_type if rec.outcome != "ok" else None, rec.stream,
                    rec.priority or None, prompt,
                    None if rec.receipt is None else rec.receipt.predicted, sent.cached_tokens,
                    sent.output_tokens, None if queue_s is None else round(queue_s, 6),
                    None if ttft_s is None else round(ttft_s, 6), round(total_s, 6),
                    max(0, len(sent.tried) - 1 - len(sent.resumes)), rec.policy or None,
                    rec.reason or None, len(sent.resumes),
                    sent.resumes[0][1] if sent.resumes else None,
                    round(max(sent.resume_gaps), 6) if sent.resume_gaps else None,
                )
            )
        )


_NAMES = RequestTrace.NAMES
_PROMPT_TOKENS, _PROMPT_BLOCKS = _NAMES["prompt_tokens_estimated"], _NAMES["prompt_blocks"]
_CACHED_BLOCKS, _HASH_US = _NAMES["predicted_cached_blocks"], _NAMES["route_hash_us"]
_MATCH_US, _CHOOSE_US = _NAMES["route_match_us"], _NAMES["route_choose_us"]
_INPUT_TOKENS, _OUTPUT_TOKENS = _NAMES["input_tokens"], _NAMES["output_tokens"]
_R_PREDICTED = ROUTE_ATTRIBUTES["receipt_predicted_tokens"]
_R_CACHED, _R_VERDICT = ROUTE_ATTRIBUTES["receipt_cached_tokens"], ROUTE_ATTRIBUTES["receipt_verdict"]
_SAME: dict[tuple[object, ...], Mapping[str, object]] = {}  # a trace's repeating set, by values
_SAME_MAX = 4096  # sets kept; cleared when full


def _same(key: tuple[Any, ...]) -> Mapping[str, object]:
    """The root attributes that repeat from request to request, as one read-only mapping."""
    (model, tenant, pool, tried, outcome, method, path, priority, replica, policy, reason,
     version, code) = key  # fmt: skip
    a = _NAMES
    same: dict[str, object] = {
        a["model"]: model,
        a["tenant"]: tenant,
        a["pool"]: pool,
        a["retries"]: max(0, len(tried) - 1),
        a["outcome"]: outcome,
        a["method"]: "POST" if method == b"POST" else method.decode(),
        a["url_scheme"]: "http",
    }
    if path:  # the proxied routes are fixed paths: the route is the path
        same[a["url_path"]] = same[a["route"]] = path if isinstance(path, str) else path.decode()
    if priority:
        same[a["priority"]] = priority
    if replica != "none":
        same[a["replica"]] = replica
    if policy:
        same[a["policy"]] = policy
    if reason:
        same[a["route_reason"]] = reason
    if version:
        same[a["config_version"]] = version
    if tried:
        same[a["replicas_tried"]] = tried
    if code:
        same[a["status_code"]] = code
    if len(_SAME) >= _SAME_MAX:
        _SAME.clear()
    got = _SAME[key] = MappingProxyType(same)
    return got


def _finish_trace(rec: Record, tr: RequestTrace, status: int, now: int) -> None:
    if not tr.sampled:
        tr.finish(end_ns=0)  # nothing is recorded for an unsampled trace
        return
    o, sent = tr.epoch_ns(0), rec.sent  # o: perf_counter_ns → epoch ns
    # hash + match run before the admission queue, choose after it (in stage attributes)
    route = (rec.t_route + o, rec.t_queue + o) if rec.t_queue else None
    queue = (rec.t_queue + o, rec.t_admitted + o) if rec.t_admitted else None
    prefill = decode = generate = transfer = None
    if sent.t_first and sent.pd_prefill[1]:  # P/D: the prefill leg, then the decode's answer
        prefill = (sent.pd_prefill[0] + o, sent.pd_prefill[1] + o)
        if rec.stream:
            transfer = (prefill[1], sent.t_first + o)
            decode = (sent.t_first + o, sent.t_last + o) if sent.t_last else None
        else:
            generate = (prefill[1], (sent.t_last or now) + o)
    elif sent.t_first:  # a replica answered: its segments start when that attempt was sent
        begin = (sent.attempts[-1][2] if sent.attempts else sent.t_sent) + o
        if rec.stream:
            prefill = (begin, sent.t_first + o)
            decode = (sent.t_first + o, sent.t_last + o) if sent.t_last else None
        else:  # the first token is not seen: one segment, and no TTFT
            generate = (begin, (sent.t_last or now) + o)
    # the values now; they are named when the spans are built (the export thread, for OTLP/HTTP)
    v = (
        rec.model, rec.tenant, rec.pool, rec.prompt_tokens, rec.prompt_blocks,
        rec.predicted_hit_blocks, tuple(sent.tried), rec.outcome, rec.priority, sent.replica,
        rec.policy, rec.reason, rec.snapshot, rec.stages if rec.t_routed else None,
        sent.input_tokens, sent.output_tokens, status, rec.path or sent.path, sent.method,
        rec.receipt,
    )  # fmt: skip

    def named() -> Named:  # no Record or RequestTrace
        (model, tenant, pool, prompt_tokens, blocks, hit_blocks, tried, outcome, priority,
         replica, policy, reason, version, stages, input_tokens, output_tokens, code, path,
         method, receipt) = v  # fmt: skip
        # what repeats from request to request first: one shared mapping per set of values,
        # which the encoder encodes once (by identity) and build() reuses with the Host's names
        key = (model, tenant, pool, tried, outcome, method, path, priority, replica, policy,
               reason, version, code)  # fmt: skip
        same = _SAME.get(key)
        if same is None:
            same = _same(key)
        measured: dict[str, object] = {
            _PROMPT_TOKENS: prompt_tokens,
            _PROMPT_BLOCKS: blocks,
            _CACHED_BLOCKS: hit_blocks,
        }
        if stages is not None:
            measured[_HASH_US] = stages[0] // 1000
            measured[_MATCH_US] = stages[1] // 1000
            measured[_CHOOSE_US] = stages[2] // 1000
        if input_tokens is not None:
            measured[_INPUT_TOKENS] = input_tokens
        if output_tokens is not None:
            measured[_OUTPUT_TOKENS] = output_tokens
        if receipt is None:
            return same, measured
        route: dict[str, object] = {_R_PREDICTED: receipt.predicted, _R_VERDICT: receipt.verdict}
        if receipt.reported is not None:  # unreported: no such attribute
            route[_R_CACHED] = receipt.reported
        return same, measured, route

    tr.finish(
        queue=queue,
        route=route,
        prefill=prefill,
        decode=decode,
        generate=generate,
        transfer=transfer,
        attempts=sent.attempts,
        end_ns=now + o,
        named=named,
        error_type=rec.error_type if rec.outcome != "ok" else None,
    )
