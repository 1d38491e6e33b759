"""Tracing: the spans a request produces, W3C propagation, and how config and OTEL_* pick the exporter.

Spans are checked with an InMemorySpanExporter; the OTLP/HTTP exporter against real loopback
collectors is test_gw_otlp.py.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import ConsoleSpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from pydantic import SecretStr, ValidationError

from bench.harness import free_port
from gateway import create_app, parse_config
from gateway.errors import ERROR_TYPES
from gateway.forwarding.relay import Retryable, attempt_outcome
from gateway.telemetry.trace import ROOT_SPAN, ROUTE_ATTRIBUTES, SPAN_KINDS, TYPES
from gateway.telemetry.tracing import (
    ATTEMPT_ATTRIBUTES,
    ATTRIBUTES,
    SEGMENTS,
    RequestTrace,
    Tracing,
    TracingConfig,
    TracingError,
    resolve,
    resolve_exporter,
)
from policies.base import COLD, GUARD, HOME, NO_CANDIDATES, ONLY_CANDIDATE, TIE
from policies.registry import TABLE, _lookup
from tests.gateway.fake_replica import Upstream
from tests.support import start_server

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
INCOMING = f"00-{TRACE_ID}-{PARENT_ID}-01".encode()
TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
HAS_HTTP = importlib.util.find_spec("opentelemetry.exporter.otlp.proto.http") is not None
HAS_GRPC = importlib.util.find_spec("opentelemetry.exporter.otlp.proto.grpc") is not None
MS = 1_000_000
CHAT = [{"role": "user", "content": "hello"}]
STREAMED = SEGMENTS[:4]  # route, queue, prefill, decode: a streamed answer's segments


@pytest.fixture
def memory() -> Iterator[tuple[Tracing, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    tracing = Tracing(None, exporter=exporter, environ={})
    yield tracing, exporter
    tracing.shutdown()


def by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    return {s.name: s for s in spans}


def times(span: ReadableSpan) -> tuple[int, int]:
    assert span.start_time is not None and span.end_time is not None
    return span.start_time, span.end_time


def started(tracing: Tracing, headers: dict[bytes, bytes] | None = None) -> RequestTrace:
    rt = tracing.start(headers or {}, time.time_ns())
    assert rt is not None
    return rt


def test_a_request_with_all_four_segments(memory: tuple[Tracing, InMemorySpanExporter]) -> None:
    tracing, exporter = memory
    t0 = time.time_ns()
    rt = tracing.start({}, t0)
    assert rt is not None and rt.sampled
    rt.set(tenant="acme", priority=1, model="llama", pool="chat", missing=None)
    rt.finish(
        queue=(t0 + 1 * MS, t0 + 3 * MS),
        route=(t0 + 3 * MS, t0 + 4 * MS),
        prefill=(t0 + 5 * MS, t0 + 105 * MS),
        decode=(t0 + 105 * MS, t0 + 505 * MS),
        end_ns=t0 + 506 * MS,
        attrs={
            "replica": "r1",
            "policy": "prefix",
            "route_reason": "prefix_hit",
            "input_tokens": 812,
            "prompt_tokens_estimated": 800,
            "predicted_cached_blocks": 40,
            "prompt_blocks": 50,
            "output_tokens": 101,
            "retries": 1,
            "replicas_tried": ["r0", "r1"],
            "status_code": 200,
        },
        error_type=None,
    )
    spans = by_name(exporter.get_finished_spans())
    assert set(spans) == {"gateway.request", *STREAMED}
    root = spans["gateway.request"]
    assert root.kind is SpanKind.SERVER and root.parent is None
    assert (root.start_time, root.end_time) == (t0, t0 + 506 * MS)
    assert root.status.status_code is StatusCode.UNSET
    children = [spans[name] for name in STREAMED]
    for child in children:
        assert child.parent is not None and child.parent.span_id == root.context.span_id
        assert child.context.trace_id == root.context.trace_id
        assert times(root)[0] <= times(child)[0] <= times(child)[1] <= times(root)[1]
    for before, after in zip(children, children[1:], strict=False):
        assert times(before)[1] <= times(after)[0]
    assert times(spans["upstream.prefill"]) == (
        t0 + 5 * MS,
        t0 + 105 * MS,
    )
    a = root.attributes
    assert a is not None
    assert a["gateway.tenant"] == "acme" and a["gen_ai.request.model"] == "llama"
    assert a["gateway.pool"] == "chat" and a["gateway.replica"] == "r1"
    assert a["gateway.route.reason"] == "prefix_hit" and a["gateway.policy"] == "prefix"
    assert a["gen_ai.usage.input_tokens"] == 812 and a["gateway.prompt_tokens.estimated"] == 800
    assert (
        a["gateway.prefix.predicted_cached_blocks"] == 40
        and a["gateway.prefix.prompt_blocks"] == 50
    )
    assert a["gateway.replicas_tried"] == ("r0", "r1") and a["gateway.retries"] == 1
    assert a["gateway.outcome"] == "ok" and a["http.response.status_code"] == 200
    assert a["gateway.ttft_s"] == pytest.approx(0.105)  # derived: request in → first token
    assert a["gateway.tpot_s"] == pytest.approx(0.4 / 100)  # derived: decode / (output - 1)
    assert "error.type" not in a


def test_only_given_segments_and_overlaps_are_moved_up(
    memory: tuple[Tracing, InMemorySpanExporter],
) -> None:
    tracing, exporter = memory
    t0 = time.time_ns()
    rt = started(tracing)
    rt.finish(route=(t0, t0 + 10 * MS), prefill=(t0 + 5 * MS, t0 + 8 * MS), end_ns=t0)
    spans = by_name(exporter.get_finished_spans())
    assert set(spans) == {"gateway.request", "gateway.route", "upstream.prefill"}
    prefill = spans["upstream.prefill"]
    assert prefill.start_time == prefill.end_time == t0 + 10 * MS  # clamped, never overlapping
    assert spans["gateway.request"].end_time == t0 + 10 * MS  # the root covers its children


def test_an_error_sets_status_and_outcome(memory: tuple[Tracing, InMemorySpanExporter]) -> None:
    tracing, exporter = memory
    rt = started(tracing)
    rt.finish(end_ns=time.time_ns(), attrs={"status_code": 504}, error_type="upstream_timeout")
    rt2 = started(tracing)
    rt2.finish(end_ns=time.time_ns(), attrs={"status_code": 502})
    first, second = exporter.get_finished_spans()
    for span, kind in ((first, "upstream_timeout"), (second, "502")):
        assert span.status.status_code is StatusCode.ERROR and span.status.description == kind
        assert span.attributes is not None
        assert span.attributes["error.type"] == kind
        assert span.attributes["gateway.outcome"] == "error"
    # a 4xx: error.type says which, but a server span's status stays unset (the client's error)
    rt3 = started(tracing)
    rt3.finish(end_ns=time.time_ns(), attrs={"status_code": 429}, error_type="rate_limit_error")
    third = exporter.get_finished_spans()[2]
    assert third.status.status_code is StatusCode.UNSET
    assert third.attributes is not None and third.attributes["error.type"] == "rate_limit_error"


def test_outcome_given_by_the_caller_is_kept(memory: tuple[Tracing, InMemorySpanExporter]) -> None:
    tracing, exporter = memory
    rt = started(tracing)
    rt.finish(end_ns=time.time_ns(), attrs={"outcome": "client_disconnected"})
    rt.finish(end_ns=time.time_ns(), error_type="late")  # a second finish is ignored
    (root,) = exporter.get_finished_spans()
    assert (
        root.attributes is not None and root.attributes["gateway.outcome"] == "client_disconnected"
    )
    assert root.status.status_code is StatusCode.UNSET


def test_incoming_traceparent_is_continued(memory: tuple[Tracing, InMemorySpanExporter]) -> None:
    tracing, exporter = memory
    rt = started(tracing, {b"traceparent": INCOMING, b"tracestate": b"vendor=abc"})
    assert rt.trace_id == TRACE_ID
    assert rt.tracestate() == "vendor=abc"
    rt.finish(prefill=(rt.start_ns, rt.start_ns + MS), end_ns=rt.start_ns + 2 * MS)
    spans = by_name(exporter.get_finished_spans())
    root = spans["gateway.request"]
    assert f"{root.context.trace_id:032x}" == TRACE_ID
    assert root.parent is not None and f"{root.parent.span_id:016x}" == PARENT_ID
    assert root.parent.is_remote
    assert f"{spans['upstream.prefill'].context.trace_id:032x}" == TRACE_ID


def test_traceparent_for_upstream_names_the_root_span(
    memory: tuple[Tracing, InMemorySpanExporter],
) -> None:
    tracing, exporter = memory
    rt = started(tracing)
    m = TRACEPARENT.match(rt.traceparent())
    assert m is not None
    assert m.group(1) == rt.trace_id and int(m.group(3), 16) & 1  # sampled
    assert rt.tracestate() is None
    rt.finish(end_ns=time.time_ns())
    (root,) = exporter.get_finished_spans()
    assert m.group(2) == f"{root.context.span_id:016x}"


@pytest.mark.parametrize(
    "header",
    [b"garbage", b"ff-" + INCOMING[3:], b"00-" + b"0" * 32 + b"-" + PARENT_ID.encode() + b"-01"],
)
def test_an_invalid_traceparent_starts_a_new_trace(
    memory: tuple[Tracing, InMemorySpanExporter], header: bytes
) -> None:
    tracing, _ = memory
    rt = started(tracing, {b"traceparent": header})
    assert rt.trace_id not in (TRACE_ID, "0" * 32)
    assert TRACEPARENT.match(rt.traceparent())


def test_set_names_attributes_strictly(memory: tuple[Tracing, InMemorySpanExporter]) -> None:
    tracing, exporter = memory
    rt = started(tracing)
    with pytest.raises(TypeError, match="unknown trace attribute 'replca'"):
        rt.set(replca="r1")
    rt.set({"gateway.custom": "x", "pool": "p"}, retries=0)
    rt.finish(end_ns=time.time_ns())
    (root,) = exporter.get_finished_spans()
    assert root.attributes is not None
    assert root.attributes["gateway.custom"] == "x" and root.attributes["gateway.pool"] == "p"
    assert root.attributes["gateway.retries"] == 0


def test_epoch_ns_converts_perf_counter_readings(
    memory: tuple[Tracing, InMemorySpanExporter],
) -> None:
    """The converted reading falls between the wall-clock readings taken around it, give or take
    how long the offset's own two readings could have been apart (at most the start call)."""
    tracing, _ = memory
    t0 = time.time_ns()
    rt = started(tracing)
    spread = time.time_ns() - t0  # the offset was taken in here
    before = time.time_ns()
    reading = time.perf_counter_ns()
    after = time.time_ns()
    assert before - spread <= rt.epoch_ns(reading) <= after


