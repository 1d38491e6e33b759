"""The SDK path for exporters other than OTLP/HTTP (console, otlp_grpc, one given in code): a
finished trace as SDK `ReadableSpan`s, handed to the SDK's span processor."""

from __future__ import annotations

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from .trace_record import ROOT_SPAN, RequestTrace

__all__ = ["SdkSpans"]


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
