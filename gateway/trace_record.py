"""One request's trace as the request path records it (`RequestTrace`), and the span shape.

`tracing.py` opens a trace per request and picks the sink; the sinks (`otlp.py` for OTLP/HTTP,
`tracing_sdk.py` for the SDK's exporters) read finished traces from here.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from opentelemetry.trace import SpanContext, TraceState

__all__ = ["ATTRIBUTES", "ROOT_SPAN", "SCOPE_NAME", "SEGMENTS", "RequestTrace", "SpanSink"]

_getrandbits = random.getrandbits  # what the SDK's RandomIdGenerator uses

Segment = tuple[int, int]
# what RequestTrace.finish was given: route, queue, prefill, decode, end_ns, named, error_type
_Given = tuple[
    Segment | None,
    Segment | None,
    Segment | None,
    Segment | None,
    int,
    "Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None",
    str | None,
]

ROOT_SPAN = "gateway.request"
SCOPE_NAME = "gateway"
# the child spans of the root, in the order a request passes through them: the route span is hash
# + index match, before the admission queue; the policy's choice (microseconds) ends the queue
SEGMENTS = ("gateway.route", "gateway.queue", "upstream.prefill", "upstream.decode")

# keyword of RequestTrace.set / key of finish(attrs=...) → span attribute name
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
}
_ROUTE, _QUEUE, _PREFILL, _DECODE = SEGMENTS
_TTFT, _TPOT = ATTRIBUTES["ttft_s"], ATTRIBUTES["tpot_s"]
_OUTPUT, _OUTCOME = ATTRIBUTES["output_tokens"], ATTRIBUTES["outcome"]
_STATUS, _ERROR_TYPE = ATTRIBUTES["status_code"], ATTRIBUTES["error_type"]


class SpanSink(Protocol):
    """Where finished, sampled traces go: `end` runs on the event loop and must never block.

    It calls `trace.build()` (now or later, on any one thread) before reading the spans.
    """

    def end(self, trace: RequestTrace) -> None: ...

    def shutdown(self) -> None: ...


class RequestTrace:
    """One request's trace: the root span's identity while the request runs, its spans after.

    `tid` and `sid` are the trace's and the root span's ids (ints). `finish` only keeps what it
    is given and passes the trace to the sink; `build` (the sink calls it, on the export thread
    for OTLP/HTTP) turns that into `segments` (name, span id, start, end) of the child spans,
    the root's `attributes`, its `error` status and `end_ns`.
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
        self.spans = 1  # how many spans `finish` was given: the root and its segments
        self.segments: list[tuple[str, int, int, int]] = []
        self.attributes: dict[str, Any] = {}
        self.error: str | None = None

    @property
    def trace_id(self) -> str:
        return f"{self.tid:032x}"

    def traceparent(self) -> str:
        """The W3C header for the upstream request; its parent is the root span."""
        return f"00-{self.tid:032x}-{self.sid:016x}-{'01' if self.sampled else '00'}"

    def tracestate(self) -> str | None:
        """The incoming tracestate to forward upstream, or None."""
        ts = self.trace_state
        return ts.to_header() if ts else None

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
        end_ns: int,
        attrs: Mapping[str, Any] | None = None,
        named: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None,
        error_type: str | None = None,
    ) -> None:
        """End the trace: the given segments (epoch ns) become child spans, in order.

        `attrs` are root attributes as in `set` (checked now); `named` are more, by span
        attribute name and without None values, or a function that returns them when the spans
        are built (the request path's form: nothing is named on the event loop). A segment that
        starts before the previous one ended is moved up to that end, so the segments never
        overlap; `gateway.ttft_s` and `gateway.tpot_s` are derived when not given.
        """
        if self._done:
            return
        self._done = True
        if not self.sampled:
            return
        if attrs:
            self.attributes.update(_names(attrs))
        self._given = (route, queue, prefill, decode, end_ns, named, error_type)
        self.spans = 1 + sum(seg is not None for seg in (route, queue, prefill, decode))
        self._sink.end(self)

    def build(self) -> None:
        """The spans from what `finish` was given (once; the sink calls it)."""
        given, self._given = self._given, None
        if given is None:
            return
        route, queue, prefill, decode, end_ns, named, error_type = given
        values = self.attributes
        if named:
            values.update(named() if callable(named) else named)
        segments = self.segments
        start = prev = self.start_ns
        for name, seg in ((_ROUTE, route), (_QUEUE, queue), (_PREFILL, prefill), (_DECODE, decode)):
            if seg is not None:
                s = seg[0] if seg[0] > prev else prev
                prev = seg[1] if seg[1] > s else s
                segments.append((name, _getrandbits(64) or 1, s, prev))
        if prefill is not None and _TTFT not in values:
            values[_TTFT] = (max(prefill[1], start) - start) / 1e9
        if decode is not None and _TPOT not in values:
            out = values.get(_OUTPUT)
            if isinstance(out, int) and out > 1:
                values[_TPOT] = max(decode[1] - decode[0], 0) / 1e9 / (out - 1)
        if error_type is None:
            status = values.get(_STATUS)
            # HTTP semantic conventions: a 5xx is an error of a server span, error.type its code
            if isinstance(status, int) and status >= 500:
                error_type = str(status)
        if error_type is not None:
            values[_ERROR_TYPE] = error_type
            values.setdefault(_OUTCOME, "error")
            self.error = error_type
        else:
            values.setdefault(_OUTCOME, "ok")
        self.end_ns = max(end_ns, prev)


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
