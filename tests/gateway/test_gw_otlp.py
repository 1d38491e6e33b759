"""The gateway's own OTLP/HTTP exporter (gateway/telemetry/otlp.py), against real loopback collectors.

What it sends is checked by decoding with opentelemetry-proto, and against the SDK's own OTLP
encoding of the same trace; through a gateway, the spans a request makes and the traceparent it
sends on; sampling off sends nothing; a dead or failing collector costs requests nothing, and
what is lost is counted and logged.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import MappingProxyType
from typing import Any

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import SecretStr

from bench.harness import free_port
from gateway import create_app, parse_config
from gateway.telemetry.otlp import OtlpHttpSink
from gateway.telemetry.tracing import SEGMENTS, RequestTrace, SdkSpans, Tracing, TracingConfig
from tests.gateway.fake_replica import Upstream
from tests.support import start_server

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
INCOMING = f"00-{TRACE_ID}-{PARENT_ID}-01"
CHAT = [{"role": "user", "content": "hello"}]
MS = 1_000_000
FAST = {"OTEL_BSP_SCHEDULE_DELAY": "50"}  # export every 50 ms
STREAMED = SEGMENTS[:4]  # route, queue, prefill, decode: a streamed answer's segments


@dataclass
class Collector:
    """An OTLP/HTTP receiver on loopback that answers `status` and keeps what it got."""

    port: int = 0
    status: int = 200
    posts: list[tuple[str, dict[str, str], bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spans(self) -> list[PbSpan]:
        return [
            span
            for _, _, body in self.posts
            for rs in ExportTraceServiceRequest.FromString(body).resource_spans
            for ss in rs.scope_spans
            for span in ss.spans
        ]


@pytest.fixture
def collector() -> Iterator[Collector]:
    got = Collector()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            got.posts.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
            self.send_response(got.status)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    got.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield got
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


def otlp(url: str, **kw: Any) -> TracingConfig:
    return TracingConfig(exporter="otlp_http", endpoint=url, **kw)


def attrs(span: PbSpan) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in span.attributes:
        which = kv.value.WhichOneof("value")
        value = getattr(kv.value, which)
        if which == "array_value":
            value = tuple(getattr(v, v.WhichOneof("value")) for v in value.values)
        out[kv.key] = value
    return out


def a_full_trace(tracing: Tracing, incoming: bool, attempts: bool = False) -> RequestTrace:
    """Four segments and root attributes; with `attempts`, the HTTP headers and three upstream
    attempts (refused, 503, answered) as `Forwarded.attempts` holds them."""
    headers = {b"traceparent": INCOMING.encode(), b"tracestate": b"vendor=abc"} if incoming else {}
    if attempts:
        headers.update({b"host": b"gw.example:8443", b"user-agent": b"test/1"})
    t0 = time.time_ns()
    rt = tracing.start(headers, t0)
    assert rt is not None and rt.sampled
    rt.set({"gateway.custom.flag": True, "gateway.custom.list": [1, 2]}, pool="chat")
    p0 = t0 - rt.epoch_ns(0)  # t0 as a perf_counter_ns stamp
    tried = [
        ("r0", "http://10.0.0.1:8000", p0 + 3 * MS, p0 + 4 * MS, 0, "connect_error"),
        ("r1", "https://user:pw@10.0.0.2", p0 + 4 * MS, p0 + 5 * MS, 503, "status_503"),
        ("r2", "http://10.0.0.3:8000", p0 + 5 * MS, 0, 200, None),
    ]
    rt.finish(
        route=(t0 + MS, t0 + 2 * MS),
        queue=(t0 + 2 * MS, t0 + 3 * MS),
        prefill=(t0 + 5 * MS, t0 + 103 * MS),
        decode=(t0 + 103 * MS, t0 + 503 * MS),
        attempts=tried if attempts else (),
        end_ns=t0 + 504 * MS,
        attrs={"replicas_tried": ["r0", "r1"], "retries": 1, "status_code": 503},
        named={"gen_ai.usage.output_tokens": 101, "gateway.replica": "r1", "url.path": "/v1/x"},
    )
    return rt


def ours_and_theirs(
    tracing: Tracing, sink: OtlpHttpSink, rt: RequestTrace
) -> tuple[ExportTraceServiceRequest, ExportTraceServiceRequest]:
    """What the sink sends for `rt`, and what the SDK's exporter sends for the spans `rt.build()`
    makes, both drawing the child span ids from the same random state."""
    state = random.getstate()
    ours = ExportTraceServiceRequest.FromString(sink.request([rt]))
    random.setstate(state)
    rt.build()  # nothing when the sink built it
    sdk = SdkSpans(SimpleSpanProcessor(InMemorySpanExporter()), tracing.resource, tracing.scope)
    return ours, encode_spans(sdk.spans(rt))


# the request path's shapes (record.py): the repeating set, the measured names, a route receipt
SAME = {
    "gen_ai.request.model": "m", "gateway.tenant": "t", "gateway.pool": "chat",
    "gateway.retries": 0, "gateway.outcome": "ok", "http.request.method": "POST",
    "url.scheme": "http", "url.path": "/v1/chat/completions", "http.route": "/v1/chat/completions",
    "gateway.replica": "r2", "http.response.status_code": 200,
}  # fmt: skip
MEASURED = {
    "gateway.prompt_tokens.estimated": 513, "gateway.prefix.prompt_blocks": 3,
    "gateway.prefix.predicted_cached_blocks": 0, "gateway.route.hash_us": 16_385,
    "gen_ai.usage.output_tokens": 40,
}  # fmt: skip
ROUTE = {"gateway.route.predicted_cached_tokens": 256, "gateway.route.receipt": "hit"}
SHAPES: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None, str]] = {
    "non-streamed": ({}, {}, None, "generate"),
    "streamed, receipt, Host": ({}, {"gateway.route.cached_tokens": 0}, ROUTE, "stream"),
    "P/D": ({}, {"gateway.prompt_tokens.estimated": -1}, None, "pd"),
    "failover then 503": (
        {"http.response.status_code": 503, "gateway.outcome": "error", "gateway.retries": 2},
        {"gen_ai.usage.output_tokens": 2**40},
        None,
        "attempts",
    ),
    "a 429, no path": (
        {"http.response.status_code": 429, "url.path": None, "http.route": None},
        {"gateway.prefix.prompt_blocks": 1.5},
        None,
        "attempts",
    ),
    "incoming traceparent": ({}, {}, ROUTE, "incoming"),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_one_pass_encodes_what_built_spans_encode_to(shape: str) -> None:
    """The sink encodes the request path's traces without building them first: the same bytes
    as the SDK's exporter sends for the built spans, whatever segments, attempts and status."""
    same_over, measured_over, route, kind = SHAPES[shape]
    same = {k: v for k, v in {**SAME, **same_over}.items() if v is not None}
    measured = {**MEASURED, **measured_over}
    tracing = Tracing(otlp("http://127.0.0.1:9"), environ={})
    sink = tracing.sink
    assert isinstance(sink, OtlpHttpSink)
    captured: list[RequestTrace] = []
    sink.end = captured.append  # type: ignore[method-assign]
    headers = {b"host": b"gw.example:8443", b"user-agent": b"test/1"} if route else {}
    if kind == "incoming":
        headers |= {b"traceparent": INCOMING.encode(), b"tracestate": b"vendor=abc"}
    t0 = time.time_ns()
    rt = tracing.start(headers, t0)
    assert rt is not None and rt.sampled
    p0 = t0 - rt.epoch_ns(0)
    segs: dict[str, Any] = {"route": (t0 + MS, t0 + 2 * MS), "queue": (t0 + 2 * MS, t0 + 3 * MS)}
    if kind in ("stream", "incoming"):
        segs |= {"prefill": (t0 + 4 * MS, t0 + 9 * MS), "decode": (t0 + 8 * MS, t0 + 30 * MS)}
    elif kind == "pd":
        segs |= {"prefill": (t0 + 4 * MS, t0 + 9 * MS), "transfer": (t0 + 9 * MS, t0 + 11 * MS),
                 "decode": (t0 + 11 * MS, t0 + 30 * MS)}  # fmt: skip
    else:
        segs["generate"] = (t0 + 4 * MS, t0 + 30 * MS)
    attempts = [("r2", "http://10.0.0.3:8000", p0 + 3 * MS, 0, 200, None)]
    if kind == "attempts":
        attempts = [
            ("r0", "http://10.0.0.1:8000", p0 + 3 * MS, p0 + 4 * MS, 0, "connect_error"),
            ("r1", "https://user:pw@10.0.0.2", p0 + 4 * MS, p0 + 5 * MS, 503, "status_503"),
            ("r2", "http://10.0.0.3:8000", p0 + 5 * MS, 0, same["http.response.status_code"], None),
        ]
    shared = MappingProxyType(same)
    rt.finish(
        **segs,
        attempts=attempts,
        end_ns=t0 + 31 * MS,
        named=lambda: (shared, measured, route) if route else (shared, measured),
    )
    assert rt.given is not None
    ours, theirs = ours_and_theirs(tracing, sink, rt)
    assert ours == theirs
    assert len(ours.resource_spans[0].scope_spans[0].spans) == rt.spans
    sink.shutdown()


