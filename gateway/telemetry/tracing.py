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
from collections.abc import Mapping
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.sdk.version import __version__ as _SDK_VERSION
from opentelemetry.trace import SpanContext, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.telemetry.trace import (
    ATTEMPT_ATTRIBUTES,
    ATTEMPT_SPAN,
    ATTRIBUTES,
    ROOT_SPAN,
    SCOPE_NAME,
    SEGMENTS,
    RequestTrace,
    SpanSink,
    _getrandbits,
)
from gateway.telemetry.tracing_config import (
    Settings,
    TracingConfig,
    TracingError,
    build_exporter,
    resolve,
    resolve_exporter,
)
from gateway.telemetry.tracing_sdk import SdkSpans

__all__ = [
    "ATTEMPT_ATTRIBUTES",
    "ATTEMPT_SPAN",
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
            from gateway.telemetry.otlp import OtlpHttpSink

            self.sink = OtlpHttpSink(self.settings, resource, scope, env)
        elif (built := build_exporter(self.settings)) is not None:
            self.sink = SdkSpans(BatchSpanProcessor(built), resource, scope)
        self.enabled = self.sink is not None
        if self.enabled:
            log.info(
                "tracing on: exporter %s, endpoint %s, sampler %s, service.name %s",
                type(exporter).__name__ if exporter is not None else self.settings.exporter,
                _safe_url(self.settings.endpoint) if exporter is None else "-",
                self.settings.sampler.get_description(),
                self.settings.service_name,
            )
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
                sink, trace_id, _getrandbits(64) or 1, None, None, sampled, start_ns,
                headers.get(b"host"), headers.get(b"user-agent"),
            )  # fmt: skip
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
            headers.get(b"host"),
            headers.get(b"user-agent"),
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


# --- helpers -------------------------------------------------------------------------------------

_LOW64 = (1 << 64) - 1  # TraceIdRatioBased decides on the low 64 bits of the trace id


def _safe_url(url: str | None) -> str:
    """An endpoint as logged: no user info, query or fragment (they may hold credentials)."""
    if not url:
        return "-"
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"


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


class _BytesGetter(Getter[Mapping[bytes, bytes]]):
    """Reads propagation headers from the raw ASGI header dict (lowercased bytes keys)."""

    def get(self, carrier: Mapping[bytes, bytes], key: str) -> list[str] | None:
        value = carrier.get(key.encode("latin-1"))
        return None if value is None else [value.decode("latin-1")]

    def keys(self, carrier: Mapping[bytes, bytes]) -> list[str]:
        return [k.decode("latin-1") for k in carrier]


_BYTES_GETTER = _BytesGetter()