def test_every_documented_attribute_has_a_dotted_name() -> None:
    assert all("." in name for name in ATTRIBUTES.values())
    assert len(set(ATTRIBUTES.values())) == len(ATTRIBUTES)


@pytest.mark.parametrize(
    ("config", "environ"),
    [
        (None, {}),
        (TracingConfig(exporter="none"), {"OTEL_TRACES_EXPORTER": "console"}),
        (None, {"OTEL_TRACES_EXPORTER": "none"}),
        (None, {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}),
    ],
)
def test_disabled_tracing_starts_nothing(
    config: TracingConfig | None, environ: dict[str, str]
) -> None:
    tracing = Tracing(config, environ=environ)
    assert not tracing.enabled
    assert tracing.start({b"traceparent": INCOMING}, time.time_ns()) is None
    tracing.shutdown()


def test_ratio_zero_exports_nothing_but_still_propagates() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing(TracingConfig(sampling_ratio=0.0), exporter=exporter, environ={})
    rt = started(tracing)
    assert not rt.sampled
    assert not int(rt.traceparent()[-2:], 16) & 1  # upstream learns the trace is not sampled
    rt.set(pool="p", bogus_is_not_checked_when_unsampled=1)
    rt.finish(queue=(rt.start_ns, rt.start_ns + 1), end_ns=rt.start_ns + 2)
    assert exporter.get_finished_spans() == ()
    # parent-based: a caller that sampled its trace keeps it whole
    sampled = started(tracing, {b"traceparent": INCOMING})
    sampled.finish(end_ns=time.time_ns())
    assert [s.name for s in exporter.get_finished_spans()] == ["gateway.request"]
    tracing.shutdown()