@pytest.mark.parametrize(("incoming", "attempts"), [(False, False), (True, False), (True, True)])
def test_the_encoding_decodes_to_what_the_sdk_exporter_sends(
    incoming: bool, attempts: bool
) -> None:
    captured: list[RequestTrace] = []

    class Keep:
        def end(self, trace: RequestTrace) -> None:
            captured.append(trace)

        def shutdown(self) -> None:
            pass

    tracing = Tracing(otlp("http://127.0.0.1:9"), environ={})
    real = tracing.sink
    assert isinstance(real, OtlpHttpSink)
    tracing.sink = Keep()
    a_full_trace(tracing, incoming, attempts)
    (rt,) = captured
    ours, theirs = ours_and_theirs(tracing, real, rt)
    assert ours == theirs
    spans = {s.name: s for s in ours.resource_spans[0].scope_spans[0].spans}
    root = spans["gateway.request"]
    assert root.status.code == 2 and root.status.message == "503"  # ERROR, a 5xx
    assert attrs(root)["gateway.replicas_tried"] == ("r0", "r1")
    assert attrs(root)["gateway.custom.flag"] is True
    assert (root.trace_state == "vendor=abc") is incoming
    tries = [s for s in ours.resource_spans[0].scope_spans[0].spans if s.name == "upstream.attempt"]
    assert len(tries) == (3 if attempts else 0)
    if attempts:
        assert attrs(root)["server.address"] == "gw.example" and attrs(root)["server.port"] == 8443
        assert attrs(root)["user_agent.original"] == "test/1"
        assert [s.kind for s in tries] == [PbSpan.SpanKind.SPAN_KIND_CLIENT] * 3
        assert [s.status.code for s in tries] == [2, 2, 0]  # ERROR, ERROR, UNSET
        assert [attrs(s).get("error.type") for s in tries] == ["connect_error", "503", None]
        assert attrs(tries[1])["url.full"] == "https://10.0.0.2/v1/x"  # no credentials
        assert attrs(tries[1])["server.port"] == 443
        assert tries[2].end_time_unix_nano == spans["upstream.decode"].end_time_unix_nano
    real.shutdown()


