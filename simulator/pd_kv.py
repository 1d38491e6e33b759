"""Where a P/D prompt's KV lives: the decode engine's blocks for it, and how long the move takes.

Used by the HTTP replicas (simulator/pd.py) and the discrete-event mode (simulator/pd_des.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from simulator.engine import Engine
from simulator.sequence import Sequence as Seq


def transfer_seconds(tokens: int, kv_bytes_per_token: float, link_gbps: float) -> float:
    """KV bytes of `tokens` over a `link_gbps` link (the seeds' formula x 8 bits / bandwidth)."""
    return tokens * kv_bytes_per_token * 8.0 / (link_gbps * 1e9)


def reserve_blocks(engine: Engine, prompt_len: int, hashes: Sequence[int],
                   ) -> tuple[list[int], int] | None:
    """A decode engine's blocks for a prompt whose KV comes from P: the locally cached prefix
    (not pulled) plus fresh blocks; (blocks, cached blocks), or None when they do not fit."""
    cache, bs = engine.cache, engine.config.block_size
    limit = (prompt_len - 1) // bs
    hit = cache.cached_blocks(hashes[:cache.longest_prefix(hashes, limit)]) \
        if engine.config.enable_prefix_caching else []
    need = -(-prompt_len // bs) - len(hit)
    if cache.num_free - cache.count_free_among(hit) < need:
        return None
    cache.acquire(hit)
    fresh = cache.allocate(need)
    assert fresh is not None
    return hit + fresh, len(hit)


def adopt(seq: Seq, blocks: list[int], n_hit: int) -> None:
    """A queued decode sequence owns the pulled KV: only its last prompt token is computed
    (the scheduler admits it without a prefix lookup, simulator/scheduler.py)."""
    seq.blocks, seq.n_registered = blocks, n_hit
    seq.num_computed = seq.prompt_len - 1
