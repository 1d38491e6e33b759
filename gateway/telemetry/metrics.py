"""Prometheus metrics of the gateway, one registry per app (no globals), with bounded label sets.

Request counters and histograms are plain numbers (`tallies.py`) read at scrape time.

Per-replica gauges are read from the live replica state at scrape time, so the hot path pays nothing
for them: their collectors stand with what they read (gateway/fleet/metrics.py, tier_metrics.py,
gateway/limits/metrics.py), registered through `Metrics.watch`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.telemetry.receipt import ERROR_BUCKETS
from gateway.telemetry.tallies import CounterTally, HistogramTally, LabelCap, Tallies

# LLM latencies span milliseconds (a cached short prompt) to minutes (a long generation)
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640,
)  # fmt: skip
TPOT_BUCKETS = (
    0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5,
)  # fmt: skip
PROMPT_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
ROUTING_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # the model and tenant labels of the request and token counters, each capped at
        # server.metrics.max_label_values distinct values (the Recorder applies the config's)
        self.models, self.tenants = LabelCap(100), LabelCap(100)
        self.requests = CounterTally(
            "gateway_requests_total",
            "Requests answered, by pool, replica that answered (none when no replica did), HTTP status "
            "(499: the client went away first), priority class, model (none without a pool) and "
            "tenant; model and tenant take at most server.metrics.max_label_values values each, "
            "later ones read other.",
            ["pool", "replica", "status", "priority", "model", "tenant"],
        )
        self.duration = HistogramTally(
            "gateway_request_duration_seconds",
            "End-to-end time of a request at the gateway, from first byte in to last byte out.",
            ["pool"],
            LATENCY_BUCKETS,
        )
        self.ttft = HistogramTally(
            "gateway_ttft_seconds",
            "Time to first token seen by the gateway: request in to first response byte relayed.",
            ["pool", "replica"],
            LATENCY_BUCKETS,
        )
        self.tpot = HistogramTally(
            "gateway_tpot_seconds",
            "Mean time per output token of a streamed answer: (last - first chunk) / (tokens - 1).",
            ["pool", "replica"],
            TPOT_BUCKETS,
        )
        self.prompt_length = HistogramTally(
            "gateway_prompt_length_tokens",
            "Prompt length in tokens (the replica's count when it reports usage, else the estimate).",
            ["pool"],
            PROMPT_BUCKETS,
        )
        self.prompt_tokens = CounterTally(
            "gateway_prompt_tokens_total",
            "Prompt tokens of answered requests, by pool, model and tenant.",
            ["pool", "model", "tenant"],
        )
        self.output_tokens = CounterTally(
            "gateway_output_tokens_total",
            "Output tokens of answered requests (from usage), by pool, model and tenant.",
            ["pool", "model", "tenant"],
        )
        self.observed_prompt_tokens = CounterTally(
            "gateway_observed_prompt_tokens_total",
            "Prompt tokens of answers whose usage reported cached tokens (denominator of the observed hit ratio).",
            ["pool"],
        )
        self.observed_cached_tokens = CounterTally(
            "gateway_observed_cached_tokens_total",
            "Prompt tokens the replica reported served from its prefix cache (usage.prompt_tokens_details.cached_tokens).",
            ["pool"],
        )
        self.receipts = CounterTally(
            "gateway_route_receipts_total",
            "Served requests of a pool whose policy hashes prompts, by how the gateway's predicted "
            "cached prompt tokens compared with the engine's report (cold: neither expected a hit, "
            "exact, within_block: off by at most one engine block, over: predicted more than the "
            "engine reused, under: less, unreported: the engine did not say); "
            "docs/real-vllm.md#the-route-receipt.",
            ["pool", "verdict"],
        )
        self.receipt_error = HistogramTally(
            "gateway_route_receipt_error_tokens",
            "Predicted minus engine-reported cached prompt tokens of a served request, in engine "
            "tokens (0: the prediction was exact; > 0: the gateway expected a hit the engine did "
            "not have).",
            ["pool"],
            ERROR_BUCKETS,
        )
        self.attempts = CounterTally(
            "gateway_upstream_attempts_total",
            "Attempts to reach a replica, by outcome (ok, failover reasons, broken mid-stream).",
            ["pool", "replica", "outcome"],
        )
        self.decisions = CounterTally(
            "gateway_routing_decisions_total",
            "Routing decisions by pool, policy and the reason the winner won.",
            ["pool", "policy", "reason"],
        )
        self.routing_time = HistogramTally(
            "gateway_routing_duration_seconds",
            "Time spent routing one request: hashing, index lookup and scoring.",
            ["pool"],
            ROUTING_BUCKETS,
        )
        self.prompt_blocks = CounterTally(
            "gateway_prompt_blocks_total",
            "Full prompt blocks hashed for routing.",
            ["pool"],
        )
        self.predicted_hit_blocks = CounterTally(
            "gateway_predicted_hit_blocks_total",
            "Prompt blocks the index predicted cached on the chosen replica; divide by "
            "gateway_prompt_blocks_total for the predicted prefix-hit ratio.",
            ["pool"],
        )
        self.queue_wait = HistogramTally(
            "gateway_queue_wait_seconds",
            "Time a request waited at the gateway for a replica slot (admission), by pool and class.",
            ["pool", "priority"],
            (0.0, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
        )
        self.resumes = CounterTally(
            "gateway_stream_resumes_total",
            "Answers whose replica failed (or was drained) after the first byte, by what set the "
            "resume off and its outcome: resumed (by token ids), inexact (from the text), "
            "not_resumable, failed (no replica took the continuation) (docs/resume.md).",
            ["pool", "trigger", "outcome"],
        )
        self.resume_gap = HistogramTally(
            "gateway_stream_resume_gap_seconds",
            "Time a resumed answer's client waited between the last token before the failure "
            "and the first token after it.",
            ["pool"],
            (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
        )
        self.resume_tokens = CounterTally(
            "gateway_stream_resume_tokens_total",
            "Tokens of the continuations that resumed streams: `relayed` (the answer's tokens the "
            "client had at each resume), `prefilled` and `cached` (the continuation's prompt, "
            "the original prompt plus the relayed tokens, as its engine reported it computed or "
            "found cached).",
            ["pool", "kind"],
        )
        self.limited = CounterTally(
            "gateway_ratelimited_total",
            "Requests refused by a tenant's rate limit, by tenant and the limit that ran out.",
            ["tenant", "limit"],
        )
        self.errors = CounterTally(
            "gateway_errors_total",
            "Errors returned to clients, by pool (none before a pool was chosen) and error type.",
            ["pool", "type"],
        )

        r.register(
            Tallies(
                [t for t in vars(self).values() if isinstance(t, CounterTally | HistogramTally)]
            )
        )

    def watch(self, collector: Collector) -> None:
        """A collector of a higher floor's state, read at scrape time (the replicas' in
        gateway/fleet/metrics.py, the admission queue's in gateway/limits/metrics.py)."""
        self.registry.register(collector)

    def watch_index(self, state: Callable[[], tuple[Any, Any, dict[str, int]]]) -> None:
        """`state()` gives (index, kv_events or None, token parity by replica)."""
        self.registry.register(_IndexCollector(state))

    def watch_tracing(self, sink: Callable[[], object]) -> None:
        """`sink()` gives the tracing's span sink (None when tracing is off)."""
        self.registry.register(_TracingCollector(sink))

    def watch_redis(self, parts: Callable[[], Iterable[tuple[str, object]]]) -> None:
        """`parts()` gives (component, store) pairs; one with a RedisHealth `health` is on Redis."""
        self.registry.register(_RedisCollector(parts))