def test_a_trace_reaches_the_collector_with_headers_and_resource(collector: Collector) -> None:
    config = otlp(collector.url, headers={"x-token": SecretStr("t")}, service_name="gw-test")
    tracing = Tracing(config, environ={**FAST, "OTEL_RESOURCE_ATTRIBUTES": "k8s.pod.name=p1"})
    rt = a_full_trace(tracing, incoming=True)
    tracing.shutdown()  # flushes
    path, headers, body = collector.posts[0]
    assert path == "/v1/traces" and headers["content-type"] == "application/x-protobuf"
    assert headers["x-token"] == "t"
    resource = ExportTraceServiceRequest.FromString(body).resource_spans[0].resource
    res = {kv.key: kv.value.string_value for kv in resource.attributes}
    assert res["service.name"] == "gw-test" and res["k8s.pod.name"] == "p1"
    spans = {s.name: s for s in collector.spans()}
    assert set(spans) == {"gateway.request", *STREAMED}
    root = spans["gateway.request"]
    assert root.trace_id.hex() == TRACE_ID and root.parent_span_id.hex() == PARENT_ID
    assert root.span_id == rt.sid.to_bytes(8, "big")
    assert root.kind == PbSpan.SpanKind.SPAN_KIND_SERVER
    for name in STREAMED:
        child = spans[name]
        assert child.parent_span_id == root.span_id and child.trace_id == root.trace_id
        assert child.kind == PbSpan.SpanKind.SPAN_KIND_INTERNAL
        assert root.start_time_unix_nano <= child.start_time_unix_nano
        assert child.end_time_unix_nano <= root.end_time_unix_nano


