"""The gateway's own OTLP/HTTP span exporter: finished traces straight to protobuf, sent in batches.

`OtlpHttpSink.end` runs on the event loop when a sampled request finishes and only queues the
trace. A background thread takes what is queued, builds each trace's spans (the fixed shape of
`tracing.py`: a root and up to four children), encodes them to OTLP protobuf bytes and POSTs one
`ExportTraceServiceRequest` per batch (resource and scope encoded once). No SDK span objects and
no protobuf message objects are made; the bytes decode to what the SDK's OTLP exporter sends for
the same spans. The thread offers the GIL back every few traces, so the event loop never waits
long for it; its work still counts as the process's CPU, which is why the encoding is kept cheap
(attribute pairs that repeat are encoded once and cached).

Bounded: at most `max_queue` spans wait; beyond that a trace is dropped whole, counted in
`dropped_spans` and logged (at most one line per 10 s for each kind). Spans a collector refuses
or never answers are counted in `failed_spans` and logged the same way; no error reaches a
request.

Environment (read from the `environ` given, normally the process's):

- `OTEL_BSP_SCHEDULE_DELAY` (ms, 5000), `OTEL_BSP_MAX_QUEUE_SIZE` (spans, 32768),
  `OTEL_BSP_MAX_EXPORT_BATCH_SIZE` (spans, 4096), `OTEL_BSP_EXPORT_TIMEOUT` (ms, 30000: the
  longest `shutdown` waits for the last batches);
- `OTEL_EXPORTER_OTLP[_TRACES]_TIMEOUT` (s, 10), `_COMPRESSION` (none, gzip, deflate),
  `_CERTIFICATE`, `_CLIENT_KEY`, `_CLIENT_CERTIFICATE`;
- `OTEL_[SPAN_]ATTRIBUTE_COUNT_LIMIT` (128), `OTEL_[SPAN_]ATTRIBUTE_VALUE_LENGTH_LIMIT` (none).
"""

from __future__ import annotations

import collections
import gzip
import logging
import random
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from .tracing import ROOT_SPAN, SEGMENTS, RequestTrace
from .tracing_config import Settings, TracingError

if TYPE_CHECKING:
    import requests

__all__ = ["OtlpHttpSink", "SpanEncoder"]

log = logging.getLogger("gateway.tracing")

_RETRY_STATUS = frozenset((429, 502, 503, 504))
_LOG_EVERY_S = 10.0
_ENCODE_EVERY = 256  # traces queued before the thread is woken to encode them
_YIELD_EVERY = 64  # traces encoded between two offers of the GIL to the event loop
_CACHE_MAX = 8192  # encoded (attribute, value) pairs kept; cleared when full


# --- protobuf wire format: the few pieces the span shape needs ----------------------------------

_VARINT = [bytes((n,)) if n < 0x80 else bytes((n & 0x7F | 0x80, n >> 7)) for n in range(1 << 14)]
_FIXED64 = struct.Struct("<Q").pack
_TIMES = struct.Struct("<BQBQ").pack  # start_time_unix_nano (7) and end_time_unix_nano (8)
_DOUBLE = struct.Struct("<d").pack
_STATUS_UNSET = b"\x7a\x00"  # status (15): present and empty, as the SDK's exporter sends it
_FLAGS_LOCAL = b"\x85\x01" + struct.pack("<I", 0x100)  # flags (16): HAS_IS_REMOTE
_FLAGS_REMOTE = b"\x85\x01" + struct.pack("<I", 0x300)  # ... | IS_REMOTE (the parent's)


