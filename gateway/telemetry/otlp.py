"""The gateway's own OTLP/HTTP span exporter: finished traces straight to protobuf, sent in batches.

`OtlpHttpSink.end` runs on the event loop when a sampled request finishes and only queues the
trace. A background thread takes what is queued, builds each trace's spans (the fixed shape of
`trace.py`: a root, up to four segments, one span per upstream attempt), encodes them to
OTLP protobuf bytes and POSTs one
`ExportTraceServiceRequest` per batch (resource and scope encoded once). No SDK span objects and
no protobuf message objects are made; the bytes decode to what the SDK's OTLP exporter sends for
the same spans. The thread offers the GIL back every few traces, so the event loop never waits
long for it; its work still counts as the process's CPU, which is why the encoding is kept cheap
(what repeats from trace to trace is encoded once and cached).

Bounded: at most `max_queue` spans wait; beyond that a trace is dropped whole, counted in
`dropped_spans` and logged (at most one line per 10 s for each kind). Spans a collector refuses
or never answers are counted in `failed_spans` (and their POSTs in `failed_exports`) and logged
the same way, and so are those of a trace that cannot be encoded (a bug: the thread goes on); no error reaches a request. The counts are Prometheus metrics
(`gateway_trace_spans_*_total`, metrics.py).

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
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from gateway.telemetry.otlp_wire import SpanEncoder, encode_resource, export_request
from gateway.telemetry.trace import RequestTrace
from gateway.telemetry.tracing_config import Settings, TracingError

if TYPE_CHECKING:
    import requests

__all__ = ["OtlpHttpSink", "SpanEncoder"]

log = logging.getLogger("gateway.tracing")

_RETRY_STATUS = frozenset((429, 502, 503, 504))
_LOG_EVERY_S = 10.0
_ENCODE_EVERY = 256  # traces queued before the thread is woken to encode them
_YIELD_EVERY = 64  # traces encoded between two offers of the GIL to the event loop


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
        self.failed_spans = 0  # refused by the collector or unreachable (or not encodable)
        self.failed_exports = 0  # POSTs that failed (after their retries)
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
            try:
                blobs.append((trace.spans, encode(trace)))
            except Exception as exc:  # a bug: lose the trace, never the thread
                self._taken += trace.spans
                self.failed_spans += trace.spans
                self._note("a trace could not be encoded (%s)", f"{type(exc).__name__}: {exc}")
            else:
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
            self.failed_exports += 1
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
