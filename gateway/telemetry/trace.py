"""One request's trace as the request path records it (`RequestTrace`), and the span shape.

`tracing.py` opens a trace per request and picks the sink; the sinks (`otlp.py` for OTLP/HTTP,
`tracing_sdk.py` for the SDK's exporters) read finished traces from here.

The HTTP semantic-convention attributes (the stable HTTP span conventions): the root (SERVER)
span gets server.address / server.port from the Host header and
user_agent.original; each upstream attempt becomes an `upstream.attempt` CLIENT span with the
replica, server.address / server.port, url.full (no credentials), the method, the status, the
resend count and error.type. It all runs when the spans are built (or encoded in one pass), off
the event loop for OTLP.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol
from urllib.parse import urlsplit

from opentelemetry.trace import SpanContext, TraceState

__all__ = [
    "ATTEMPT_ATTRIBUTES",
    "ATTEMPT_SPAN",
    "ATTRIBUTES",
    "ROOT_SPAN",
    "SCOPE_NAME",
    "SEGMENTS",
    "SPAN_KINDS",
    "TYPES",
    "Child",
    "RequestTrace",
    "SpanSink",
    "attempt_spans",
    "group_of",
    "http_server",
]

ATTEMPT_SPAN = "upstream.attempt"
# keyword → attribute name on each upstream.attempt span (HTTP client span conventions)
ATTEMPT_ATTRIBUTES: dict[str, str] = {
    "replica": "gateway.replica",
    "method": "http.request.method",
    "server_address": "server.address",
    "server_port": "server.port",
    "url_full": "url.full",
    "status_code": "http.response.status_code",
    "resend_count": "http.request.resend_count",
    "error_type": "error.type",
    "resume_offset": "gateway.resume.offset",  # a resume: the tokens relayed before it
}
# an attempt's outcome `resume:<offset>`: it continued the answer there (`resume:<offset>:<error>`
# when it broke in turn)
RESUMED = "resume:"
# the root's names this module reads or writes (ATTRIBUTES holds them too)
_METHOD, _PATH, _OUTCOME = "http.request.method", "url.path", "gateway.outcome"
_ADDRESS, _PORT, _AGENT = "server.address", "server.port", "user_agent.original"
_CACHE_MAX = 4096  # attempt attribute sets and parsed hosts kept; cleared when full
_getrandbits = random.getrandbits


def attempt_spans(
    children: list[Child],
    attempts: Sequence[Attempt],
    root: Mapping[str, Any],
    offset: int,
    start: int,
    answered: int,
    end: int,
) -> None:
    """An `upstream.attempt` child per attempt, within the root; one still open at the end (the
    one that answered) ends with the last segment (`answered`), or the root when none came."""
    method = root.get(_METHOD, "POST")
    path = root.get(_PATH, "")
    outcome = root.get(_OUTCOME)
    aborted = outcome if outcome in ("broken_mid_stream", "client_disconnected") else None
    cache = _attempt_cache
    for i, (replica, url, t0, t1, status, failed) in enumerate(attempts):
        s = min(max(t0 + offset, start), end)
        e = min(max(t1 + offset if t1 else answered if answered > s else end, s), end)
        resumed = -1
        if failed is not None and failed.startswith(RESUMED):  # a resume, at its token offset
            at, _, broke = failed[len(RESUMED) :].partition(":")  # `:<error>`: it broke too
            resumed, failed = int(at), broke or None
        if failed is not None:  # the failover's outcome: status_503 -> "503", timeout, ...
            error: str | None = failed[7:] if failed.startswith("status_") else failed
        elif status >= 400:  # CLIENT span conventions: a 4xx is an error too
            error = str(status)
        else:
            error = aborted
        key = (replica, url, method, path, status, i, error, resumed)
        attrs = cache.get(key) or _attempt_attributes(key)
        children.append((ATTEMPT_SPAN, _getrandbits(64) or 1, s, e, attrs, error))


_attempt_cache: dict[tuple[Any, ...], Mapping[str, Any]] = {}


def _attempt_attributes(key: tuple[Any, ...]) -> Mapping[str, Any]:
    """One attempt's attributes, kept: attempts of the same shape share one read-only mapping."""
    replica, url, method, path, status, resend, error, resumed = key
    parts = urlsplit(url)
    a = ATTEMPT_ATTRIBUTES
    out: dict[str, Any] = {
        a["replica"]: replica,
        a["method"]: method,
        a["server_address"]: parts.hostname or "",
        a["server_port"]: parts.port or (443 if parts.scheme == "https" else 80),
        # no credentials in a span (semantic conventions: userinfo is never recorded)
        a["url_full"]: f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{path}",
    }
    if status:
        out[a["status_code"]] = status
    if resend:
        out[a["resend_count"]] = resend
    if error is not None:
        out[a["error_type"]] = error
    if resumed >= 0:
        out[a["resume_offset"]] = resumed
    if len(_attempt_cache) >= _CACHE_MAX:
        _attempt_cache.clear()
    got = _attempt_cache[key] = MappingProxyType(out)
    return got


