"""Shared scrapes: with shared load, each replica's `/metrics` is scraped by one gateway of the
fleet, and the others take its samples from the fleet's hash (gateway/fleet/shared_load.py).

An engine renders its Prometheus text on the same process that streams its tokens: vLLM's API
server, SGLang's tokenizer manager. A fleet of N gateways that each scrape every replica every
`scrape.interval_s` costs every engine N renders an interval: measured with bench.scaleout's
simulated replicas (3.9 ms of CPU per render of a 20 KB text), three more gateways added 0.8 s
of CPU to an 8.5 s replay, and the replicas' TTFT rose with it.

Who scrapes: the live gateway (this one and the peers its tick counts) with the highest
rendezvous hash of (gateway id, replica URL), so every gateway of the fleet agrees without a
word, a replica's scraper changes only when gateways come or go, and a gateway that stops
scraping for good (gone, or Redis out for it) is replaced once its peers stop counting it
(`fleet.stale_after_s`). While the shared load is down, a gateway scrapes every replica itself.

What goes with the tick's field (`"m"`, only when the tick publishes: a new sample alone does
not make it publish; under traffic every tick does, idle the heartbeat carries it):

    {replica url: [seq, {LoadSample fields that are set}, [adapters in flight, max_lora] | null]}

A peer's sample with a new `seq` is taken as scraped when it arrives (at most a tick or two old,
against `scrape.stale_after_s` of 5 s), with its LoRA info and the engine's KV geometry, exactly
as an own scrape is (`ReplicaState.took_scrape`). Health probes stay per gateway: each needs its
own view of whether it can reach a replica, and they are cheap (0.13 ms per probe there).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import fields
from typing import Any

import xxhash

from gateway.fleet.lora import LoraInfo
from gateway.fleet.replicas import ReplicaState
from gateway.fleet.scrape import LoadSample

_SAMPLE_FIELDS = tuple(f.name for f in fields(LoadSample))


class ScrapeShare:
    """Who scrapes which replica, and the samples one gateway shares and takes."""

    def __init__(self, gateway_id: str) -> None:
        self.gateway_id = gateway_id
        self.shared = True  # False while the shared load is down: scrape every replica here
        self.applied = 0  # peers' samples taken
        self._ids: tuple[str, ...] = (gateway_id,)
        self._owner: dict[str, str] = {}  # url -> its scraper, for the current ids

    def set_live(self, peer_ids: Iterable[bytes], shared: bool) -> None:
        """The live gateways that share their scrapes as of this tick (peers' ids: a gateway of
        an older version, whose field has no "m", scrapes for itself alone and is no
        candidate), and whether Redis answered."""
        ids = tuple(sorted({self.gateway_id, *(p.decode("utf-8", "replace") for p in peer_ids)}))
        self.shared = shared
        if ids != self._ids:
            self._ids, self._owner = ids, {}

    def owns(self, url: str) -> bool:
        """This gateway scrapes `url` (ReplicaState.scrape_here)."""
        if not self.shared or len(self._ids) == 1:
            return True
        owner = self._owner.get(url)
        if owner is None:
            owner = self._owner[url] = max(
                self._ids, key=lambda g: xxhash.xxh64_intdigest(f"{g}\0{url}".encode())
            )
        return owner == self.gateway_id

    def payload(self, replicas: Iterable[ReplicaState]) -> dict[str, list[Any]]:
        """This gateway's fresh scrapes of the replicas it scrapes, for the tick's field."""
        now = time.monotonic()
        out: dict[str, list[Any]] = {}
        for r in replicas:
            own = r.own_scrape
            if own is None or r.url in out or now - own[1] > r.stale_after_s:
                continue
            if not self.owns(r.url):
                continue
            seq, _, sample, lora = own
            values = {f: v for f in _SAMPLE_FIELDS if (v := getattr(sample, f)) is not None}
            out[r.url] = [seq, values, None if lora is None else [sorted(lora[0]), lora[1]]]
        return out

    def take(
        self, seen: dict[str, int], shared: Any, by_url: Mapping[str, list[ReplicaState]]
    ) -> None:
        """Apply a peer's shared samples (`seen`: that peer's last seq per URL, updated) to the
        replicas (`by_url`: `replicas_by_url`) this gateway does not scrape itself."""
        if not isinstance(shared, Mapping) or not shared:
            return
        now = time.monotonic()
        for url, item in shared.items():
            targets = by_url.get(url)
            if not targets or self.owns(url):
                continue
            seq = _seq(item)  # read first: most ticks bring the sample taken last time again
            if seq is None or seen.get(url) == seq:
                continue
            parsed = _parse(item)
            if parsed is None:
                continue
            seen[url] = seq
            for r in targets:
                r.took_scrape(parsed[0], parsed[1], now)
            self.applied += 1


def replicas_by_url(replicas: Iterable[ReplicaState]) -> dict[str, list[ReplicaState]]:
    """The replicas by URL (one engine may serve in more than one pool)."""
    out: dict[str, list[ReplicaState]] = {}
    for r in replicas:
        out.setdefault(r.url, []).append(r)
    return out


def _seq(item: Any) -> int | None:
    """The seq of [seq, {fields}, lora] as `payload` writes it; None for anything else."""
    try:
        return int(item[0])
    except (TypeError, ValueError, IndexError, KeyError):
        return None


def _parse(item: Any) -> tuple[LoadSample, LoraInfo | None] | None:
    """The sample and LoRA info of [seq, {fields}, lora]; None for anything else (another
    version)."""
    try:
        _, values, lora = item
        sample = LoadSample(**{k: v for k, v in values.items() if k in _SAMPLE_FIELDS})
        info = None if lora is None else (frozenset(str(a) for a in lora[0]), lora[1])
        return sample, info
    except (TypeError, ValueError, AttributeError):
        return None