def test_gzip_compression_from_the_environment(collector: Collector) -> None:
    import gzip

    env = {**FAST, "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "gzip"}
    tracing = Tracing(otlp(collector.url), environ=env)
    a_full_trace(tracing, incoming=False)
    tracing.shutdown()
    _, headers, body = collector.posts[0]
    assert headers["content-encoding"] == "gzip"
    request = ExportTraceServiceRequest.FromString(gzip.decompress(body))
    assert len(request.resource_spans[0].scope_spans[0].spans) == 5


async def serve(
    collector_url: str, up: Upstream, environ: dict[str, str], **tracing: Any
) -> tuple[Tracing, Any, Any]:
    served = await start_server(up)
    cfg = parse_config({"pools": {"chat": {"replicas": [served.url], "policy": "round_robin"}}})
    t = Tracing(otlp(collector_url, **tracing), environ=environ)
    gw = await start_server(create_app(cfg, tracing=t), lifespan="on")
    return t, gw, served


async def chat_then_stop(gw: Any, served: Any, n: int) -> None:
    """`n` non-streamed chats, each answered 200, then the gateway (its exporter flushed) and
    the replica stopped."""
    try:
        async with httpx.AsyncClient() as h:
            for _ in range(n):
                body = {"model": "test-model", "messages": CHAT}
                res = await h.post(gw.url + "/v1/chat/completions", json=body)
                assert res.status_code == 200
    finally:
        await gw.stop()
        await served.stop()


async def test_a_gateway_request_exports_its_spans_and_continues_the_trace(
    collector: Collector,
) -> None:
    up = Upstream("a", chunks=8, chunk_delay_s=0.005)
    tracing, gw, served = await serve(collector.url, up, FAST)
    sink = tracing.sink
    assert isinstance(sink, OtlpHttpSink)
    try:
        async with httpx.AsyncClient() as h:
            headers = {"traceparent": INCOMING, "tracestate": "vendor=abc"}
            body = {"model": "test-model", "messages": CHAT, "stream": True}
            res = await h.post(gw.url + "/v1/chat/completions", json=body, headers=headers)
            assert res.status_code == 200
            res = await h.post(
                gw.url + "/v1/chat/completions", json={"model": "test-model", "messages": CHAT}
            )
            assert res.status_code == 200
    finally:
        await gw.stop()  # the lifespan's shutdown flushes the exporter
        await served.stop()
    assert sink.exported_spans == len(collector.spans()) and sink.failed_spans == 0
    by_trace: dict[str, list[PbSpan]] = {}
    for span in collector.spans():
        by_trace.setdefault(span.trace_id.hex(), []).append(span)
    assert len(by_trace) == 2
    streamed = {s.name: s for s in by_trace.pop(TRACE_ID)}
    assert set(streamed) == {"gateway.request", *STREAMED, "upstream.attempt"}
    root = streamed["gateway.request"]
    assert root.parent_span_id.hex() == PARENT_ID and root.trace_state == "vendor=abc"
    a = attrs(root)
    assert a["gateway.pool"] == "chat" and a["gateway.outcome"] == "ok"
    assert a["gateway.policy"] == "round_robin" and a["http.response.status_code"] == 200
    assert a["gateway.replica"] == "127.0.0.1:" + served.url.rsplit(":", 1)[1]
    assert a["gateway.replicas_tried"] == (a["gateway.replica"],) and a["gateway.retries"] == 0
    assert a["gateway.config.version"] == 1 and a["gen_ai.request.model"] == "test-model"
    assert a["gateway.ttft_s"] > 0 and "error.type" not in a
    seq = [streamed[n] for n in STREAMED]
    for before, after in zip(seq, seq[1:], strict=False):
        assert before.end_time_unix_nano <= after.start_time_unix_nano
    # the replica saw the same trace, parented on the gateway's root span, and the tracestate
    first = up.headers[0]
    _, trace_id, parent, flags = first[b"traceparent"].decode().split("-")
    assert (trace_id, parent, flags) == (TRACE_ID, root.span_id.hex(), "01")
    assert first[b"tracestate"] == b"vendor=abc"
    # the second request started a trace of its own, at the gateway; not streamed, so one
    # upstream segment and no TTFT (its first token is not seen)
    whole = {s.name: s for s in next(iter(by_trace.values()))}
    assert set(whole) == {
        "gateway.request",
        "gateway.route",
        "gateway.queue",
        "upstream.generate",
        "upstream.attempt",
    }
    other = whole["gateway.request"]
    assert (
        other.parent_span_id == b""
        and up.headers[1][b"traceparent"].decode().split("-")[1] == other.trace_id.hex()
    )
    assert "gateway.ttft_s" not in attrs(other) and "gateway.tpot_s" not in attrs(other)
    # the same HTTP attributes on the OTLP path as on the SDK path (test_gw_tracing.py)
    port = int(served.url.rsplit(":", 1)[1])
    for spans in (streamed, whole):
        a = attrs(spans["gateway.request"])
        assert a["http.request.method"] == "POST" and a["url.scheme"] == "http"
        assert a["url.path"] == a["http.route"] == "/v1/chat/completions"
        assert a["server.address"] == "127.0.0.1" and a["server.port"] == int(
            gw.url.rsplit(":", 1)[1]
        )
        assert a["user_agent.original"].startswith("python-httpx/")
        attempt = spans["upstream.attempt"]
        assert attempt.kind == PbSpan.SpanKind.SPAN_KIND_CLIENT
        assert attempt.parent_span_id == spans["gateway.request"].span_id
        assert attrs(attempt) == {
            "gateway.replica": f"127.0.0.1:{port}",
            "http.request.method": "POST",
            "server.address": "127.0.0.1",
            "server.port": port,
            "url.full": f"http://127.0.0.1:{port}/v1/chat/completions",
            "http.response.status_code": 200,
        }
        assert attempt.status.code == 0  # UNSET
    # the answering attempt covers its upstream segments
    for spans, segs in (
        (streamed, ("upstream.prefill", "upstream.decode")),
        (whole, ("upstream.generate",)),
    ):
        attempt = spans["upstream.attempt"]
        assert attempt.start_time_unix_nano == spans[segs[0]].start_time_unix_nano
        assert attempt.end_time_unix_nano == spans[segs[-1]].end_time_unix_nano


async def test_the_gateways_own_traces_encode_as_the_sdk_would_with_the_caches_warm() -> None:
    """What the request path records (its repeating attributes shared between traces, encoded
    once) decodes to the SDK's encoding of the same trace, for the first trace of a shape and
    for those that reuse its cached blocks; a different shape gets blocks of its own."""
    captured: list[RequestTrace] = []
    up = Upstream("a", chunks=4)
    tracing, gw, served = await serve("http://127.0.0.1:9", up, {})
    sink = tracing.sink
    assert isinstance(sink, OtlpHttpSink)
    sink.end = captured.append  # type: ignore[method-assign]
    try:
        async with httpx.AsyncClient() as h:
            for stream, model in ((False, "test-model"),) * 3 + ((True, "other-model"),):
                body = {"model": model, "messages": CHAT, "stream": stream}
                res = await h.post(gw.url + "/v1/chat/completions", json=body)
                assert res.status_code == 200
    finally:
        await gw.stop()
        await served.stop()
    assert len(captured) == 4
    for rt in captured:
        assert rt.given is not None  # finished, not built: the sink encodes it in one pass
        ours, theirs = ours_and_theirs(tracing, sink, rt)
        assert ours == theirs
    first, second, third, other = captured
    assert first.group is not None and second.group is first.group is third.group
    assert other.group is not None and other.group is not first.group
    assert other.attributes["gen_ai.request.model"] == "other-model"
    sink.shutdown()


async def test_sampling_off_exports_nothing_but_propagates(collector: Collector) -> None:
    up = Upstream("a")
    tracing, gw, served = await serve(collector.url, up, FAST, sampling_ratio=0.0)
    await chat_then_stop(gw, served, 3)
    assert collector.posts == []
    assert all(h[b"traceparent"].decode().endswith("-00") for h in up.headers)


async def test_a_dead_collector_costs_requests_nothing_and_is_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    up = Upstream("a")
    # nothing listens there; a queue of 15 spans holds three traces of 5 spans (root, route,
    # queue, generate, one attempt)
    env = {"OTEL_BSP_SCHEDULE_DELAY": "60000", "OTEL_BSP_MAX_QUEUE_SIZE": "15"}
    tracing, gw, served = await serve(f"http://127.0.0.1:{free_port()}", up, env)
    sink = tracing.sink
    assert isinstance(sink, OtlpHttpSink)
    caplog.set_level(logging.WARNING, logger="gateway.tracing")
    await chat_then_stop(gw, served, 5)
    assert sink.dropped_spans == 10  # two traces past the queue's 15 spans
    assert sink.failed_spans == 15 and sink.exported_spans == 0  # the rest: refused connection
    assert "OTLP export queue full" in caplog.text


def trace_counts(exposition: str) -> dict[str, float]:
    return {
        name: float(value)
        for name, value in re.findall(r"^(gateway_trace_\w+) (\S+)$", exposition, re.MULTILINE)
    }


async def test_lost_spans_are_prometheus_metrics() -> None:
    """A dead collector: the queue-full drops and the failed exports move on /metrics."""
    up = Upstream("a")
    env = {
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_BSP_MAX_QUEUE_SIZE": "15",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "1",  # one POST and its quick retry, then given up
    }
    tracing, gw, served = await serve(f"http://127.0.0.1:{free_port()}", up, env)
    try:
        async with httpx.AsyncClient(base_url=gw.url) as h:
            before = trace_counts((await h.get("/metrics")).text)
            assert before == {
                "gateway_trace_spans_exported_total": 0,
                "gateway_trace_spans_dropped_total": 0,
                "gateway_trace_spans_failed_total": 0,
                "gateway_trace_export_failures_total": 0,
                "gateway_trace_export_queue_spans": 0,
            }
            for _ in range(5):  # back to back: the thread wakes every 256 traces or 50 ms
                body = {"model": "test-model", "messages": CHAT}
                assert (await h.post("/v1/chat/completions", json=body)).status_code == 200

            deadline = time.monotonic() + 10
            while True:  # the export thread's counts, as a scrape reads them
                after = trace_counts((await h.get("/metrics")).text)
                lost = (
                    after["gateway_trace_spans_dropped_total"]
                    + after["gateway_trace_spans_failed_total"]
                )
                if lost == 25 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
    finally:
        await gw.stop()
        await served.stop()
    assert lost == 25 and after["gateway_trace_spans_exported_total"] == 0  # 5 traces of 5
    assert after["gateway_trace_spans_failed_total"] >= 15  # what the queue held, never sent
    assert after["gateway_trace_export_failures_total"] >= 1
    assert after["gateway_trace_export_queue_spans"] == 0


async def test_trace_metrics_are_empty_without_the_otlp_exporter() -> None:
    served = await start_server(Upstream("a"))
    cfg = parse_config({"pools": {"chat": {"replicas": [served.url]}}})
    gw = await start_server(create_app(cfg, tracing=Tracing(None, environ={})), lifespan="on")
    try:
        async with httpx.AsyncClient(base_url=gw.url) as h:
            text = (await h.get("/metrics")).text
    finally:
        await gw.stop()
        await served.stop()
    assert "# TYPE gateway_trace_spans_dropped_total counter" in text
    assert trace_counts(text) == {}  # families without samples: tracing is off


@pytest.mark.parametrize("status", [400, 500])
def test_a_collector_error_is_logged_not_raised(
    collector: Collector, status: int, caplog: pytest.LogCaptureFixture
) -> None:
    collector.status = status
    caplog.set_level(logging.WARNING, logger="gateway.tracing")
    tracing = Tracing(otlp(collector.url), environ={**FAST, "OTEL_EXPORTER_OTLP_TIMEOUT": "1"})
    sink = tracing.sink
    assert isinstance(sink, OtlpHttpSink)
    a_full_trace(tracing, incoming=False)
    tracing.shutdown()
    assert sink.failed_spans == 5 and sink.exported_spans == 0
    assert f"HTTP {status}" in caplog.text
    assert len(collector.posts) == 1  # 400 and 500 are not retried


def test_a_retryable_status_is_retried(collector: Collector) -> None:
    collector.status = 503

    def recover() -> None:
        while not collector.posts:
            time.sleep(0.01)
        collector.status = 200

    threading.Thread(target=recover, daemon=True).start()
    tracing = Tracing(otlp(collector.url), environ=FAST)
    sink = tracing.sink
    assert isinstance(sink, OtlpHttpSink)
    a_full_trace(tracing, incoming=False)
    while sink.exported_spans == 0 and sink.failed_spans == 0:  # backoff: about 1 s
        time.sleep(0.05)
    tracing.shutdown()
    assert sink.exported_spans == 5 and len(collector.posts) == 2


def test_the_queue_is_bounded_and_sends_in_batches(collector: Collector) -> None:
    env = {
        "OTEL_BSP_SCHEDULE_DELAY": "60000",
        "OTEL_BSP_MAX_QUEUE_SIZE": "50",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "20",
    }
    tracing = Tracing(otlp(collector.url), environ=env)
    sink = tracing.sink
    assert isinstance(sink, OtlpHttpSink)
    for _ in range(12):  # 60 spans: the last two traces do not fit
        a_full_trace(tracing, incoming=False)
    assert sink.dropped_spans == 10
    tracing.shutdown()
    assert sink.exported_spans == 50 and sink.queued_spans == 0
    assert [len(ExportTraceServiceRequest.FromString(b).resource_spans[0].scope_spans[0].spans)
            for _, _, b in collector.posts] == [20, 20, 10]  # fmt: skip


def test_a_trace_that_cannot_be_encoded_is_given_up_and_counted(
    collector: Collector, caplog: pytest.LogCaptureFixture
) -> None:
    """A failure to encode (a bug) loses that trace (counted as failed, logged), never the export
    thread: the next trace is sent as usual."""
    tracing = Tracing(otlp(collector.url), environ={})
    sink = tracing.sink
    assert isinstance(sink, OtlpHttpSink)
    good = sink.encoder.encode

    def broken(rt: RequestTrace) -> bytes:
        raise ValueError("no such field")

    sink.encoder.encode = broken  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="gateway.tracing"):
        a_full_trace(tracing, incoming=False)
        sink._wake.set()  # encode now, not after 256 traces
        deadline = time.monotonic() + 10
        while sink.failed_spans < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert sink.failed_spans == 5 and sink.queued_spans == 0
    assert "could not be encoded (ValueError: no such field)" in caplog.text
    sink.encoder.encode = good  # type: ignore[method-assign]
    a_full_trace(tracing, incoming=False)
    tracing.shutdown()
    assert sink.exported_spans == 5 and len(collector.spans()) == 5


def test_bad_exporter_variables_are_named() -> None:
    from gateway.telemetry.tracing import TracingError

    for var, value in (
        ("OTEL_BSP_MAX_QUEUE_SIZE", "lots"),
        ("OTEL_EXPORTER_OTLP_COMPRESSION", "brotli"),
    ):
        with pytest.raises(TracingError, match=var):
            Tracing(otlp("http://127.0.0.1:9"), environ={var: value})


def test_sdk_path_still_serves_other_exporters() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing(None, exporter=exporter, environ={})
    assert isinstance(tracing.sink, SdkSpans)
    a_full_trace(tracing, incoming=True)
    assert {s.name for s in exporter.get_finished_spans()} == {"gateway.request", *STREAMED}
    tracing.shutdown()