def test_sampler_from_env() -> None:
    env = {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"}
    assert resolve(None, env).sampler.get_description() == "TraceIdRatioBased{0.25}"
    env = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.5"}
    assert "TraceIdRatioBased{0.5}" in resolve(None, env).sampler.get_description()
    assert resolve(None, {"OTEL_TRACES_SAMPLER": "always_off"}).sampler.get_description() == (
        "AlwaysOffSampler"
    )
    default = resolve(None, {}).sampler.get_description()
    assert default.startswith("ParentBased{root:AlwaysOnSampler")
    configured = resolve(TracingConfig(sampling_ratio=0.1), {"OTEL_TRACES_SAMPLER": "always_off"})
    assert "TraceIdRatioBased{0.1}" in configured.sampler.get_description()


def test_always_off_from_env_exports_nothing() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing(None, exporter=exporter, environ={"OTEL_TRACES_SAMPLER": "always_off"})
    rt = started(tracing, {b"traceparent": INCOMING})
    rt.finish(end_ns=time.time_ns())
    assert exporter.get_finished_spans() == ()
    tracing.shutdown()


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER='zipkin'"),
        ({"OTEL_TRACES_EXPORTER": "otlp,console"}, "OTEL_TRACES_EXPORTER"),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
            "OTEL_EXPORTER_OTLP_PROTOCOL='http/json'",
        ),
        ({"OTEL_TRACES_SAMPLER": "jaeger_remote"}, "OTEL_TRACES_SAMPLER='jaeger_remote'"),
        (
            {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"},
            "OTEL_TRACES_SAMPLER_ARG='2'",
        ),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_HEADERS": "novalue"},
            "OTEL_EXPORTER_OTLP_HEADERS",
        ),
    ],
)
def test_bad_environment_values_are_named(environ: dict[str, str], message: str) -> None:
    with pytest.raises(TracingError, match=re.escape(message)):
        resolve(None, environ)


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValidationError, match="only to the otlp exporters"):
        TracingConfig(exporter="console", endpoint="http://collector:4318")
    with pytest.raises(ValidationError, match="not an http"):
        TracingConfig(endpoint="collector:4318")
    with pytest.raises(ValidationError):
        TracingConfig(sampling_ratio=1.5)
    with pytest.raises(ValidationError):
        TracingConfig(exporter="otlp")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        TracingConfig.model_validate({"exporter": "none", "sample": 1})


