"""Parse a replica's Prometheus `/metrics` text into the load signals routing uses (vLLM and SGLang names)."""

from __future__ import annotations

from dataclasses import dataclass

# metric name -> field; several names per field cover engine versions (vLLM old/new, SGLang)
_FIELDS: dict[str, str] = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:num_preemptions": "preemptions",
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:prefix_cache_queries": "prefix_queries",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:prefix_cache_hits": "prefix_hits",
    "sglang:num_queue_reqs": "waiting",
    "sglang:num_running_reqs": "running",
    "sglang:token_usage": "kv_usage",
    "sglang:num_retracted_reqs": "preemptions",
}
_MEAN_FIELDS = frozenset({"kv_usage"})  # averaged over engines (DP ranks); the rest are summed


@dataclass(slots=True)
class LoadSample:
    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    preemptions: float | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None


def parse_metrics(text: str) -> LoadSample:
    """Sum each signal over its label sets (engines), averaging KV usage; unknown names are ignored."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        if brace >= 0:
            name = line[:brace]
            end = line.rfind("}")
            rest = line[end + 1 :].split()
        else:
            name, _, tail = line.partition(" ")
            rest = tail.split()
        field = _FIELDS.get(name)
        if field is None or not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        if value != value:  # NaN
            continue
        sums[field] = sums.get(field, 0.0) + value
        counts[field] = counts.get(field, 0) + 1
    sample = LoadSample()
    for field, total in sums.items():
        setattr(sample, field, total / counts[field] if field in _MEAN_FIELDS else total)
    return sample
