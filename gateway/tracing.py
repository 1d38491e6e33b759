"""OpenTelemetry traces of the gateway: one TracerProvider per gateway, no global tracer state.

The request path records plain timestamps; `RequestTrace.finish` turns them into spans at the end.
What the settings resolve to (exporter, endpoint, sampler) is `tracing_config.py`.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.version import __version__ as _SDK_VERSION
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
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
    "Settings",
    "Tracing",
    "TracingConfig",
    "TracingError",
    "build_exporter",
    "resolve",
    "resolve_exporter",
]

log = logging.getLogger("gateway.tracing")

Segment = tuple[int, int]

ROOT_SPAN = "gateway.request"
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
_TTFT, _TPOT = ATTRIBUTES["ttft_s"], ATTRIBUTES["tpot_s"]
_OUTPUT, _OUTCOME = ATTRIBUTES["output_tokens"], ATTRIBUTES["outcome"]
_STATUS, _ERROR_TYPE = ATTRIBUTES["status_code"], ATTRIBUTES["error_type"]


class Tracing:
    """One gateway's tracer: its own TracerProvider, sampler, resource and exporter.

    `exporter=` (tests) overrides the configured one and is flushed synchronously; a configured
    exporter runs behind a BatchSpanProcessor, so exporting never blocks a request.
    """

    def __init__(
        self,
        config: TracingConfig | None = None,
        *,
        exporter: SpanExporter | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.settings = resolve(config, os.environ if environ is None else environ)
        processor: SpanProcessor | None = None
        if exporter is not None:
            processor = SimpleSpanProcessor(exporter)
        elif (built := build_exporter(self.settings)) is not None:
            processor = BatchSpanProcessor(built)
        self.enabled = processor is not None
        self._provider: TracerProvider | None = None
        self._tracer: Tracer | None = None
        self._propagator = TraceContextTextMapPropagator()
        if processor is not None:
            self._provider = TracerProvider(
                sampler=self.settings.sampler,
                resource=_resource(self.settings),
                shutdown_on_exit=False,  # the gateway's lifespan calls shutdown(); no atexit hooks
            )
            self._provider.add_span_processor(processor)
            self._tracer = self._provider.get_tracer("gateway", _version())

    def start(self, headers: Mapping[bytes, bytes], start_ns: int) -> RequestTrace | None:
        """Open the root span at `start_ns` (epoch ns), continuing an incoming W3C traceparent."""
        tracer = self._tracer
        if tracer is None:
            return None
        ctx = Context()  # never parent on whatever span happens to be current
        if b"traceparent" in headers:
            ctx = self._propagator.extract(headers, ctx, getter=_BYTES_GETTER)
        span = tracer.start_span(ROOT_SPAN, ctx, SpanKind.SERVER, start_time=start_ns)
        return RequestTrace(tracer, span, start_ns)

    def shutdown(self) -> None:
        """Flush pending spans and stop the export thread (blocks up to the exporter's timeout)."""
        provider, self._provider, self._tracer = self._provider, None, None
        self.enabled = False
        if provider is not None:
            provider.shutdown()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.shutdown)


class RequestTrace:
    """One request's root span; segments become child spans only in `finish`."""

    __slots__ = ("_tracer", "_span", "_recording", "_offset", "_done", "start_ns")

    def __init__(self, tracer: Tracer, span: Span, start_ns: int) -> None:
        self._tracer = tracer
        self._span = span
        self._recording = span.is_recording()
        self._offset = time.time_ns() - time.perf_counter_ns()
        self._done = False
        self.start_ns = start_ns

    @property
    def trace_id(self) -> str:
        return f"{self._span.get_span_context().trace_id:032x}"

    @property
    def sampled(self) -> bool:
        return self._recording

    def traceparent(self) -> str:
        """The W3C header for the upstream request; its parent is the root span."""
        sc = self._span.get_span_context()
        return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{sc.trace_flags:02x}"

    def tracestate(self) -> str | None:
        """The incoming tracestate to forward upstream, or None."""
        ts = self._span.get_span_context().trace_state
        return ts.to_header() if ts else None

    def epoch_ns(self, perf_counter_ns: int) -> int:
        """A `time.perf_counter_ns()` reading as epoch ns, on the clock offset taken at start."""
        return perf_counter_ns + self._offset

    def set(self, attrs: Mapping[str, Any] | None = None, /, **kw: Any) -> None:
        """Root attributes: keywords are ATTRIBUTES keys; the mapping may also use dotted names."""
        if not self._recording:
            return
        values = _names(attrs) if attrs else {}
        if kw:
            values.update(_names(kw))
        if values:
            self._span.set_attributes(values)

    def finish(
        self,
        *,
        queue: Segment | None = None,
        route: Segment | None = None,
        prefill: Segment | None = None,
        decode: Segment | None = None,
        end_ns: int,
        attrs: Mapping[str, Any] | None = None,
        error_type: str | None = None,
    ) -> None:
        """Create the given segments (epoch ns) as children, in order, then end the root.

        A segment that starts before the previous one ended is moved up to that end, so the
        segments never overlap; `gateway.ttft_s` and `gateway.tpot_s` are derived when not given.
        """
        if self._done:
            return
        self._done = True
        span = self._span
        if not self._recording:
            span.end(end_time=end_ns)
            return
        values = _names(attrs) if attrs else {}
        tracer = self._tracer
        parent = trace.set_span_in_context(span, Context())
        prev = self.start_ns
        for name, seg in zip(SEGMENTS, (route, queue, prefill, decode), strict=True):
            if seg is None:
                continue
            s = max(seg[0], prev)
            prev = max(seg[1], s)
            tracer.start_span(name, parent, start_time=s).end(end_time=prev)
        if prefill is not None and _TTFT not in values:
            values[_TTFT] = (max(prefill[1], self.start_ns) - self.start_ns) / 1e9
        out = values.get(_OUTPUT)
        if decode is not None and _TPOT not in values and isinstance(out, int) and out > 1:
            values[_TPOT] = max(decode[1] - decode[0], 0) / 1e9 / (out - 1)
        status = values.get(_STATUS)
        # HTTP semantic conventions: a 5xx is an error of a server span, error.type its code
        if error_type is None and isinstance(status, int) and status >= 500:
            error_type = str(status)
        if error_type is not None:
            values[_ERROR_TYPE] = error_type
            values.setdefault(_OUTCOME, "error")
            span.set_status(Status(StatusCode.ERROR, error_type))
        else:
            values.setdefault(_OUTCOME, "ok")
        span.set_attributes(values)
        span.end(end_time=max(end_ns, prev))


# --- helpers -------------------------------------------------------------------------------------


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