def test_env_picks_console() -> None:
    exporter = resolve_exporter(None, {"OTEL_TRACES_EXPORTER": "console"})
    assert isinstance(exporter, ConsoleSpanExporter)
    assert resolve_exporter(None, {}) is None


@pytest.mark.skipif(not HAS_HTTP, reason="opentelemetry-exporter-otlp-proto-http is not installed")
def test_env_picks_otlp_http_by_default() -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    env = {"OTEL_TRACES_EXPORTER": "otlp"}
    exporter = resolve_exporter(None, env)
    assert isinstance(exporter, OTLPSpanExporter)
    exporter.shutdown()  # type: ignore[no-untyped-call]
    env["OTEL_EXPORTER_OTLP_PROTOCOL"] = "http/protobuf"
    assert resolve(None, env).exporter == "otlp_http"
    # config wins over the environment
    assert resolve(TracingConfig(exporter="console"), env).exporter == "console"


def test_env_picks_otlp_grpc() -> None:
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    settings = resolve(None, env)
    assert settings.exporter == "otlp_grpc" and settings.endpoint == "http://localhost:4317"
    env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"  # signal-specific wins
    assert resolve(None, env).exporter == "otlp_http"
    if not HAS_GRPC:
        with pytest.raises(TracingError, match=r"kvgateway\[otlp-grpc\]"):
            resolve_exporter(TracingConfig(exporter="otlp_grpc"), {})
        return
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    exporter = resolve_exporter(TracingConfig(exporter="otlp_grpc"), {})
    assert isinstance(exporter, OTLPSpanExporter)
    exporter.shutdown()