def _varint(n: int) -> bytes:
    if n < 1 << 14:
        return _VARINT[n]
    n &= (1 << 64) - 1  # int64: two's complement, ten bytes when negative
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field: tag byte (field << 3 | 2), length, payload."""
    return bytes((tag,)) + _varint(len(payload)) + payload


def _any_value(value: Any, max_len: int | None) -> bytes:
    """AnyValue: string 1, bool 2, int 3, double 4, array 5."""
    if isinstance(value, str):
        return _field(0x0A, (value if max_len is None else value[:max_len]).encode())
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + _varint(value)
    if isinstance(value, float):
        return b"\x21" + _DOUBLE(value)
    if isinstance(value, bytes):
        return _field(0x3A, value)
    if isinstance(value, (list, tuple)):
        return _field(0x2A, b"".join(_field(0x0A, _any_value(v, max_len)) for v in value))
    return _field(0x0A, str(value).encode())


def _key_value(tag: int, key: str, value: Any, max_len: int | None = None) -> bytes:
    """KeyValue {key 1, value 2} as a field `tag` of the enclosing message."""
    return _field(tag, _field(0x0A, key.encode()) + _field(0x12, _any_value(value, max_len)))


def encode_resource(resource: Resource, scope: InstrumentationScope) -> tuple[bytes, bytes]:
    """ResourceSpans.resource (1) and ScopeSpans.scope (1) as encoded fields."""
    res = b"".join(_key_value(0x0A, k, v) for k, v in resource.attributes.items())
    sc = _field(0x0A, scope.name.encode())
    if scope.version:
        sc += _field(0x12, scope.version.encode())
    return _field(0x0A, res), _field(0x0A, sc)


def export_request(resource: bytes, scope: bytes, spans: Iterable[bytes]) -> bytes:
    """ExportTraceServiceRequest {ResourceSpans {resource, ScopeSpans {scope, spans...}}}."""
    scope_spans = _field(0x12, scope + b"".join(spans))
    return _field(0x0A, resource + scope_spans)


class SpanEncoder:
    """A finished `RequestTrace` as its ScopeSpans.spans (2) fields, children first, root last.

    Encoded attribute (name, value) pairs of strings and ints are cached: most of a request's
    attributes (model, pool, replica, policy, outcome, status) repeat from request to request.
    """

    def __init__(self, max_attributes: int = 128, max_value_len: int | None = None) -> None:
        self.max_attributes = max_attributes
        self.max_value_len = max_value_len
        self._cache: dict[tuple[str, Any], tuple[type, bytes]] = {}
        # name (5) and kind (6) of each span shape: SERVER = 2, INTERNAL = 1
        self._root_name = _field(0x2A, ROOT_SPAN.encode()) + b"\x30\x02"
        self._child_name = {n: _field(0x2A, n.encode()) + b"\x30\x01" for n in SEGMENTS}

    def encode(self, rt: RequestTrace) -> bytes:
        head = b"\x0a\x10" + rt.tid.to_bytes(16, "big")  # trace_id (1)
        ts = rt.trace_state
        state = _field(0x1A, ts.to_header().encode()) if ts else b""  # trace_state (3)
        root_id = rt.sid.to_bytes(8, "big")
        names = self._child_name
        pre = head + b"\x12\x08"  # then span_id (2)
        mid = state + b"\x22\x08" + root_id  # parent_span_id (4)
        out = []
        for name, span_id, start, end in rt.segments:
            body = b"".join(
                (
                    pre,
                    span_id.to_bytes(8, "big"),
                    mid,
                    names.get(name) or _field(0x2A, name.encode()) + b"\x30\x01",
                    _TIMES(0x39, start, 0x41, end),
                    _STATUS_UNSET,
                    _FLAGS_LOCAL,
                )
            )
            out.append(b"\x12" + _VARINT[len(body)] + body)
        parent = rt.parent
        body = b"".join(
            (
                pre,
                root_id,
                state,
                b"\x22\x08" + parent.span_id.to_bytes(8, "big") if parent is not None else b"",
                self._root_name,
                _TIMES(0x39, rt.start_ns, 0x41, rt.end_ns),
                self.attributes(rt.attributes),
                _field(0x7A, _field(0x12, rt.error.encode()) + b"\x18\x02")
                if rt.error is not None
                else _STATUS_UNSET,
                _FLAGS_REMOTE if parent is not None and parent.is_remote else _FLAGS_LOCAL,
            )
        )
        out.append(_field(0x12, body))
        return b"".join(out)

    def attributes(self, attrs: Mapping[str, Any]) -> bytes:
        """Span.attributes (9) fields, and dropped_attributes_count (10) past the count limit."""
        items: Iterable[tuple[str, Any]] = attrs.items()
        dropped = len(attrs) - self.max_attributes
        if dropped > 0:  # as the SDK's BoundedAttributes: the latest ones are kept
            items = list(items)[dropped:]
        cache, max_len = self._cache, self.max_value_len
        parts = []
        for item in items:
            # (name, value) is the key; the value's type is checked as 1 == 1.0 == True
            try:
                hit = cache.get(item)
            except TypeError:  # an unhashable value (a list)
                hit = None
            if hit is not None and hit[0] is type(item[1]):
                parts.append(hit[1])
                continue
            name, value = item
            kv = _key_value(0x4A, name, value, max_len)
            kind = type(value)
            if kind is str or kind is int or (kind is tuple and all(type(v) is str for v in value)):
                if len(cache) >= _CACHE_MAX:
                    cache.clear()
                cache[item] = (kind, kv)
            parts.append(kv)
        if dropped > 0:
            parts.append(b"\x50" + _varint(dropped))
        return b"".join(parts)


# --- the sink: queue on the event loop, export from a thread -------------------------------------


class OtlpHttpSink:
    """Finished traces, queued on the event loop; built, encoded and POSTed by one thread."""

    def __init__(
        self,
        settings: Settings,
        resource: Resource,
        scope: InstrumentationScope,
        environ: Mapping[str, str],
    ) -> None:
        assert settings.endpoint is not None
        env = _Env(environ)
        self.endpoint = settings.endpoint
        self.delay_s = env.number(5000, "OTEL_BSP_SCHEDULE_DELAY") / 1000
        self.max_queue = int(env.number(32768, "OTEL_BSP_MAX_QUEUE_SIZE"))
        self.batch = max(1, int(env.number(4096, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE")))
        self.shutdown_timeout_s = env.number(30000, "OTEL_BSP_EXPORT_TIMEOUT") / 1000
        count = env.number(128, "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "OTEL_ATTRIBUTE_COUNT_LIMIT")
        length = env.number(
            0, "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT"
        )
        self.encoder = SpanEncoder(int(count), int(length) or None)
        self._resource, self._scope = encode_resource(resource, scope)
        self._stopping = threading.Event()
        self._post = _Poster(settings, env, self._stopping)
        self.exported_spans = 0
        self.dropped_spans = 0  # the queue was full
        self.failed_spans = 0  # the collector refused them or could not be reached
        # the event loop appends and counts `_added`; the thread pops and counts `_taken`: each
        # counter has one writer, so the two threads share no lock
        self._queue: collections.deque[RequestTrace] = collections.deque()
        self._added = 0  # spans queued, ever
        self._taken = 0  # spans sent or given up, ever
        self._unwoken = 0  # traces queued since the thread was last woken
        self._blobs: list[tuple[int, bytes]] = []  # encoded traces (span count, bytes), unsent
        self._encoded = 0  # spans in _blobs
        self._wake = threading.Event()
        self._closed = False
        self._logged: dict[str, float] = {}  # message → when last logged
        self._thread = threading.Thread(target=self._run, name="gateway-otlp-export", daemon=True)
        self._thread.start()

    def end(self, trace: RequestTrace) -> None:
        n = trace.spans
        if self._added - self._taken + n > self.max_queue or self._closed:
            self.dropped_spans += n
            self._note("OTLP export queue full (%d spans)", self.max_queue)
            return
        self._queue.append(trace)
        self._added += n
        self._unwoken += 1
        if self._unwoken >= _ENCODE_EVERY:
            self._unwoken = 0
            self._wake.set()

    def shutdown(self) -> None:
        """Export what is queued (waits at most OTEL_BSP_EXPORT_TIMEOUT), then stop the thread."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        self._wake.set()
        self._thread.join(self.shutdown_timeout_s + 1)
        self._post.close()

    def request(self, traces: Iterable[RequestTrace]) -> bytes:
        """The ExportTraceServiceRequest body for finished `traces`, as it would be sent."""
        blobs = []
        for trace in traces:
            trace.build()
            blobs.append(self.encoder.encode(trace))
        return export_request(self._resource, self._scope, blobs)

    @property
    def queued_spans(self) -> int:
        """Spans waiting: queued traces and encoded ones not yet sent."""
        return self._added - self._taken

    def _run(self) -> None:
        """Encode what is queued every few traces (so queued traces live briefly); POST when a
        batch is full or the schedule delay has passed since the last export."""
        last = time.monotonic()
        while not self._stopping.is_set():
            self._wake.wait(max(0.0, last + self.delay_s - time.monotonic()))
            self._wake.clear()
            self._encode()
            now = time.monotonic()
            due = now >= last + self.delay_s
            if due:
                last = now
            self._send(None, everything=due)
        self._encode()  # shutdown: what is left, within the shutdown timeout
        self._send(time.monotonic() + self.shutdown_timeout_s, everything=True)

    def _encode(self) -> None:
        queue, encode, blobs = self._queue, self.encoder.encode, self._blobs
        done = 0
        while queue:
            trace = queue.popleft()
            trace.build()
            blobs.append((trace.spans, encode(trace)))
            self._encoded += trace.spans
            done += 1
            if done % _YIELD_EVERY == 0:
                time.sleep(0)  # let the event loop have the GIL: it never waits long for it

    def _send(self, final: float | None, everything: bool) -> None:
        """POST full batches of the encoded spans, and with `everything` the rest too; `final`
        is the shutdown's deadline for all of them."""
        blobs = self._blobs
        while blobs and (everything or self._encoded >= self.batch):
            end = spans = 0
            while end < len(blobs) and (spans == 0 or spans + blobs[end][0] <= self.batch):
                spans += blobs[end][0]
                end += 1
            body = export_request(self._resource, self._scope, (b for _, b in blobs[:end]))
            del blobs[:end]
            self._encoded -= spans
            deadline = time.monotonic() + self._post.timeout_s
            try:
                error = self._post(body, deadline if final is None else min(deadline, final))
            except Exception as exc:  # never let the export thread die
                error = f"{type(exc).__name__}: {exc}"
            self._taken += spans
            if error is None:
                self.exported_spans += spans
                continue
            self.failed_spans += spans
            self._note("OTLP export of %d spans to %s failed: %s", spans, self.endpoint, error)
            if self._stopping.is_set():  # shutting down and the collector fails: give up the rest
                rest = self._encoded
                blobs.clear()
                self._encoded = 0
                self._taken += rest
                self.failed_spans += rest
                return

    def _note(self, message: str, *args: Any) -> None:
        """A log line, at most one every 10 s for each `message`, with the totals lost so far."""
        now = time.monotonic()
        if now - self._logged.get(message, -_LOG_EVERY_S) < _LOG_EVERY_S:
            return
        self._logged[message] = now
        log.warning(
            message + "; lost so far: %d spans dropped (queue full), %d failed",
            *args,
            self.dropped_spans,
            self.failed_spans,
        )