_host_cache: dict[bytes, tuple[str, int | None]] = {}


def http_server(values: dict[str, Any], host: bytes | None, agent: bytes | None) -> None:
    """server.address / server.port from the Host header, user_agent.original."""
    if host:
        got = _host_cache.get(host)
        if got is None:
            name, port = _split_host(host.decode("latin-1"))
            if len(_host_cache) >= _CACHE_MAX:
                _host_cache.clear()
            got = _host_cache[host] = (name, port)
        values[_ADDRESS] = got[0]
        if got[1] is not None:
            values[_PORT] = got[1]
    if agent:
        values[_AGENT] = agent.decode("latin-1")


def _split_host(host: str) -> tuple[str, int | None]:
    """`name[:port]` or `[v6][:port]` of a Host header; the port None when absent or bad."""
    if host.startswith("["):
        name, _, rest = host[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif host.count(":") == 1:
        name, _, port = host.partition(":")
    else:  # no port (or a bare IPv6 address)
        name, port = host, ""
    return name, int(port) if port.isdigit() and int(port) < 65536 else None


_getrandbits = random.getrandbits  # what the SDK's RandomIdGenerator uses

Segment = tuple[int, int]
# an upstream attempt as `Forwarded.attempts` holds it (perf_counter_ns stamps): replica, its URL,
# start, end (0: the answer's end), status (0: none), failover outcome (None: this one answered)
Attempt = tuple[str, str, int, int, int, "str | None"]
# a child span once built: name, span id, start, end (epoch ns), attributes, error type or None
Child = tuple[str, int, int, int, "Mapping[str, Any]", "str | None"]
# root attributes by name; or a pair: those that repeat from request to request, the measured;
# or a triple: those two, then the route span's own (the route receipt)
Named = (
    Mapping[str, Any]
    | tuple[Mapping[str, Any], Mapping[str, Any]]
    | tuple[Mapping[str, Any], Mapping[str, Any], Mapping[str, Any]]
)
# what RequestTrace.finish was given
_Given = tuple[
    "tuple[Segment | None, ...]",
    "Sequence[Attempt]",
    int,
    "Named | Callable[[], Named] | None",
    str | None,
]

ROOT_SPAN = "gateway.request"
SCOPE_NAME = "gateway"
# the child spans of the root that follow each other, in the order a request passes through them:
# the route span is hash + index match, before the admission queue; the policy's choice
# (microseconds) ends the queue. A streamed answer has prefill + decode; a non-streamed one
# has generate instead (the gateway cannot see its first token).
SEGMENTS = (
    "gateway.route",
    "gateway.queue",
    "upstream.prefill",
    "upstream.decode",
    "upstream.generate",
)
# a disaggregated pool's request (gateway/forwarding/pd.py) also has kv.transfer: its prefill leg answered
# (upstream.prefill) → the decode replica's first byte; the order segments are built in
_ORDER = (*SEGMENTS[:3], "kv.transfer", *SEGMENTS[3:])


def segment_times(
    segs: tuple[tuple[int, int] | None, ...], start_ns: int
) -> Iterator[tuple[str, int, int]]:
    """The segments given, in order, as (name, start, end): each moved up to the previous one's
    end (from `start_ns`), so they never overlap."""
    prev = start_ns
    for name, seg in zip(_ORDER, segs):  # noqa: B905 - both have six
        if seg is not None:
            s = seg[0] if seg[0] > prev else prev
            prev = seg[1] if seg[1] > s else s
            yield name, s, prev


def derived_times(
    segs: tuple[tuple[int, int] | None, ...], start_ns: int, output_tokens: Any
) -> tuple[float | None, float | None]:
    """(gateway.ttft_s, gateway.tpot_s) the segments give: TTFT from `prefill` (P/D: the first
    token ends kv.transfer), TPOT from `decode` over more than one output token."""
    prefill, decode = segs[3] or segs[2], segs[4]
    ttft = None if prefill is None else (max(prefill[1], start_ns) - start_ns) / 1e9
    tpot = None
    if decode is not None and isinstance(output_tokens, int) and output_tokens > 1:
        tpot = max(decode[1] - decode[0], 0) / 1e9 / (output_tokens - 1)
    return ttft, tpot


def server_error(status: Any, error_type: str | None) -> tuple[str | None, bool]:
    """(error.type, whether the server span's status is an error), the HTTP semantic
    conventions: a 5xx is an error, its code the type; a 4xx answered leaves the status unset
    (the client's error)."""
    if error_type is None and isinstance(status, int) and status >= 500:
        error_type = str(status)
    failed = error_type is not None and not (isinstance(status, int) and 400 <= status < 500)
    return error_type, failed


SPAN_KINDS: dict[str, str] = {
    ROOT_SPAN: "SERVER",
    **dict.fromkeys(_ORDER, "INTERNAL"),
    ATTEMPT_SPAN: "CLIENT",  # one per attempt on the wire, overlapping the upstream segments
}

# keyword of RequestTrace.set / key of finish(attrs=...) → root span attribute name
ATTRIBUTES: dict[str, str] = {
    "tenant": "gateway.tenant",
    "priority": "gateway.priority",
    "model": "gen_ai.request.model",
    "pool": "gateway.pool",
    "config_version": "gateway.config.version",
    "replica": "gateway.replica",
    "policy": "gateway.policy",
    "route_reason": "gateway.route.reason",
    "input_tokens": "gen_ai.usage.input_tokens",
    "prompt_tokens_estimated": "gateway.prompt_tokens.estimated",
    "predicted_cached_blocks": "gateway.prefix.predicted_cached_blocks",
    "route_hash_us": "gateway.route.hash_us",
    "route_match_us": "gateway.route.match_us",
    "route_choose_us": "gateway.route.choose_us",
    "prompt_blocks": "gateway.prefix.prompt_blocks",
    "output_tokens": "gen_ai.usage.output_tokens",
    "ttft_s": "gateway.ttft_s",
    "tpot_s": "gateway.tpot_s",
    "retries": "gateway.retries",
    "replicas_tried": "gateway.replicas_tried",
    "outcome": "gateway.outcome",
    "error_type": "error.type",
    "status_code": "http.response.status_code",
    # HTTP server span semantic conventions (stable)
    "method": "http.request.method",
    "url_path": "url.path",
    "url_scheme": "url.scheme",
    "route": "http.route",
    "server_address": "server.address",
    "server_port": "server.port",
    "user_agent": "user_agent.original",
}
# the route receipt (gateway/telemetry/receipt.py), attributes of the gateway.route span once the answer
# came: predicted vs engine-reported cached prompt tokens, and the verdict
ROUTE_ATTRIBUTES: dict[str, str] = {
    "receipt_predicted_tokens": "gateway.route.predicted_cached_tokens",
    "receipt_cached_tokens": "gateway.route.cached_tokens",
    "receipt_verdict": "gateway.route.receipt",
}
# the type of every root and attempt attribute, as docs/tracing.md states it (a test holds the
# two together)
TYPES: dict[str, str] = {
    **dict.fromkeys(
        (
            "gateway.tenant", "gateway.priority", "gen_ai.request.model", "gateway.pool",
            "gateway.replica", "gateway.policy", "gateway.route.reason", "gateway.outcome",
            "error.type", "http.request.method", "url.path", "url.scheme", "http.route",
            "server.address", "user_agent.original", "url.full", "gateway.route.receipt",
        ),
        "string",
    ),
    **dict.fromkeys(
        (
            "gateway.config.version", "gen_ai.usage.input_tokens",
            "gateway.prompt_tokens.estimated", "gateway.prefix.predicted_cached_blocks",
            "gateway.route.hash_us", "gateway.route.match_us", "gateway.route.choose_us",
            "gateway.prefix.prompt_blocks", "gen_ai.usage.output_tokens", "gateway.retries",
            "http.response.status_code", "server.port", "http.request.resend_count",
            "gateway.route.predicted_cached_tokens", "gateway.route.cached_tokens",
            "gateway.resume.offset",
        ),
        "int",
    ),
    "gateway.ttft_s": "float",
    "gateway.tpot_s": "float",
    "gateway.replicas_tried": "string[]",
}  # fmt: skip
_TTFT, _TPOT = ATTRIBUTES["ttft_s"], ATTRIBUTES["tpot_s"]
_OUTPUT, _OUTCOME = ATTRIBUTES["output_tokens"], ATTRIBUTES["outcome"]
_STATUS, _ERROR_TYPE = ATTRIBUTES["status_code"], ATTRIBUTES["error_type"]
_EMPTY: Mapping[str, Any] = MappingProxyType({})


class SpanSink(Protocol):
    """Where finished, sampled traces go: `end` runs on the event loop and must never block.

    It calls `trace.build()` (now or later, on any one thread) before reading the spans, or
    reads `trace.given` in one pass as build() would (otlp_wire.SpanEncoder).
    """

    def end(self, trace: RequestTrace) -> None: ...

    def shutdown(self) -> None: ...


class RequestTrace:
    """One request's trace: the root span's identity while the request runs, its spans after.

    `tid` and `sid` are the trace's and the root span's ids (ints). `finish` only keeps what it
    is given and passes the trace to the sink; `build` (the sink calls it, on the export thread
    for OTLP/HTTP) turns that into `segments`, the child spans (`Child`: the sequential segments,
    then one `upstream.attempt` per attempt), the root's `attributes`, its `error` status and
    `end_ns`.
    """

    NAMES = ATTRIBUTES  # keyword → span attribute name

    __slots__ = (
        "_sink",
        "_offset",
        "_done",
        "_given",
        "tid",
        "sid",
        "parent",
        "trace_state",
        "sampled",
        "start_ns",
        "end_ns",
        "spans",
        "segments",
        "attributes",
        "error",
        "host",
        "agent",
        "group",
    )

    def __init__(
        self,
        sink: SpanSink,
        trace_id: int,
        span_id: int,
        parent: SpanContext | None,
        trace_state: TraceState | None,
        sampled: bool,
        start_ns: int,
        host: bytes | None = None,
        agent: bytes | None = None,
    ) -> None:
        self._sink = sink
        self._offset = time.time_ns() - time.perf_counter_ns()
        self._done = False
        self._given: _Given | None = None
        self.tid = trace_id
        self.sid = span_id
        self.parent = parent  # the caller's span (remote), None for a new trace
        self.trace_state = trace_state
        self.sampled = sampled
        self.start_ns = start_ns
        self.end_ns = start_ns
        self.spans = 1  # how many spans `finish` was given: the root and its children
        self.segments: list[Child] = []
        self.attributes: dict[str, Any] = {}
        self.error: str | None = None
        self.host = host  # the request's Host and User-Agent headers, named when built
        self.agent = agent
        # the leading `attributes` that repeat from request to request as a set (a request's
        # names: model, tenant, pool, replica, status...), one mapping shared by the traces
        # that have them, which an encoder may encode once; `attributes` begins with it and
        # never changes those entries; None when there is no such set
        self.group: Mapping[str, Any] | None = None

    @property
    def trace_id(self) -> str:
        return f"{self.tid:032x}"

    def traceparent(self) -> str:
        """The W3C header for the upstream request; its parent is the root span."""
        return f"00-{self.tid:032x}-{self.sid:016x}-{'01' if self.sampled else '00'}"

    def traceparent_bytes(self) -> bytes:
        """`traceparent()` as the header's bytes, formatted once (the request path's form)."""
        return b"00-%032x-%016x-%s" % (self.tid, self.sid, b"01" if self.sampled else b"00")

    def tracestate(self) -> str | None:
        """The incoming tracestate to forward upstream, or None."""
        ts = self.trace_state
        return ts.to_header() if ts else None

    @property
    def given(self) -> _Given | None:
        """What `finish` was given (segments, attempts, end_ns, named, error_type) until `build`
        turns it into spans; an encoder may read it in one pass instead (otlp_wire)."""
        return self._given

    @property
    def offset_ns(self) -> int:
        """epoch ns - perf_counter_ns, taken when the trace started."""
        return self._offset

    def epoch_ns(self, perf_counter_ns: int) -> int:
        """A `time.perf_counter_ns()` reading as epoch ns, on the clock offset taken at start."""
        return perf_counter_ns + self._offset

    def set(self, attrs: Mapping[str, Any] | None = None, /, **kw: Any) -> None:
        """Root attributes: keywords are ATTRIBUTES keys; the mapping may also use dotted names."""
        if not self.sampled:
            return
        if attrs:
            self.attributes.update(_names(attrs))
        if kw:
            self.attributes.update(_names(kw))

    def finish(
        self,
        *,
        queue: Segment | None = None,
        route: Segment | None = None,
        prefill: Segment | None = None,
        decode: Segment | None = None,
        generate: Segment | None = None,
        attempts: Sequence[Attempt] = (),
        end_ns: int,
        transfer: Segment | None = None,
        attrs: Mapping[str, Any] | None = None,
        named: Named | Callable[[], Named] | None = None,
        error_type: str | None = None,
    ) -> None:
        """End the trace: the given segments (epoch ns) become child spans, in order, and each
        of `attempts` an `upstream.attempt` span.

        `attrs` are root attributes as in `set` (checked now); `named` are more, by span
        attribute name and without None values, or a function that returns them when the spans
        are built (the request path's form: nothing is named on the event loop); as a
        pair, the attributes that repeat from request to request (a read-only mapping: one per
        set of values, shared), then the measured ones (an encoder takes the two in one pass
        when no name is in both). A segment that starts before the
        previous one ended is moved up to that end, so the segments never overlap;
        `gateway.ttft_s` (from `prefill` only: a non-streamed answer's first token is not seen)
        and `gateway.tpot_s` (from `decode`) are derived when not given. `attempts`
        are as `Forwarded.attempts` holds them (perf_counter_ns stamps, turned into epoch ns on
        this trace's clock offset when built).
        """
        if self._done:
            return
        self._done = True
        if not self.sampled:
            return
        if attrs:
            self.attributes.update(_names(attrs))
        segments = (route, queue, prefill, transfer, decode, generate)
        self._given = (segments, attempts, end_ns, named, error_type)
        self.spans = 1 + len(attempts) + 6 - segments.count(None)
        self._sink.end(self)

    def build(self) -> None:
        """The spans from what `finish` was given (once; the sink calls it)."""
        given, self._given = self._given, None
        if given is None:
            return
        segs, attempts, end_ns, named, error_type = given
        values = self.attributes
        got = (named() if callable(named) else named) if named else _EMPTY
        route_attrs = _EMPTY
        if isinstance(got, tuple):
            repeat, measured = got[0], got[1]
            if len(got) == 3:
                route_attrs = got[2]
        else:
            repeat, measured = got, None
        if not values and measured is not None and type(repeat) is MappingProxyType:
            # a shared (read-only) repeating set: with the Host's names, one mapping, kept
            self.group = group = group_of(repeat, self.host, self.agent)
            values.update(group)
        else:
            values.update(repeat)
            if self.host is not None or self.agent is not None:
                http_server(values, self.host, self.agent)
        if measured is not None:
            values.update(measured)
        children = self.segments
        start = prev = self.start_ns
        for name, s, prev in segment_times(segs, start):
            attrs = route_attrs if name == "gateway.route" else _EMPTY
            children.append((name, _getrandbits(64) or 1, s, prev, attrs, None))
        ttft, tpot = derived_times(segs, start, values.get(_OUTPUT))
        if ttft is not None and _TTFT not in values:
            values[_TTFT] = ttft
        if tpot is not None and _TPOT not in values:
            values[_TPOT] = tpot
        end = max(end_ns, prev)
        if attempts:
            attempt_spans(children, attempts, values, self._offset, start, prev, end)
        error_type, failed = server_error(values.get(_STATUS), error_type)
        if error_type is not None:
            values[_ERROR_TYPE] = error_type
            values.setdefault(_OUTCOME, "error")
            if failed:
                self.error = error_type
        else:
            values.setdefault(_OUTCOME, "ok")
        self.end_ns = end


_GROUPS_MAX = 4096  # groups kept; cleared when full
# (id of a named repeating set, Host, User-Agent) → (that set, kept alive; the group)
_groups: dict[tuple[int, bytes | None, bytes | None], tuple[Mapping[str, Any], Mapping[str, Any]]]
_groups = {}


def group_of(
    repeat: Mapping[str, Any], host: bytes | None, agent: bytes | None
) -> Mapping[str, Any]:
    """A shared repeating set (`finish(named=...)`'s first) with the request's Host and
    User-Agent names: one mapping per (set, Host, User-Agent), kept, never changed."""
    key = (id(repeat), host, agent)
    hit = _groups.get(key)
    if hit is None or hit[0] is not repeat:
        hit = _group(key, repeat)
    return hit[1]


def _group(
    key: tuple[int, bytes | None, bytes | None], repeat: Mapping[str, Any]
) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    values = dict(repeat)
    http_server(values, key[1], key[2])
    if len(_groups) >= _GROUPS_MAX:
        _groups.clear()
    hit = _groups[key] = (repeat, values)  # a dict (dict.update takes it fast), never changed
    return hit


def _names(attrs: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in attrs.items():
        if value is None:
            continue
        name = ATTRIBUTES.get(key)
        if name is None:
            if "." not in key:
                raise TypeError(f"unknown trace attribute {key!r}; known: {', '.join(ATTRIBUTES)}")
            name = key
        out[name] = value
    return out