@pytest.mark.parametrize(
    ("config", "environ", "endpoint"),
    [
        (None, {}, "http://localhost:4318/v1/traces"),
        (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://col:4318/"}, "http://col:4318/v1/traces"),
        (
            None,
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://col:4318",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://tempo/otlp/traces",
            },
            "https://tempo/otlp/traces",
        ),
        (
            TracingConfig(endpoint="http://mine:4318"),
            {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://env:4318/v1/traces"},
            "http://mine:4318/v1/traces",
        ),
        (TracingConfig(endpoint="http://mine:9/custom"), {}, "http://mine:9/custom"),
    ],
)
def test_otlp_http_endpoint(
    config: TracingConfig | None, environ: dict[str, str], endpoint: str
) -> None:
    settings = resolve(config, {"OTEL_TRACES_EXPORTER": "otlp", **environ})
    assert settings.exporter == "otlp_http" and settings.endpoint == endpoint


def test_headers_and_service_name() -> None:
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_HEADERS": "x-generic=1",
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "Authorization=Basic%20abc,x-scope-orgid=team",
        "OTEL_RESOURCE_ATTRIBUTES": "service.name=from-resource,deployment.environment=prod",
    }
    settings = resolve(TracingConfig(headers={"x-scope-orgid": SecretStr("mine")}), env)
    assert settings.headers == {"authorization": "Basic abc", "x-scope-orgid": "mine"}
    assert settings.service_name == "from-resource"
    assert settings.resource["deployment.environment"] == "prod"
    assert resolve(None, {**env, "OTEL_SERVICE_NAME": "svc"}).service_name == "svc"
    assert resolve(TracingConfig(service_name="cfg"), env).service_name == "cfg"
    assert resolve(None, {}).service_name == "kv-gateway"
    assert resolve(None, {"OTEL_EXPORTER_OTLP_HEADERS": "a=b"}).headers == {}  # exporter none
    assert "mine" not in repr(TracingConfig(headers={"x": SecretStr("mine")}))


def test_instances_are_independent_and_leave_the_global_provider_alone() -> None:
    before = trace.get_tracer_provider()
    one, two = InMemorySpanExporter(), InMemorySpanExporter()
    a = Tracing(TracingConfig(service_name="a"), exporter=one, environ={})
    b = Tracing(TracingConfig(service_name="b"), exporter=two, environ={})
    started(a).finish(end_ns=time.time_ns())
    (span,) = one.get_finished_spans()
    assert two.get_finished_spans() == ()
    assert span.resource.attributes["service.name"] == "a"
    assert trace.get_tracer_provider() is before
    a.shutdown()
    b.shutdown()
    assert a.start({}, time.time_ns()) is None  # after shutdown: nothing more is recorded


async def test_aclose_flushes_off_the_event_loop(
    memory: tuple[Tracing, InMemorySpanExporter],
) -> None:
    tracing, _ = memory
    await tracing.aclose()
    assert tracing.start({}, time.time_ns()) is None


# --- through a gateway: attempt spans, TTFT, HTTP attributes (SDK path; OTLP: test_gw_otlp.py) --


@contextlib.asynccontextmanager
async def traced_gateway(replicas: list[str], exporter: InMemorySpanExporter) -> AsyncIterator[str]:
    """A gateway over `replicas` (round robin, so the first request tries them in this order),
    every request traced into `exporter`."""
    pool = {
        "replicas": replicas,
        "policy": "round_robin",
        "health": {"interval_s": 60},  # no probe closes a circuit during the test
        "timeouts": {"connect_s": 1, "first_byte_s": 5, "idle_s": 5, "total_s": 30},
    }
    app = create_app(
        parse_config({"pools": {"chat": pool}}), tracing=Tracing(None, exporter=exporter)
    )
    gw = await start_server(app, lifespan="on")
    try:
        yield gw.url
    finally:
        await gw.stop()


def traces(exporter: InMemorySpanExporter) -> list[list[ReadableSpan]]:
    out: dict[int, list[ReadableSpan]] = {}
    for span in exporter.get_finished_spans():
        out.setdefault(span.context.trace_id, []).append(span)
    return list(out.values())