class _RedisCollector(Collector):
    """The Redis connections of the index and the rate limiter (prefix_index.redis_client's
    RedisHealth, read at scrape time), by component; no sample for one not on Redis."""

    _COUNTERS = (
        ("outages", "gateway_redis_outages", "Times the component lost Redis (it answers locally meanwhile)."),
        ("recoveries", "gateway_redis_recoveries", "Times Redis came back for the component."),
        ("down_s", "gateway_redis_down_seconds", "Seconds the component was without Redis, counted when each outage ends."),
        ("switches", "gateway_redis_master_switches", "Sentinel master changes the component followed."),
    )  # fmt: skip
    _INDEX = (
        ("rebuilds", "gateway_index_rebuilds", "Times Redis had lost the shared index (flushed, restarted, failed over empty) and this gateway re-wrote its recent records."),
        ("replayed_writes", "gateway_index_rebuilt_records", "Records this gateway re-wrote in those rebuilds."),
    )  # fmt: skip

    def __init__(self, parts: Callable[[], Iterable[tuple[str, object]]]) -> None:
        self._parts = parts

    def collect(self) -> Iterator[Metric]:
        healths = [(c, h) for c, store in self._parts() if (h := getattr(store, "health", None))]
        up = GaugeMetricFamily(
            "gateway_redis_up", "1 while the component reaches Redis, 0 during an outage.",
            labels=["component"],
        )  # fmt: skip
        for component, h in healths:
            up.add_metric([component], 1.0 if h.up else 0.0)
        yield up
        for attr, name, doc in self._COUNTERS:
            fam = CounterMetricFamily(name, doc, labels=["component"])
            for component, h in healths:
                fam.add_metric([component], getattr(h, attr))
            yield fam
        for attr, name, doc in self._INDEX:
            fam = CounterMetricFamily(name, doc, labels=[])
            for h in (h for component, h in healths if component == "index"):
                fam.add_metric([], getattr(h, attr))
            yield fam


