"""Parse a replica's Prometheus `/metrics` text into the load signals routing uses (vLLM and SGLang names).

Besides the load, the engine's KV cache geometry: `vllm:cache_config_info{block_size, num_gpu_blocks}`
and `sglang:cache_config_info{page_size, num_pages}` (info gauges: the facts are labels).

And what the engine measured of its loads from lower KV tiers (docs/tiers.md), so that routing
prices a tier at the bandwidth the replica really gets: vLLM's OffloadingConnector counters
`vllm:kv_offload_total_bytes{transfer_type}` and `vllm:kv_offload_total_time{transfer_type}`
(a load from tier X is transfer type `<x>_to_gpu`; prometheus_client may add a `_total`
suffix), and LMCache's `lmcache:time_to_retrieve` (histogram, its `_sum`) with
`lmcache:num_hit_tokens` (the shared store's seconds per token). Only the lines of those families
pay for a look at their labels; every other line costs the one dict lookup it did before.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefix_index.tiers import GPU, normalize_medium

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
    # the engine's API server process (prometheus_client's process collector): a new value is a
    # restart, whose prefix cache starts empty
    "process_start_time_seconds": "started",
    # loads from lower KV tiers: by tier (the transfer_type label) or LMCache's store
    "vllm:kv_offload_total_bytes": "transfer_bytes",
    "vllm:kv_offload_total_bytes_total": "transfer_bytes",
    "vllm:kv_offload_total_time": "transfer_s",
    "vllm:kv_offload_total_time_total": "transfer_s",
    "lmcache:time_to_retrieve_sum": "retrieve_s",
    "lmcache:num_hit_tokens": "retrieve_tokens",
    "lmcache:num_hit_tokens_total": "retrieve_tokens",
}
_BY_TIER = frozenset({"transfer_bytes", "transfer_s"})  # summed per tier, not in total
_TRANSFER_TYPE = 'transfer_type="'
_TO_GPU = "_to_gpu"
_MEAN_FIELDS = frozenset({"kv_usage"})  # averaged over engines (DP ranks); the rest are summed
# info gauge -> (label of the block size in tokens, label of the number of KV blocks)
_CACHE_INFO: dict[str, tuple[str, str]] = {
    "vllm:cache_config_info": ("block_size", "num_gpu_blocks"),
    "sglang:cache_config_info": ("page_size", "num_pages"),
}


@dataclass(slots=True)
class LoadSample:
    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    preemptions: float | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    started: float | None = None  # the engine process's start (Unix seconds)
    block_size: int | None = None  # the engine's KV block size in tokens (cache_config_info)
    kv_blocks: int | None = None  # its KV blocks, all engines (DP ranks) together
    # bytes loaded into the GPU from each lower tier, and the seconds it took (vLLM's
    # kv_offload counters, transfer_type <tier>_to_gpu; all engines); None: not exported
    transfer_bytes: dict[str, float] | None = None
    transfer_s: dict[str, float] | None = None
    retrieve_s: float | None = None  # LMCache: seconds spent retrieving (time_to_retrieve_sum)
    retrieve_tokens: float | None = None  # LMCache: tokens it served (num_hit_tokens)

    @property
    def kv_tokens(self) -> int | None:
        """Tokens of KV the engine holds at most, as it reports them; None when it does not."""
        if self.block_size is None or self.kv_blocks is None:
            return None
        return self.block_size * self.kv_blocks


def parse_metrics(text: str) -> LoadSample:
    """Sum each signal over its label sets (engines), averaging KV usage; unknown names are ignored."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    sample_info: dict[str, int] = {}
    by_tier: dict[str, dict[str, float]] = {}
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
        if field is None:
            if name in _CACHE_INFO and brace >= 0:
                _cache_info(sample_info, _CACHE_INFO[name], line[brace + 1 : line.rfind("}")])
            continue
        if not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        if value != value:  # NaN
            continue
        if field in _BY_TIER:
            tier = _load_tier(line, brace) if brace >= 0 else None
            if tier is not None:
                into = by_tier.setdefault(field, {})
                into[tier] = into.get(tier, 0.0) + value
            continue
        sums[field] = sums.get(field, 0.0) + value
        counts[field] = counts.get(field, 0) + 1
    sample = LoadSample(
        block_size=sample_info.get("block_size"), kv_blocks=sample_info.get("blocks")
    )
    for field, total in sums.items():
        setattr(sample, field, total / counts[field] if field in _MEAN_FIELDS else total)
    for field, per_tier in by_tier.items():
        setattr(sample, field, per_tier)
    return sample


def _load_tier(line: str, brace: int) -> str | None:
    """The tier a `kv_offload` line's transfer loads from (`cpu_to_gpu` -> cpu); None for a
    store to a lower tier (`gpu_to_cpu`), a medium no engine documents, or no such label."""
    at = line.find(_TRANSFER_TYPE, brace)
    if at < 0:
        return None
    start = at + len(_TRANSFER_TYPE)
    kind = line[start : line.find('"', start)]
    if not kind.endswith(_TO_GPU):
        return None
    tier = normalize_medium(kind[: -len(_TO_GPU)])
    return None if tier is None or tier == GPU else tier


def _cache_info(into: dict[str, int], names: tuple[str, str], labels: str) -> None:
    """One engine's cache_config_info labels: its block size (the first one seen wins) and its
    block count (added to the other engines')."""
    found: dict[str, str] = {}
    for pair in labels.split(","):
        key, _, value = pair.partition("=")
        found[key.strip()] = value.strip().strip('"')
    try:
        size, blocks = int(found[names[0]]), int(found[names[1]])
    except (KeyError, ValueError):
        return  # an engine that has not sized its cache yet ("None"), or another version's labels
    if size > 0 and blocks > 0:
        into.setdefault("block_size", size)
        into["blocks"] = into.get("blocks", 0) + blocks