async def test_a_span_per_upstream_attempt_with_a_dead_replica() -> None:
    """dead, then 503, then a live replica: three attempt spans in order, each its outcome."""
    busy, live = (
        await start_server(Upstream("busy", mode="error_503")),
        await start_server(Upstream("live")),
    )
    dead = f"http://127.0.0.1:{free_port()}"
    exporter = InMemorySpanExporter()
    try:
        async with (
            traced_gateway([dead, busy.url, live.url], exporter) as url,
            httpx.AsyncClient(base_url=url) as h,
        ):
            res = await h.post("/v1/chat/completions", json={"model": "m", "messages": CHAT})
            assert res.status_code == 200
    finally:
        await busy.stop()
        await live.stop()
    (spans,) = traces(exporter)
    root = next(s for s in spans if s.name == "gateway.request")
    attempts = sorted((s for s in spans if s.name == "upstream.attempt"), key=times)
    assert len(attempts) == 3
    assert root.attributes is not None and root.attributes["gateway.retries"] == 2
    for span in attempts:
        assert span.kind is SpanKind.CLIENT and span.parent is not None
        assert span.parent.span_id == root.context.span_id
        assert times(root)[0] <= times(span)[0] <= times(span)[1] <= times(root)[1]
    for before, after in zip(attempts, attempts[1:], strict=False):
        assert times(before)[1] <= times(after)[0]  # one after the other
    first, second, third = (dict(s.attributes or {}) for s in attempts)
    dead_port, busy_port, live_port = (int(u.rsplit(":", 1)[1]) for u in (dead, busy.url, live.url))
    assert first == {
        "gateway.replica": f"127.0.0.1:{dead_port}",
        "http.request.method": "POST",
        "server.address": "127.0.0.1",
        "server.port": dead_port,
        "url.full": f"http://127.0.0.1:{dead_port}/v1/chat/completions",
        "error.type": "connect_error",  # no status: nothing answered
    }
    assert second["http.response.status_code"] == 503 and second["error.type"] == "503"
    assert second["http.request.resend_count"] == 1 and second["server.port"] == busy_port
    assert third["http.response.status_code"] == 200 and "error.type" not in third
    assert third["http.request.resend_count"] == 2 and third["server.port"] == live_port
    assert [s.status.status_code for s in attempts] == [
        StatusCode.ERROR, StatusCode.ERROR, StatusCode.UNSET,
    ]  # fmt: skip
    # the answering replica's segment starts with its own attempt, not the first one
    generate = next(s for s in spans if s.name == "upstream.generate")
    assert times(generate)[0] == times(attempts[2])[0]
    assert times(generate)[1] == times(attempts[2])[1]


@pytest.mark.parametrize("stream", [False, True])
async def test_ttft_only_when_the_first_token_is_seen(stream: bool) -> None:
    live = await start_server(Upstream("live", chunks=4, chunk_delay_s=0.01))
    exporter = InMemorySpanExporter()
    try:
        async with (
            traced_gateway([live.url], exporter) as url,
            httpx.AsyncClient(base_url=url, headers={"user-agent": "trace-test/1.0"}) as h,
        ):
            body = {"model": "m", "messages": CHAT, "stream": stream}
            res = await h.post("/v1/chat/completions", json=body)
            assert res.status_code == 200
            gw_port = int(url.rsplit(":", 1)[1])
    finally:
        await live.stop()
    (spans,) = traces(exporter)
    named = by_name(tuple(spans))
    a = named["gateway.request"].attributes
    assert a is not None
    if stream:
        assert {"upstream.prefill", "upstream.decode"} <= set(named)
        assert "upstream.generate" not in named
        assert a["gateway.ttft_s"] > 0
    else:
        assert "upstream.generate" in named
        assert not {"upstream.prefill", "upstream.decode"} & set(named)
        assert "gateway.ttft_s" not in a and "gateway.tpot_s" not in a
    # HTTP server span conventions on the root
    assert a["http.request.method"] == "POST" and a["url.scheme"] == "http"
    assert a["url.path"] == a["http.route"] == "/v1/chat/completions"
    assert a["http.response.status_code"] == 200 and "error.type" not in a
    assert a["server.address"] == "127.0.0.1" and a["server.port"] == gw_port
    assert a["user_agent.original"] == "trace-test/1.0"
    assert a["gateway.priority"] == "interactive"  # the class name, as docs/tracing.md says


async def test_non_streamed_ttft_is_not_observed_in_metrics() -> None:
    """gateway_ttft_seconds counts streams only: a non-streamed answer's first token is unseen."""
    live = await start_server(Upstream("live"))
    exporter = InMemorySpanExporter()
    try:
        async with (
            traced_gateway([live.url], exporter) as url,
            httpx.AsyncClient(base_url=url) as h,
        ):
            for stream in (False, False, True):
                body = {"model": "m", "messages": CHAT, "stream": stream}
                assert (await h.post("/v1/chat/completions", json=body)).status_code == 200
            text = (await h.get("/metrics")).text
    finally:
        await live.stop()
    counts = re.findall(r"^gateway_ttft_seconds_count\{[^}]*\} (\S+)$", text, re.MULTILINE)
    assert [float(c) for c in counts] == [1.0]
    durations = re.findall(r"^gateway_request_duration_seconds_count\{[^}]*\} (\S+)$", text, re.M)
    assert sum(float(c) for c in durations) == 3.0