class _TracingCollector(Collector):
    """The OTLP/HTTP exporter's counts (gateway/telemetry/otlp.py); the families stay empty for the other
    exporters, whose SDK processor keeps no such counts, and with tracing off."""

    _COUNTERS = (
        ("exported_spans", "gateway_trace_spans_exported", "Spans the OTLP collector accepted."),
        ("dropped_spans", "gateway_trace_spans_dropped", "Spans dropped unsent because the export queue was full (OTEL_BSP_MAX_QUEUE_SIZE)."),
        ("failed_spans", "gateway_trace_spans_failed", "Spans given up: the collector refused them or could not be reached, after the retries that fit (or they could not be encoded)."),
        ("failed_exports", "gateway_trace_export_failures", "Export requests (POSTs of a batch) that failed after their retries."),
    )  # fmt: skip

    def __init__(self, sink: Callable[[], object]) -> None:
        self._sink = sink

    def collect(self) -> Iterator[Metric]:
        from gateway.telemetry.otlp import OtlpHttpSink

        sink = self._sink()
        otlp = sink if isinstance(sink, OtlpHttpSink) else None
        for attr, name, doc in self._COUNTERS:
            fam = CounterMetricFamily(name, doc, labels=[])
            if otlp is not None:
                fam.add_metric([], getattr(otlp, attr))
            yield fam
        queued = GaugeMetricFamily(
            "gateway_trace_export_queue_spans", "Spans waiting to be exported.", labels=[]
        )
        if otlp is not None:
            queued.add_metric([], otlp.queued_spans)
        yield queued


class _IndexCollector(Collector):
    _COUNTERS = (
        ("received", "gateway_kv_events_received", "KV event batches received from the replica."),
        ("applied", "gateway_kv_events_applied", "KV event batches applied to the index."),
        ("dropped", "gateway_kv_events_dropped", "KV event batches that could not be decoded."),
        ("gaps", "gateway_kv_events_gaps", "Sequence gaps seen (lost batches)."),
        ("replays", "gateway_kv_events_replays", "Replays asked of the replica's replay socket."),
        ("forgets", "gateway_kv_events_forgets", "Times the replica's blocks were forgotten (restart, unfillable gap, cleared)."),
        ("deaths", "gateway_kv_events_deaths", "Times the replica's subscriber failed and was started again."),
    )  # fmt: skip

    def __init__(self, state: Callable[[], tuple[Any, Any, dict[str, int]]]) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        index, events, parity = self._state()
        st = None if index is None else index.stats_now()  # None: the backend has no cheap one
        if st is not None:
            blocks = GaugeMetricFamily(
                "gateway_index_blocks",
                "Blocks the prefix index holds per replica, by source (routed: learned from routing; engine: reported by KV events).",
                labels=["replica", "source"],
            )
            for replica, n in st.blocks_per_replica.items():  # redis: in Redis, not here
                blocks.add_metric([replica, "routed"], n)
            for replica, n in st.engine_blocks_per_replica.items():
                blocks.add_metric([replica, "engine"], n)
            yield blocks
        if st is not None and st.backend == "memory":  # redis: its figures need a round trip
            yield GaugeMetricFamily(
                "gateway_index_bytes",
                "Memory the prefix index takes (estimate).",
                value=st.bytes_estimate,
            )
            yield GaugeMetricFamily(
                "gateway_index_scopes",
                "Scopes (model, adapter, cache salt) the prefix index holds blocks for.",
                value=st.scopes,
            )
            yield CounterMetricFamily(
                "gateway_index_bound_evicted_blocks",
                "Index entries pushed out by index.max_blocks (least recently recorded scopes first).",
                value=st.bound_evicted,
            )
        par = GaugeMetricFamily(
            "gateway_token_parity",
            "1 when the replica tokenizes a probe exactly as the gateway (tokens mode), 0 when not, -1 unknown.",
            labels=["replica"],
        )
        for replica, v in parity.items():
            par.add_metric([replica], v)
        yield par
        if events is None:
            return
        subs = list(events.subscribers.values())
        for attr, name, doc in self._COUNTERS:
            fam = CounterMetricFamily(name, doc, labels=["replica"])
            for sub in subs:
                fam.add_metric([sub.replica], getattr(sub.stats, attr))
            yield fam
        caught_up = GaugeMetricFamily(
            "gateway_kv_events_caught_up",
            "1 while the replica's subscriber is live and its catch-up replay is applied; 0 before, when the replay timed out or the subscriber died: its blocks are stale (it is routed as a replica without KV events).",
            labels=["replica"],
        )
        for sub in subs:
            caught_up.add_metric([sub.replica], 1.0 if sub.stats.caught_up else 0.0)
        yield caught_up
        unknown = CounterMetricFamily(
            "gateway_kv_events_unplaced_blocks",
            "Stored blocks the gateway could not place (unknown parent, LoRA without a name, salts).",
            labels=["replica"],
        )
        for sub in subs:
            c = sub.applier.counts
            unknown.add_metric([sub.replica], c.unknown_parent + c.unscoped)
        yield unknown
        tiers = CounterMetricFamily(  # docs/tiers.md
            "gateway_kv_events_tier_blocks",
            "Lower-tier blocks in KV events: stored, removed, placeholder (no token ids, "
            "ignored), unknown_medium (ignored, never counted as GPU).",
            labels=["replica", "kind"],
        )
        for sub in subs:
            c = sub.applier.counts
            kinds = (("stored", c.tier_stored), ("removed", c.tier_removed),
                     ("placeholder", c.placeholder), ("unknown_medium", c.unknown_medium))  # fmt: skip
            for kind, n in kinds:
                tiers.add_metric([sub.replica, kind], n)
        yield tiers
