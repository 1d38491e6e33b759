"""Build the index backend that `index.backend` names.

`open_index` does no I/O: the Redis backend connects on first use and never raises on an outage.
"""

from __future__ import annotations

from prefix_index.base import PrefixIndex
from prefix_index.constants import (
    DEFAULT_CAPACITY_BLOCKS,
    DEFAULT_MAX_BLOCKS,
    DEFAULT_REDIS_TTL_S,
    DEFAULT_ROUTED_TTL_S,
)
from prefix_index.memory import MemoryIndex
from prefix_index.redis import RedisIndex

BACKENDS = ("memory", "redis")


def open_index(
    backend: str,
    *,
    redis_url: str | None = None,
    capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
    ttl_s: float | None = None,
    routed_ttl_s: float = DEFAULT_ROUTED_TTL_S,
    max_blocks: int = DEFAULT_MAX_BLOCKS,
) -> PrefixIndex:
    """The index for `index.backend` (memory | redis). For redis, `ttl_s=None` means the
    default 600 s: shared entries must age out when a gateway or replica vanishes.
    `routed_ttl_s` is the life of a routed entry on a replica in precise mode (KV events);
    both backends have that mode (both are EngineEventSinks; the redis one keeps engine
    entries in each gateway's process, routed ones shared). `max_blocks`
    bounds the whole index, over every scope and replica (see MemoryIndex)."""
    if backend == "memory":
        return MemoryIndex(capacity_blocks, ttl_s, routed_ttl_s=routed_ttl_s, max_blocks=max_blocks)
    if backend != "redis":
        raise ValueError(f"index.backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if not redis_url:
        raise ValueError("index.redis_url is required when index.backend is redis")
    return RedisIndex(
        redis_url,
        capacity_blocks=capacity_blocks,
        ttl_s=DEFAULT_REDIS_TTL_S if ttl_s is None else ttl_s,
        max_blocks=max_blocks,
        routed_ttl_s=routed_ttl_s,
    )