class _Env:
    def __init__(self, environ: Mapping[str, str]) -> None:
        self.environ = environ

    def get(self, *names: str) -> str:
        """The first of `names` that is set (the traces-specific variable before the generic)."""
        for name in names:
            if value := self.environ.get(name, "").strip():
                return value
        return ""

    def number(self, default: float, *names: str) -> float:
        """The first of `names` that is set, as a number >= 0; `default` when none is."""
        for name in names:
            raw = self.environ.get(name, "").strip()
            if raw:
                try:
                    value = float(raw)
                except ValueError:
                    value = -1.0
                if not value >= 0:
                    raise TracingError(f"{name}={raw!r}: not a number >= 0")
                return value
        return default


class _Poster:
    """POSTs one export body, retrying 429/502/503/504 and lost connections with backoff."""

    def __init__(self, settings: Settings, env: _Env, stopping: threading.Event) -> None:
        self._stopping = stopping  # set: retry no more
        try:
            import requests
        except ImportError as exc:  # what the SDK's OTLP/HTTP exporter brings
            raise TracingError(
                "tracing exporter 'otlp_http' needs requests: pip install "
                "opentelemetry-exporter-otlp-proto-http"
            ) from exc
        self._requests = requests
        self.url = settings.endpoint or ""
        self.timeout_s = env.number(
            10, "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"
        )
        compression = env.get(
            "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "OTEL_EXPORTER_OTLP_COMPRESSION"
        ).lower()
        compressors: dict[str, Callable[[bytes], bytes] | None] = {
            "": None,
            "none": None,
            "gzip": gzip.compress,
            "deflate": zlib.compress,
        }
        if compression not in compressors:
            raise TracingError(
                f"OTEL_EXPORTER_OTLP_COMPRESSION={compression!r}: supported are gzip, deflate, none"
            )
        self._compress = compressors[compression]
        self.headers = {
            "content-type": "application/x-protobuf",
            "user-agent": "kv-gateway-otlp-exporter",
            **settings.headers,
        }
        if self._compress is not None:
            self.headers.setdefault("content-encoding", compression)
        ca = env.get("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", "OTEL_EXPORTER_OTLP_CERTIFICATE")
        key = env.get("OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY", "OTEL_EXPORTER_OTLP_CLIENT_KEY")
        cert = env.get(
            "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE", "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE"
        )
        self._verify: bool | str = ca or True
        self._cert = (cert, key) if cert and key else None
        self._session: requests.Session = requests.Session()

    def __call__(self, body: bytes, deadline: float) -> str | None:
        """None when the collector took it, else why not (after the retries that fit)."""
        data = self._compress(body) if self._compress is not None else body
        error = "timed out"
        for attempt in range(6):
            timeout = min(self.timeout_s, deadline - time.monotonic())
            if timeout <= 0:
                return error
            try:
                res = self._session.post(
                    self.url,
                    data=data,
                    headers=self.headers,
                    timeout=timeout,
                    verify=self._verify,
                    cert=self._cert,
                )
            except self._requests.ConnectionError as exc:
                error, retry = f"cannot connect: {exc}", True
                if attempt == 0:  # often a pooled connection the collector closed: once, at once
                    continue
            except self._requests.RequestException as exc:
                return f"{type(exc).__name__}: {exc}"
            else:
                if res.status_code < 400:
                    return None
                error = f"HTTP {res.status_code} {res.text[:200]!r}"
                retry = res.status_code in _RETRY_STATUS
            backoff = 2**attempt * random.uniform(0.8, 1.2)
            if not retry or time.monotonic() + backoff >= deadline or self._stopping.wait(backoff):
                return error
        return error

    def close(self) -> None:
        self._session.close()