def test_tracing_on_is_logged_without_credentials(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway.tracing")
    config = TracingConfig(
        exporter="otlp_http",
        endpoint="http://user:secret@collector:4318/v1/traces?token=abc",
        headers={"authorization": SecretStr("Bearer hidden")},
        sampling_ratio=0.25,
    )
    tracing = Tracing(config, environ={})
    tracing.shutdown()
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tracing on")]
    assert "exporter otlp_http" in line and "endpoint http://collector:4318/v1/traces," in line
    assert "TraceIdRatioBased{0.25}" in line and "service.name kv-gateway" in line
    assert not any(secret in line for secret in ("secret", "abc", "hidden", "user"))
    caplog.clear()
    Tracing(None, environ={}).shutdown()  # off: no line
    assert not [r for r in caplog.records if r.getMessage().startswith("tracing on")]


# --- docs/tracing.md against the code --------------------------------------------------------

DOCS = Path(__file__).resolve().parents[2] / "docs/tracing.md"


def doc_table(after: str) -> dict[str, list[str]]:
    """The first table after the line starting with `after`: {first cell's name: other cells}."""
    lines = DOCS.read_text().split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith(after))
    rows: dict[str, list[str]] = {}
    for line in lines[start + 1 :]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        name = re.fullmatch(r"`([^`]+)`", cells[0])
        if name:
            rows[name.group(1)] = cells[1:]
    return rows


def ticked(text: str) -> set[str]:
    return set(re.findall(r"`([^`]+)`", text))


def test_the_span_table_is_the_code() -> None:
    assert {name: cells[0] for name, cells in doc_table("| span | kind |").items()} == SPAN_KINDS
    spans = DOCS.read_text()
    assert all(f"── {name}" in spans or name == ROOT_SPAN for name in SPAN_KINDS)  # the tree too


@pytest.mark.parametrize(
    ("heading", "names"),
    [
        ("Attributes of `gateway.request`", ATTRIBUTES.values()),
        ("Attributes of each `upstream.attempt`", ATTEMPT_ATTRIBUTES.values()),
        ("Attributes of `gateway.route`", ROUTE_ATTRIBUTES.values()),
    ],
)
def test_the_attribute_tables_are_the_code(heading: str, names: Any) -> None:
    table = doc_table(heading)
    assert set(table) == set(names)
    assert {name: cells[0] for name, cells in table.items()} == {n: TYPES[n] for n in names}


def test_the_values_the_docs_name_exist() -> None:
    root = doc_table("Attributes of `gateway.request`")
    scorers = {_lookup("scorer", name, "").reason for name in TABLE["scorer"]}
    reasons = scorers | {TIE, COLD, GUARD, ONLY_CANDIDATE, NO_CANDIDATES, HOME} | set(TABLE["picker"])
    gateway_src = "".join(p.read_text() for p in (DOCS.parents[1] / "gateway").rglob("*.py"))
    reasons |= set(re.findall(r'\breason = "(\w+)"', gateway_src))  # set by the gateway itself
    named = {v for v in ticked(root["gateway.route.reason"][1]) if re.fullmatch(r"\w+", v)}
    assert named <= reasons
    assert scorers <= ticked(root["gateway.route.reason"][1])  # every scorer's reason is named
    # the outcomes a Record and a Forwarded can end with (gateway/pipeline/record.py, failover.py)
    outcomes = {"ok", "error", "upstream_error", "client_disconnected", "broken_mid_stream"}
    assert ticked(root["gateway.outcome"][1]) == outcomes
    assert ticked(root["error.type"][1]) <= {*ERROR_TYPES, "client_disconnected"}
    classes = ticked(root["gateway.priority"][1]) - {"priority_classes"}
    assert classes == set(
        parse_config({"pools": {"p": {"replicas": ["http://r:1"]}}}).priority_classes
    )
    attempt = doc_table("Attributes of each `upstream.attempt`")
    failover = {
        attempt_outcome(Retryable(r)) for r in ("timeout (idle_s)", "connection refused", "closed")
    }
    errors = ticked(attempt["error.type"][1])
    assert failover | {"broken_mid_stream", "client_disconnected"} <= errors
    assert all(
        e.isdigit() for e in errors - failover - {"broken_mid_stream", "client_disconnected"}
    )


def test_traceparent_bytes_is_the_header() -> None:
    from gateway.telemetry.trace import RequestTrace

    for sampled in (True, False):
        rt = RequestTrace(None, 0xABC, 0x12, None, None, sampled, 0)  # type: ignore[arg-type]
        assert rt.traceparent_bytes() == rt.traceparent().encode()
