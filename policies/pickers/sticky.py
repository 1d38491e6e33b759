"""Sticky-until-saturated picker (after llm-d's token-aware routing).

A replica is *sticky* for a request when it holds at least `affinity_threshold` of its prompt
blocks. Each candidate's in-flight token load, this request's uncached part included, is

    tokens(v) = inflight_prompt_tokens + load * held_tokens_per_request
                + max(0, prompt_tokens - hit_blocks * tpb)
    wait(v)   = tokens(v) / peak_prefill_tokens_per_s

`held_tokens_per_request` (default: this request's prompt size) counts the work every request
already there carries beyond its pending prefill: the gateway counts uncached tokens, and a
burst of fully cached requests adds none, yet it still fills the replica's batch.

The best sticky replica (lowest wait) wins (reason "prefix") unless its wait exceeds the best
non-sticky one's by more than `max_ttft_penalty_s`, i.e. it carries about
peak_prefill_tokens_per_s * max_ttft_penalty_s more tokens; then, and when no replica is sticky,
the lowest wait wins (reasons "guard", "load"). llm-d's defaults are 15,928 tok/s and 18 s; 2 s
here keeps interactive TTFT in view. Tune peak to the replicas' measured prefill rate.

Config:

    picker: {name: sticky, affinity_threshold: 0.8, peak_prefill_tokens_per_s: 16000,
             max_ttft_penalty_s: 2.0, held_tokens_per_request: null}
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from policies.base import GUARD, SeededPicker
from policies.types import ReplicaView, RoutedRequest


class StickyPicker(SeededPicker):
    name = "sticky"
    needs_prefix = True  # affinity is the share of the prompt's blocks a replica holds

    def __init__(
        self,
        *,
        affinity_threshold: float = 0.8,
        peak_prefill_tokens_per_s: float = 16000.0,
        max_ttft_penalty_s: float = 2.0,
        held_tokens_per_request: float | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if not 0 < affinity_threshold <= 1:
            raise ValueError(f"affinity_threshold must be in (0, 1], got {affinity_threshold!r}")
        if not peak_prefill_tokens_per_s > 0:
            raise ValueError(
                f"peak_prefill_tokens_per_s must be > 0, got {peak_prefill_tokens_per_s!r}"
            )
        if not max_ttft_penalty_s >= 0:
            raise ValueError(f"max_ttft_penalty_s must be >= 0, got {max_ttft_penalty_s!r}")
        if held_tokens_per_request is not None and not held_tokens_per_request >= 0:
            raise ValueError(
                f"held_tokens_per_request must be >= 0, got {held_tokens_per_request!r}"
            )
        self.held_tokens_per_request = held_tokens_per_request
        self.affinity_threshold = float(affinity_threshold)
        self.peak = float(peak_prefill_tokens_per_s)
        self.max_ttft_penalty_s = float(max_ttft_penalty_s)
        super().__init__(rng=rng)

    def pick(
        self, req: RoutedRequest, views: Sequence[ReplicaView], totals: dict[str, float]
    ) -> tuple[list[str], str]:
        rand = self._rng.random
        n, prompt, tpb = len(req.block_hashes), req.prompt_tokens, req.tokens_per_block
        need = self.affinity_threshold * n
        held = prompt if self.held_tokens_per_request is None else self.held_tokens_per_request
        peak = self.peak
        keyed: list[tuple[float, int, float, str, bool]] = []  # wait, -hit, tiebreak, name, sticky
        for v in views:
            uncached = prompt - v.hit_blocks * tpb
            tokens = v.inflight_prompt_tokens + v.load * held + (uncached if uncached > 0 else 0)
            is_sticky = n > 0 and v.hit_blocks >= need
            keyed.append((tokens / peak, -v.hit_blocks, rand(), v.name, is_sticky))
        keyed.sort()
        ranked = [k[3] for k in keyed]
        best = next((k for k in keyed if k[4]), None)
        if best is None:
            return ranked, "load"
        other = next((k for k in keyed if not k[4]), None)
        if other is not None and best[0] - other[0] > self.max_ttft_penalty_s:
            return ranked, GUARD
        ranked.remove(best[3])
        return [best[3], *ranked], "prefix"
