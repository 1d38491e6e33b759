"""`Snapshot`: everything a request needs, built by one function; a reload is one reference swap.

A request takes the gateway's current snapshot once, when it arrives, and uses only that: its
tenant, limits, pool, replicas, policy, chunker, index and admission queue all come from one
config. A reload (or discovery, or the tokens-mode fallback) builds a new snapshot beside the
running one and swaps the reference; requests in flight finish on the snapshot they took.

What carries over from the previous snapshot when its settings are unchanged: replica states
(circuit, load, counters), policies (their learned state), the chunker, admission (its queues),
the index and the rate limiter (their connections and data).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from gateway.api.openai import ParsedRequest
from gateway.config import Config
from gateway.errors import NotFound
from gateway.fleet.pools import OnChange, Pool, Update, apply_updates, build_pools
from gateway.fleet.replicas import ReplicaState
from gateway.limits.admission import Admission
from gateway.limits.ratelimit import RateLimiter, open_rate_limiter
from gateway.limits.tenants import TenantDirectory
from gateway.routing.router import Router
from prefix_index import MemoryIndex, PrefixIndex, open_index
from prefix_index.chunking import Chunker, make_chunker
from prefix_index.persist import read_snapshot, write_snapshot

log = logging.getLogger("gateway")


@dataclass(frozen=True, slots=True)
class Snapshot:
    version: int  # 1 for the first config, +1 for every swap
    config: Config
    pools: Mapping[str, Pool]
    tenants: TenantDirectory
    admission: Admission
    chunker: Chunker
    index: PrefixIndex | None
    limiter: RateLimiter | None
    router: Router  # over this snapshot's chunker and index

    def replicas(self) -> list[ReplicaState]:
        return [r for p in self.pools.values() for r in p.replicas]

    def replace(self, **parts: Any) -> Snapshot:
        """The next snapshot: these parts changed, the rest (and the router, unless its chunker or
        index changed) carried over."""
        nxt = dataclasses.replace(self, version=self.version + 1, **parts)
        if nxt.chunker is not self.chunker or nxt.index is not self.index:
            nxt = dataclasses.replace(nxt, router=Router(nxt.chunker, nxt.index))
        return nxt


@dataclass(slots=True)
class Built:
    """A snapshot not yet swapped in: `apply()` at the swap; `discard()` if it never is."""

    snapshot: Snapshot
    updates: list[Update]  # kept replicas' new settings
    opened: list[PrefixIndex | RateLimiter] = field(default_factory=list)  # stores new to it

    def apply(self) -> None:
        apply_updates(self.updates)

    async def discard(self) -> None:
        for part in self.opened:
            await close_quietly(part, "a part of a config that was not applied")
        self.opened.clear()


def build_snapshot(config: Config, prev: Snapshot | None, on_change: OnChange) -> Built:
    """The snapshot for `config`, reusing what `prev` has with the same settings; the index and
    the rate limiter are carried over when their settings are unchanged, else left for
    `open_stores`. Nothing of `prev` changes here (kept replicas' new settings wait in `updates`),
    so a config whose parts fail to build (a tokenizer file that is not one) changes nothing."""

    def same(*paths: str) -> bool:
        return prev is not None and all(
            attrgetter(p)(prev.config) == attrgetter(p)(config) for p in paths
        )

    updates: list[Update] = []
    pools = build_pools(config, prev.pools if prev is not None else {}, on_change, updates)
    tenants = TenantDirectory(config.auth, config.tenants, config.priority_classes)
    if prev is not None and same("index.chunking"):
        chunker = prev.chunker
    else:
        chunker = _chunker(config)
    if prev is not None and same("priority_classes", "admission"):
        admission = prev.admission
    else:
        admission = Admission(config.priority_classes, shed_status=config.admission.shed_status)
    index = prev.index if prev is not None and same("index") else None
    limiter = prev.limiter if prev is not None and same("ratelimit") else None
    if not _needs_limiter(config):
        limiter = None
    version = prev.version + 1 if prev is not None else 1
    snap = Snapshot(
        version, config, pools, tenants, admission, chunker, index, limiter, Router(chunker, index)
    )
    return Built(snap, updates)


async def open_stores(built: Built) -> None:
    """Open the index and the rate limiter `built` lacks: both or neither (one that opened is
    closed again if the other fails)."""
    snap = built.snapshot
    index, limiter = snap.index, snap.limiter
    try:
        if index is None:
            index = _open_index(snap.config)
            built.opened.append(index)
        if limiter is None and _needs_limiter(snap.config):
            rl = snap.config.ratelimit
            limiter = open_rate_limiter(rl.backend, rl.redis_url)
            built.opened.append(limiter)
    except BaseException:
        await built.discard()
        raise
    built.snapshot = dataclasses.replace(
        snap, index=index, limiter=limiter, router=Router(snap.chunker, index)
    )


def _chunker(config: Config) -> Chunker:
    ch = config.index.chunking
    return make_chunker(
        ch.mode,
        block_bytes=ch.block_bytes,
        tokenizer=ch.tokenizer,
        block_size=ch.block_size,
        chat_template=ch.chat_template,
    )


def bytes_chunker(config: Config) -> Chunker:
    """The fallback when a replica's tokenizer differs from the configured one."""
    return make_chunker("bytes", block_bytes=config.index.chunking.block_bytes)


def _open_index(config: Config) -> PrefixIndex:
    ic = config.index
    return open_index(
        ic.backend,
        redis_url=ic.redis_url,
        capacity_blocks=ic.capacity_blocks,
        ttl_s=ic.ttl_s,
        routed_ttl_s=ic.events.routed_ttl_s,
        max_blocks=ic.max_blocks,
    )


def _needs_limiter(config: Config) -> bool:
    return any(t.limits.rules() or t.limits.per_model for t in config.tenants)


def warm_start(snap: Snapshot) -> None:
    """Load the memory index's snapshot (`index.snapshot_path`) when there is a fresh one."""
    path, index = snap.config.index.snapshot_path, snap.index
    if path is None or not isinstance(index, MemoryIndex):
        return
    try:
        got = read_snapshot(index, path, snap.config.index.snapshot_max_age_s)
    except (OSError, ValueError) as exc:
        log.warning("prefix index: snapshot %s not loaded (%s); starting cold", path, exc)
        return
    if got is None:
        log.info("prefix index: no snapshot at %s younger than %.0f s; starting cold", path,
                 snap.config.index.snapshot_max_age_s)  # fmt: skip
    else:
        log.info("prefix index: warm start from %s: %d blocks, written %.1f s ago", path, *got)


def save_index(snap: Snapshot) -> None:
    """Write the memory index to `index.snapshot_path` (at shutdown), if one is set."""
    path, index = snap.config.index.snapshot_path, snap.index
    if path is None or not isinstance(index, MemoryIndex):
        return
    try:
        blocks = write_snapshot(index, path)
    except OSError as exc:
        log.warning("prefix index: snapshot %s not written (%s)", path, exc)
        return
    log.info("prefix index: %d blocks written to %s", blocks, path)


async def close_quietly(part: PrefixIndex | RateLimiter, what: str) -> None:
    try:
        await part.aclose()
    except Exception:
        log.warning("closing %s failed", what, exc_info=True)


def pick_pool(snap: Snapshot, req: ParsedRequest, prompt_tokens: int) -> Pool:
    """The route's pool for the model; a request naming no model (kinds where vLLM allows that)
    goes to the default pool: the first route that takes any model, else the first pool."""
    config = snap.config
    name = config.pool_for(req.model, prompt_tokens) if req.model else default_pool(snap, prompt_tokens)
    if name is None:
        model = req.model if len(req.model) <= 64 else req.model[:64] + "…"
        raise NotFound(f"The model `{model}` does not exist.", param="model", code="model_not_found")
    return snap.pools[name]


def default_pool(snap: Snapshot, prompt_tokens: int) -> str:
    config = snap.config
    for route in config.routes:
        if route.match.matches("", prompt_tokens):
            return route.pool
    return next(iter(config.pools))
