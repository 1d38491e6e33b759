"""`/metrics` with vLLM's metric names, types, labels and buckets, in simulated seconds.

One CollectorRegistry per replica; gauges and counters are read from the engine at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from simulator.engine import Engine, StepResult
from simulator.tiers import TierCounters

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LABELS = ("model_name", "engine")
LMCACHE_LABELS = ("model_name", "worker_id")  # LMCache's own (lmcache/observability.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector(Collector):
    """Gauges and counters straight from the engine's state and monotonic counters."""

    def __init__(self, engine: Engine, labels: list[str]) -> None:
        self.engine = engine
        self.labels = labels
        self.started = time.time()  # as vLLM's process collector: a new value is a restart

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        e, lv = self.engine, self.labels
        c = e.counters
        yield GaugeMetricFamily("process_start_time_seconds",
                                "Start time of the process since unix epoch in seconds.",
                                value=self.started)
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        for family, name, doc, value in (
            (gauge, "vllm:num_requests_running", "Number of requests in model execution batches.",
             e.num_running),
            (gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             e.num_waiting),
            (gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             e.kv_usage),
            (counter, "vllm:prefix_cache_queries",
             "Prefix cache queries, in terms of number of queried tokens.", c.prefix_queries),
            (counter, "vllm:prefix_cache_hits",
             "Prefix cache hits, in terms of number of cached tokens.", c.prefix_hits),
            (counter, "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
             c.preemptions),
            (counter, "vllm:prompt_tokens", "Number of prefill tokens processed.", c.prompt_tokens),
            (counter, "vllm:prompt_tokens_cached",
             "Number of cached prompt tokens (local prefix hits).", c.cached_prompt_tokens),
            (counter, "vllm:generation_tokens", "Number of generation tokens processed.",
             c.generation_tokens),
        ):
            m = family(name, doc, labels=LABELS)
            m.add_metric(lv, value)
            yield m
        ok = CounterMetricFamily("vllm:request_success", "Count of successfully processed "
                                 "requests.", labels=(*LABELS, "finished_reason"))
        ok.add_metric([*lv, "stop"], c.finished_stop)
        ok.add_metric([*lv, "length"], c.finished_length)
        ok.add_metric([*lv, "abort"], c.requests_aborted)
        yield ok
        cfg = e.config
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine "
                                 "CacheConfig", labels=("block_size", "enable_prefix_caching",
                                                         "gpu_memory_utilization",
                                                         "num_gpu_blocks"))
        info.add_metric([str(cfg.block_size), str(cfg.enable_prefix_caching),
                         str(cfg.gpu_memory_utilization), str(cfg.num_blocks)], 1.0)
        yield info
        tiers = e.cache.tiers
        if tiers is not None:  # a lower KV tier (simulator/tiers.py): hits by tier, as LMCache's
            hits = CounterMetricFamily("vllm:prefix_cache_tier_hits", "Prompt tokens loaded "
                                       "from a lower KV tier instead of recomputed.",
                                       labels=(*LABELS, "tier"))
            for tier in ("cpu", "shared"):
                hits.add_metric([*lv, tier], tiers.counters.hit_tokens[tier])
            yield hits
            yield from _transfers(tiers.counters, lv, tiers.host is not None,
                                  tiers.shared is not None)
            if tiers.shared is not None:  # the pool's store: the same value on every replica
                size = GaugeMetricFamily("vllm:shared_kv_store_blocks", "KV blocks the shared "
                                         "store holds (all replicas').", labels=LABELS)
                size.add_metric(lv, len(tiers.shared))
                yield size
        if e.lora is not None and e.lora.series:  # absent until an adapter is used, as in vLLM
            lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                     labels=("max_lora", "running_lora_adapters",
                                             "waiting_lora_adapters"))
            for labels, stamp in e.lora.metric_samples():
                lora.add_metric([labels["max_lora"], labels["running_lora_adapters"],
                                 labels["waiting_lora_adapters"]], stamp)
            yield lora


def _transfers(c: TierCounters, lv: list[str], host: bool, shared: bool) -> Iterator[Metric]:
    """What the engines count of their tier transfers. vLLM's OffloadingConnector: bytes and
    seconds per `transfer_type`, `gpu_to_cpu` for spills (at the host bandwidth) and
    `cpu_to_gpu` for loads from the host tier. LMCache, for the shared store: the tokens it
    served and its retrieve time (a histogram; one bucket, +Inf, is enough for its _sum/_count)."""
    if host:
        for name, doc, spilled, loaded in (
            ("vllm:kv_offload_total_bytes", "Number of bytes offloaded by KV connector",
             c.offload_bytes, c.load_bytes["cpu"]),
            ("vllm:kv_offload_total_time", "Total time measured by all KV offloading operations",
             c.offload_s, c.load_s["cpu"]),
        ):
            m = CounterMetricFamily(name, doc, labels=(*LABELS, "transfer_type"))
            m.add_metric([*lv, "gpu_to_cpu"], spilled)
            m.add_metric([*lv, "cpu_to_gpu"], loaded)
            yield m
    if shared:
        worker = [lv[0], lv[1]]
        hits = CounterMetricFamily("lmcache:num_hit_tokens", "Number of hit tokens",
                                   labels=LMCACHE_LABELS)
        hits.add_metric(worker, c.hit_tokens["shared"])
        yield hits
        retrieve = HistogramMetricFamily("lmcache:time_to_retrieve",
                                         "Time to retrieve from lmcache (seconds)",
                                         labels=LMCACHE_LABELS)
        retrieve.add_metric(worker, [("+Inf", c.retrievals)], c.load_s["shared"])
        yield retrieve


class ReplicaMetrics:
    """The replica's registry; `on_step` feeds the latency histograms."""

    def __init__(self, engine: Engine, model_name: str, engine_index: str = "0") -> None:
        self.registry = CollectorRegistry()
        lv = [model_name, engine_index]
        self.registry.register(_EngineCollector(engine, lv))

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            h = Histogram(name, doc, LABELS, registry=self.registry, buckets=buckets)
            return h.labels(*lv)

        self.ttft = hist("vllm:time_to_first_token_seconds",
                         "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds",
                        "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds",
                        "Histogram of e2e request latency in seconds.", REQUEST_BUCKETS)
        def phase(what: str, phase: str) -> Histogram:  # vllm:request_<what>_time_seconds
            return hist(f"vllm:request_{what}_time_seconds",
                        f"Histogram of time spent in {phase} phase for request.", REQUEST_BUCKETS)

        self.queue = phase("queue", "WAITING")
        self.inference = phase("inference", "RUNNING")
        self.prefill = phase("prefill", "PREFILL")
        self.decode = phase("decode", "DECODE")

    def on_step(self, result: StepResult) -> None:
        for seq in result.emitted:
            if seq.last_itl is None:
                self.ttft.observe(result.end_s - seq.arrival_s)
            else:
                self.itl.observe(seq.last_itl)
        for seq in result.finished:
            scheduled = seq.scheduled_s if seq.scheduled_s is not None else seq.arrival_s
            first = seq.first_token_s if seq.first_token_s is not None else result.end_s
            self.e2e.observe(result.end_s - seq.arrival_s)
            self.queue.observe(scheduled - seq.arrival_s)
            self.inference.observe(result.end_s - scheduled)
            self.prefill.observe(first - scheduled)
            self.decode.observe(result.end_s - first)

    def render(self) -> bytes:
        return generate_latest(self.registry)
