"""Continuous batching with chunked prefill, prefix-cache admission and recompute preemption.

One call to `schedule` decides one engine step, the way vLLM's v1 scheduler does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from simulator.config import EngineConfig
from simulator.kv_cache import PrefixCache, block_hashes
from simulator.lora import LoraState
from simulator.sequence import Sequence, Status, WaitingQueue


@dataclass(slots=True)
class Batch:
    """What one step computes: tokens per sequence, and the sequences it preempted."""

    items: dict[Sequence, int] = field(default_factory=dict)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)


class Scheduler:
    """Running requests first (each gets its next token or prefill chunk), then admissions.

    - Token budget per step: `max_num_batched_tokens`; a prompt longer than what is left is
      prefilled in chunks over several steps (chunked prefill). A running request (decoding,
      or part way through its prompt) is served before any waiting one, in admission order;
      waiting requests are admitted while budget and `max_num_seqs` allow, the last one
      admitted possibly with a partial chunk. `long_prefill_token_threshold` (vLLM's) caps
      the prompt tokens any one request gets in a step.
    - At most `max_num_seqs` running. A request admitted from the queue reuses the longest
      cached prefix of full blocks (never the whole prompt: the last token is recomputed).
    - When a running request needs a block and none is free, the lowest-priority running
      request (FCFS: the last admitted) is preempted: its blocks are freed, it goes back to
      the front of the queue and is recomputed later. No admissions in a step that preempted.
    """

    def __init__(self, config: EngineConfig, cache: PrefixCache) -> None:
        self.cfg = config
        self.cache = cache
        self.bs = config.block_size
        self.caching = config.enable_prefix_caching
        self.running: list[Sequence] = []
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.by_priority = config.scheduling_policy == "priority"
        # vLLM's long_prefill_token_threshold: no request gets more prompt tokens in one step
        cap = config.effective_long_prefill_token_threshold
        self.chunk_cap = cap or config.max_num_batched_tokens
        self.lora: LoraState | None = None  # set by the engine when LoRA is on

    def schedule(self) -> Batch:
        batch = Batch()
        items = batch.items
        budget = self.cfg.max_num_batched_tokens
        bs, caching, running_ = self.bs, self.caching, Status.RUNNING
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not running_:
                continue  # preempted earlier in this step
            nc = seq.num_computed
            n = min(seq.prompt_len + len(seq.output) - nc, budget, self.chunk_cap)
            if n == 1 and nc < len(seq.blocks) * bs:  # the common decode step: no new block
                if caching and (nc + 1) % bs == 0:
                    self._register(seq, nc + 1)
                items[seq] = 1
                budget -= 1
                continue
            while not self.grow(seq, n):
                victim = self._victim()
                self.preempt(victim)
                batch.preempted.append(victim)
                budget += items.pop(victim, 0)
                if victim is seq:
                    break
            else:
                items[seq] = n
                budget -= n
        if not batch.preempted:
            self._admit(batch, budget)
        return batch

    def _admit(self, batch: Batch, budget: int) -> None:
        cache, bs, running, waiting = self.cache, self.bs, self.running, self.waiting
        lora, skipped = self.lora, []
        active = lora.adapters_of(running) if lora is not None else set()
        while budget > 0 and len(running) < self.cfg.max_num_seqs:
            seq = waiting.peek()
            if seq is None:
                break
            if lora is not None and not lora.admissible(seq.id, active):
                skipped.append(waiting.pop())  # one adapter too many: the next may fit
                continue
            if seq.blocks:  # P/D decode: the blocks and the KV came from a prefill replica
                waiting.pop()
                n = min(seq.num_tokens - seq.num_computed, budget, self.chunk_cap)
                self._register(seq, seq.num_computed + n)
                seq.status = Status.RUNNING
                running.append(seq)
                batch.items[seq] = n
                batch.admitted.append(seq)
                budget -= n
                continue
            hit: list[int] = []
            if self.caching:
                limit = (seq.num_tokens - 1) // bs
                self.ensure_hashes(seq, limit)
                hit = cache.cached_blocks(seq.hashes[:cache.longest_prefix(seq.hashes, limit)])
            computed = len(hit) * bs
            n = min(seq.num_tokens - computed, budget, self.chunk_cap)
            need = -(-(computed + n) // bs) - len(hit)
            if cache.num_free - cache.count_free_among(hit) < need:
                break
            cache.acquire(hit)
            fresh = cache.allocate(need)
            assert fresh is not None
            waiting.pop()
            seq.blocks = hit + fresh
            seq.num_computed = computed
            seq.n_registered = len(hit)
            self._register(seq, computed + n)
            seq.status = Status.RUNNING
            running.append(seq)
            batch.items[seq] = n
            batch.admitted.append(seq)
            budget -= n
            if lora is not None and (a := lora.adapter_of.get(seq.id)) is not None:
                active.add(a)
        for seq in reversed(skipped):
            waiting.push(seq, front=True)

    def grow(self, seq: Sequence, n: int) -> bool:
        """Give `seq` blocks for `n` more tokens; False when the cache has none left."""
        need = -(-(seq.num_computed + n) // self.bs) - len(seq.blocks)
        if need > 0:
            fresh = self.cache.allocate(need)
            if fresh is None:
                return False
            seq.blocks.extend(fresh)
        self._register(seq, seq.num_computed + n)
        return True

    def _register(self, seq: Sequence, upto_tokens: int) -> None:
        """Offer the full blocks this step completes to the prefix cache."""
        if not self.caching:
            return
        full = upto_tokens // self.bs
        if full <= seq.n_registered:
            return
        self.ensure_hashes(seq, full)
        cache = self.cache
        blocks, hashes, start = seq.blocks, seq.hashes, seq.n_registered
        seq.n_registered = full
        events = cache.events
        if events is None:
            for i in range(start, full):
                cache.register(blocks[i], hashes[i])
            return
        run = -1  # first block of the run of newly cached blocks, one event per run
        for i in range(start, full):
            if cache.register(blocks[i], hashes[i]):
                if run < 0:
                    run = i
            elif run >= 0:
                self._stored(events, seq, run, i)
                run = -1
        if run >= 0:
            self._stored(events, seq, run, full)

    def _stored(self, events: list[tuple[Any, ...]], seq: Sequence, lo: int, hi: int) -> None:
        bs, hashes = self.bs, seq.hashes
        events.append(("stored", hashes[lo:hi], hashes[lo - 1] if lo else None,
                       seq.tokens(lo * bs, hi * bs)))  # fmt: skip

    def ensure_hashes(self, seq: Sequence, n_blocks: int) -> None:
        have = len(seq.hashes)
        if have >= n_blocks:
            return
        bs = self.bs
        parent = seq.hashes[-1] if have else seq.salt
        seq.hashes.extend(block_hashes(seq.tokens(have * bs, n_blocks * bs), bs, parent=parent))

    def _victim(self) -> Sequence:
        if self.by_priority:
            return max(self.running, key=lambda s: (s.priority, s.arrival_s, s.order))
        return self.running[-1]

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.release(seq.blocks)
        seq.blocks = []
        seq.num_computed = 0
        seq.n_registered = 0
        seq.preemptions += 1
        seq.status = Status.WAITING
        self.waiting.push(seq, front=True)

    def drop(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the engine and free its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.cache.release(seq.blocks)
            seq.blocks = []
        elif seq.status is Status.WAITING:
            self.waiting.discard(seq)
            if seq.blocks:  # a P/D decode request's pulled KV, not yet scheduled
                self.cache.release(seq.blocks)
                seq.blocks = []
