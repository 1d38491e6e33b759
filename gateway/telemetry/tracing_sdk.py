"""The SDK path for exporters other than OTLP/HTTP (console, otlp_grpc, one given in code): a
finished trace as SDK `ReadableSpan`s, handed to the SDK's span processor."""

from __future__ import annotations

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from gateway.telemetry.trace import ROOT_SPAN, SPAN_KINDS, RequestTrace

__all__ = ["SdkSpans"]

_KINDS = {name: SpanKind[kind] for name, kind in SPAN_KINDS.items()}


class SdkSpans:
    """The SDK path: a finished trace as `ReadableSpan`s (children first), into a span processor.

    The processor's `on_start` is not called (the spans are made finished); the span limits
    (OTEL_SPAN_ATTRIBUTE_*) apply to every span's attributes as on SDK spans.
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
        limits = self._limits
        out = [
            ReadableSpan(
                name,
                SpanContext(rt.tid, span_id, False, sampled, ts),
                root,
                self._resource,
                BoundedAttributes(
                    limits.max_span_attributes, attrs, True, limits.max_span_attribute_length
                ),
                kind=_KINDS.get(name, SpanKind.INTERNAL),
                status=Status(StatusCode.ERROR, error) if error is not None else Status(),
                start_time=start,
                end_time=end,
                instrumentation_scope=self._scope,
            )
            for name, span_id, start, end, attrs, error in rt.segments
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
