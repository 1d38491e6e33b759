"""OpenTelemetry traces of the gateway: one per request, built once the request is over.

The request path records plain timestamps. `Tracing.start` decides sampling (the configured
sampler, parent-based by default) and continues an incoming W3C `traceparent`; `RequestTrace.finish`
turns the timestamps into the finished spans in one go and hands them to the gateway's span sink:

- OTLP/HTTP (`otlp.py`): encodes the fixed span shape straight to OTLP protobuf and exports it in
  large batches from a background thread. No SDK span objects are made.
- any other exporter (console, otlp_grpc, or one given in code): `SdkSpans` makes SDK
  `ReadableSpan`s and passes them to the SDK's span processor and that exporter.

What the settings resolve to (exporter, endpoint, sampler) is `tracing_config.py`.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import os
import random
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.sdk.version import __version__ as _SDK_VERSION
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .tracing_config import (
    Settings,
    TracingConfig,
    TracingError,
    build_exporter,
    resolve,
    resolve_exporter,
)

__all__ = [
    "ATTRIBUTES",
    "SEGMENTS",
    "RequestTrace",
    "SdkSpans",
    "Settings",
    "SpanSink",
    "Tracing",
    "TracingConfig",
    "TracingError",
    "build_exporter",
    "resolve",
    "resolve_exporter",
]

log = logging.getLogger("gateway.tracing")

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


class Tracing:
    """One gateway's traces: its sampler, resource and span sink; no global OpenTelemetry state.

    `exporter=` (tests) overrides the configured one and exports synchronously; the configured
    `otlp_http` exporter is the gateway's own (`otlp.py`), any other runs behind the SDK's
    BatchSpanProcessor. Either way exporting never blocks a request.
    """

    def __init__(
        self,
        config: TracingConfig | None = None,
        *,
        exporter: SpanExporter | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        self.settings = resolve(config, env)
        self.sink: SpanSink | None = None
        self.resource = resource = _resource(self.settings)
        self.scope = scope = InstrumentationScope(SCOPE_NAME, _version())
        if exporter is not None:
            self.sink = SdkSpans(SimpleSpanProcessor(exporter), resource, scope)
        elif self.settings.exporter == "otlp_http":
            from .otlp import OtlpHttpSink

            self.sink = OtlpHttpSink(self.settings, resource, scope, env)
        elif (built := build_exporter(self.settings)) is not None:
            self.sink = SdkSpans(BatchSpanProcessor(built), resource, scope)
        self.enabled = self.sink is not None
        self._sampler = self.settings.sampler
        self._root_bound = self.settings.root_bound
        self._propagator = TraceContextTextMapPropagator()

    def start(self, headers: Mapping[bytes, bytes], start_ns: int) -> RequestTrace | None:
        """Open the request's trace at `start_ns` (epoch ns), continuing an incoming traceparent."""
        sink = self.sink
        if sink is None:
            return None
        if b"traceparent" not in headers:  # a new trace: the sampler's root decision, inline
            trace_id = _getrandbits(128) or 1
            sampled = trace_id & _LOW64 < self._root_bound
            return RequestTrace(
                sink, trace_id, _getrandbits(64) or 1, None, None, sampled, start_ns
            )
        # never parent on whatever span happens to be current
        ctx = self._propagator.extract(headers, Context(), getter=_BYTES_GETTER)
        parent: SpanContext | None = trace.get_current_span(ctx).get_span_context()
        if parent is None or not parent.is_valid:
            parent, ctx = None, Context()
        trace_id = parent.trace_id if parent is not None else _getrandbits(128) or 1
        result = self._sampler.should_sample(ctx, trace_id, ROOT_SPAN, SpanKind.SERVER)
        rt = RequestTrace(
            sink,
            trace_id,
            _getrandbits(64) or 1,
            parent,
            result.trace_state,
            result.decision is Decision.RECORD_AND_SAMPLE,
            start_ns,
        )
        if rt.sampled and result.attributes:
            rt.attributes.update(result.attributes)
        return rt

    def shutdown(self) -> None:
        """Flush pending spans and stop exporting (blocks up to the exporter's timeout)."""
        sink, self.sink = self.sink, None
        self.enabled = False
        if sink is not None:
            sink.shutdown()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.shutdown)


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


class SdkSpans:
    """The SDK path: a finished trace as `ReadableSpan`s (children first), into a span processor.

    The processor's `on_start` is not called (the spans are made finished); the span limits
    (OTEL_SPAN_ATTRIBUTE_*) apply to the root's attributes as on SDK spans.
    """

    def __init__(
        self, processor: SpanProcessor, resource: Resource, scope: InstrumentationScope
    ) -> None:
        self._processor = processor
        self._resource = resource
        self._scope = scope
        self._limits = SpanLimits()

    def spans(self, rt: RequestTrace) -> list[ReadableSpan]:
        ts = rt.trace_state if rt.trace_state is not None else TraceState()
        sampled = TraceFlags(TraceFlags.SAMPLED)
        root = SpanContext(rt.tid, rt.sid, False, sampled, ts)
        out = [
            ReadableSpan(
                name,
                SpanContext(rt.tid, span_id, False, sampled, ts),
                root,
                self._resource,
                BoundedAttributes(self._limits.max_span_attributes, {}, True),
                kind=SpanKind.INTERNAL,
                start_time=start,
                end_time=end,
                instrumentation_scope=self._scope,
            )
            for name, span_id, start, end in rt.segments
        ]
        attributes = BoundedAttributes(
            self._limits.max_span_attributes,
            rt.attributes,
            True,
            self._limits.max_span_attribute_length,
        )
        status = Status(StatusCode.ERROR, rt.error) if rt.error is not None else Status()
        out.append(
            ReadableSpan(
                ROOT_SPAN,
                root,
                rt.parent,
                self._resource,
                attributes,
                kind=SpanKind.SERVER,
                status=status,
                start_time=rt.start_ns,
                end_time=rt.end_ns,
                instrumentation_scope=self._scope,
            )
        )
        return out

    def end(self, trace: RequestTrace) -> None:
        trace.build()
        for span in self.spans(trace):
            self._processor.on_end(span)

    def shutdown(self) -> None:
        self._processor.shutdown()


# --- helpers -------------------------------------------------------------------------------------

_LOW64 = (1 << 64) - 1  # TraceIdRatioBased decides on the low 64 bits of the trace id
_getrandbits = random.getrandbits  # what the SDK's RandomIdGenerator uses


def _resource(settings: Settings) -> Resource:
    attrs: dict[str, str] = {
        "telemetry.sdk.language": "python",
        "telemetry.sdk.name": "opentelemetry",
        "telemetry.sdk.version": _SDK_VERSION,
        **settings.resource,
        "service.name": settings.service_name,
    }
    if version := _version():
        attrs.setdefault("service.version", version)
    return Resource(attrs)


def _version() -> str | None:
    try:
        return importlib.metadata.version("kvgateway")
    except importlib.metadata.PackageNotFoundError:
        return None


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


class _BytesGetter(Getter[Mapping[bytes, bytes]]):
    """Reads propagation headers from the raw ASGI header dict (lowercased bytes keys)."""

    def get(self, carrier: Mapping[bytes, bytes], key: str) -> list[str] | None:
        value = carrier.get(key.encode("latin-1"))
        return None if value is None else [value.decode("latin-1")]

    def keys(self, carrier: Mapping[bytes, bytes]) -> list[str]:
        return [k.decode("latin-1") for k in carrier]


_BYTES_GETTER = _BytesGetter()
