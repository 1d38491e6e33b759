"""The engine model: requests in, steps out, in simulated time and with no clock of its own.

`begin_step(now)` schedules and prices a step; `end_step()` applies it at `now + duration`.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace

from simulator import decode_runs
from simulator.config import EngineConfig
from simulator.kv_cache import PrefixCache, PromptHasher, salt_seed
from simulator.lora import LoraState
from simulator.perf_model import jitter_factor
from simulator.scheduler import Scheduler
from simulator.sequence import Sequence, Status
from simulator.stats import EngineCounters
from simulator.tiers import Tiers

DEFAULT_FILLER = tuple(range(1000, 1064))


@dataclass(slots=True)
class Step:
    """One engine step; or, in the discrete-event mode, a fused run of pure-decode steps
    whose durations and end times are `durations` / `ends` (this step is their first)."""

    start_s: float
    duration_s: float
    items: dict[Sequence, int]
    preempted: list[Sequence]
    admitted: list[Sequence]
    prefill_tokens: int = 0
    decode_seqs: int = 0
    durations: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)

    @property
    def end_s(self) -> float:
        return self.ends[-1] if self.ends else self.start_s + self.duration_s


@dataclass(slots=True)
class StepResult:
    end_s: float
    emitted: list[Sequence] = field(default_factory=list)  # got one token this step
    finished: list[Sequence] = field(default_factory=list)


class Engine:
    """One replica's engine: a prefix cache, a scheduler and the performance model."""

    def __init__(self, config: EngineConfig, *, seed: int = 0,
                 filler_ids: Seq[int] = DEFAULT_FILLER, hasher: PromptHasher | None = None,
                 ) -> None:
        self.config = config
        self.hasher = hasher or PromptHasher(config.block_size)
        self.perf = config.perf
        self.cache = PrefixCache(config.num_blocks, config.block_size,
                                 enable_prefix_caching=config.enable_prefix_caching)
        if config.cpu_kv_gb > 0:  # a host-memory KV tier (simulator/tiers.py)
            bpt = config.perf.kv_bytes_per_token
            self.cache.tiers = Tiers(int(config.cpu_kv_gb * 1e9 / (bpt * config.block_size)),
                                     block_size=config.block_size, bytes_per_token=bpt,
                                     host_gbps=config.cpu_kv_gbps)
        self.scheduler = Scheduler(config, self.cache)
        self.lora = self.scheduler.lora = LoraState(config.lora) if config.lora else None
        self.counters = EngineCounters()
        self.rng = random.Random(seed)
        self.seed = seed
        self.step_no = 0  # steps applied so far: the key of each step's seeded jitter
        self.filler = tuple(filler_ids)
        self._filler_at: dict[int, int] | None = None  # filler id -> its place (greedy_base)
        self.requests: dict[str, Sequence] = {}
        self.in_flight: Step | None = None
        self.now_s = 0.0
        self.sync_at: float | None = None  # discrete-event time; readers catch a run up to it
        self._order = 0
        # P/D (simulator/pd.py): requests whose blocks a prefill replica keeps when they
        # finish, and the blocks so kept (request id -> blocks) until the decode side reads them
        self.hold_ids: set[str] = set()
        self.held: dict[str, list[int]] = {}

    # -- state ----------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_usage(self) -> float:
        self._catch_up()
        return self.cache.usage

    def _catch_up(self) -> None:
        if self.sync_at is not None:
            self.sync(self.sync_at)

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.running) or len(self.scheduler.waiting) > 0

    def prompt_hashes(self, token_ids: Seq[int], cache_salt: str | None = None) -> list[int]:
        return self.hasher(token_ids, salt_seed(cache_salt))

    def cached_prefix_tokens(self, token_ids: Seq[int], *, hashes: Seq[int] | None = None,
                             cache_salt: str | None = None) -> int:
        """Tokens of this prompt that a request admitted now would find in the prefix cache."""
        if not self.config.enable_prefix_caching or not token_ids:
            return 0
        self._catch_up()
        if hashes is None:
            hashes = self.prompt_hashes(token_ids, cache_salt)
        limit = (len(token_ids) - 1) // self.config.block_size
        return self.cache.longest_prefix(hashes, limit) * self.config.block_size

    # -- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Seq[int], *, arrival_s: float,
                    max_tokens: int | None = None, priority: int = 0,
                    cache_salt: str | None = None, hashes: Seq[int] | None = None,
                    greedy: bool = False) -> Sequence:
        """Queue a request. Without `max_tokens` its length comes from the configured
        output-length distribution; either way it is capped by max_model_len."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        room = self.config.max_model_len - len(prompt)
        if room < 1 or not prompt:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit max_model_len="
                             f"{self.config.max_model_len} (and must not be empty)")
        by_length = max_tokens is not None
        target = max_tokens if max_tokens is not None else \
            self.config.output_lengths.sample(self.rng)
        self._order += 1
        seq = Sequence(request_id, self._order, prompt, target_out=max(1, min(target, room)),
                       stop_at_length=by_length, arrival_s=arrival_s, priority=priority,
                       salt=salt_seed(cache_salt),
                       out_base=self.greedy_base(prompt) if greedy else
                       self.rng.randrange(len(self.filler)))
        if hashes is not None and self.config.enable_prefix_caching:
            seq.hashes = list(hashes)
        self.requests[request_id] = seq
        self.scheduler.waiting.push(seq)
        self.counters.requests_received += 1
        return seq

    def greedy_base(self, prompt: Seq[int]) -> int:
        """Where a greedy answer starts in the filler: after the prompt's last token when that is
        a filler word, so an answer is a function of its context alone and a prompt that ends
        with an answer's first k tokens goes on with its token k (any replica, any seed)."""
        nf = len(self.filler)
        if self._filler_at is None:
            self._filler_at = {t: i for i, t in enumerate(self.filler)}
        last = prompt[-1]
        at = self._filler_at.get(last)
        return (at + 1) % nf if at is not None else last % nf

    def abort(self, request_id: str) -> bool:
        """Drop a request (client went away); its blocks are freed at once."""
        self.hold_ids.discard(request_id)
        seq = self.requests.pop(request_id, None)
        if seq is None or seq.finished:
            return False
        self.scheduler.drop(seq)
        seq.status = Status.ABORTED
        if self.lora is not None:
            self.lora.release(request_id)
            self.lora.touch_metric(self.requests, self.now_s)
        self.counters.requests_aborted += 1
        return True

    def release_held(self, request_id: str) -> bool:
        """Free the blocks a finished P/D prefill kept for its decode replica."""
        blocks = self.held.pop(request_id, None)
        if blocks is None:
            return False
        self.cache.release(blocks)
        return True

    # -- steps ----------------------------------------------------------------------------
    def begin_step(self, now: float, *, fuse: bool = False) -> Step | None:
        """Schedule the next step starting at `now`; None when there is nothing to run.

        With `fuse` (discrete-event mode only) a pure-decode step is extended into a run of
        steps that ends at the first finish; `sync` and `truncate` cut it short when
        something happens to the engine meanwhile.
        """
        if self.in_flight is not None:
            raise RuntimeError("a step is already in flight")
        self.now_s = max(self.now_s, now)
        batch = self.scheduler.schedule()
        while not batch.items and batch.preempted:
            # everything running was preempted: the next pass re-admits from the queue
            self.counters.preemptions += len(batch.preempted)
            batch = self.scheduler.schedule()
        c = self.counters
        c.preemptions += len(batch.preempted)
        for seq in batch.admitted:
            c.prefix_queries += seq.num_tokens
            c.prefix_hits += seq.num_computed
            if not seq.admitted:
                seq.admitted = True
                seq.cached_tokens = seq.num_computed
                seq.scheduled_s = self.now_s
                c.prompt_tokens += seq.prompt_len
                c.cached_prompt_tokens += seq.num_computed
        if not batch.items:
            return None
        perf = self.perf
        prefill_tokens = n_decode = kv_tokens = 0
        attention_s = 0.0
        attention = perf.prefill_attention
        for seq, n in batch.items.items():
            nc = seq.num_computed
            if n == 1 and nc >= seq.prompt_len:
                n_decode += 1
                kv_tokens += nc + 1
            else:
                prefill_tokens += n
                if attention:
                    attention_s += perf.attention_s(n, nc)
        duration = perf.step_time(prefill_tokens, n_decode, kv_tokens, attention_s)
        if perf.jitter:
            duration *= jitter_factor(self.seed, self.step_no, perf.jitter)
        if self.cache.tiers is not None:  # prefixes loaded from a lower tier stall the step
            duration += self.cache.tiers.take_load_s()
        if self.lora is not None and batch.admitted:  # adapter loads stall the step
            duration += self._lora_loads(batch.admitted, batch.items)
        step = Step(self.now_s, duration, batch.items, batch.preempted, batch.admitted,
                    prefill_tokens, n_decode)
        if fuse and n_decode == len(batch.items) == self.num_running and not batch.admitted:
            step = self._plan_run(step, kv_tokens)
        self.in_flight = step
        return step

    def _lora_loads(self, admitted: list[Sequence], items: dict[Sequence, int]) -> float:
        lora = self.lora
        assert lora is not None
        of = lora.adapter_of
        stall = lora.activate([a for s in admitted if (a := of.get(s.id)) is not None],
                              lora.adapters_of(items))
        lora.touch_metric(self.requests, self.now_s)
        return stall

    def _plan_run(self, step: Step, kv_tokens: int) -> Step:
        """Extend a scheduled pure-decode `step` into a run, or return it unchanged.

        No run while a request could be admitted (the queue must be empty or the batch full);
        `decode_runs.run_length` says where else it must stop.
        """
        running = self.scheduler.running
        if len(self.scheduler.waiting) and len(running) < self.config.max_num_seqs:
            return step
        k = decode_runs.run_length(running, self.cache.num_free, self.config.block_size)
        if k < 2:
            return step
        durations, ends = decode_runs.run_times(self.perf, step.start_s, step.duration_s,
                                                len(running), kv_tokens, k,
                                                seed=self.seed, step_no=self.step_no)
        return replace(step, durations=durations, ends=ends)

    def _apply_run(self, step: Step, j: int) -> Step:
        """Apply the first `j` steps of a run; return the rest, whose first step then begins."""
        if j <= 0:
            return step
        filler, nf = self.filler, len(self.filler)
        ends, durations = step.ends, step.durations
        t = ends[j - 1]
        prev_end = ends[j - 2] if j >= 2 else None
        grow = self.scheduler.grow
        for seq in step.items:
            out = seq.output
            k0 = len(out)
            base = seq.out_base
            out.extend([filler[(base + k) % nf] for k in range(k0, k0 + j)])
            seq.num_computed += j
            seq.last_itl = t - (prev_end if prev_end is not None else seq.last_token_s)  # type: ignore[operator]
            seq.last_token_s = t
            grow(seq, 1)  # what the next step's scheduling allocates and registers
        c = self.counters
        c.steps += j
        self.step_no += j
        for d in durations[:j]:
            c.busy_time_s += d
        c.generation_tokens += j * len(step.items)
        self.now_s = t
        rest_d, rest_e = durations[j:], ends[j:]
        if len(rest_e) == 1:
            rest_d, rest_e = [], []
        return replace(step, start_s=t, duration_s=durations[j], durations=rest_d, ends=rest_e)

    def sync(self, t: float) -> None:
        """Apply the fused steps that end before `t` (the state a step-by-step run has)."""
        step = self.in_flight
        if step is not None and step.ends:
            j = min(bisect.bisect_left(step.ends, t), len(step.ends) - 1)
            if j > 0:
                self.in_flight = self._apply_run(step, j)

    def truncate(self) -> None:
        """End a fused run after its current step (a request arrived)."""
        step = self.in_flight
        if step is not None and step.ends:
            step.durations, step.ends = [], []

    def end_step(self) -> StepResult:
        """Apply the step in flight: KV computed, one token per caught-up sequence."""
        step = self.in_flight
        if step is None:
            raise RuntimeError("no step in flight")
        if step.ends:
            step = self._apply_run(step, len(step.ends) - 1)
        self.in_flight = None
        t = self.now_s = step.end_s
        c = self.counters
        c.steps += 1
        self.step_no += 1
        c.busy_time_s += step.duration_s
        result = StepResult(t)
        emitted, finished = result.emitted, result.finished
        filler, nf, running_ = self.filler, len(self.filler), Status.RUNNING
        for seq, n in step.items.items():
            if seq.status is not running_:
                continue  # aborted while the step ran
            nc = seq.num_computed = seq.num_computed + n
            out = seq.output
            k = len(out)
            if nc < seq.prompt_len + k:
                continue  # a prefill chunk, not the last one
            out.append(filler[(seq.out_base + k) % nf])
            if k == 0:
                seq.first_token_s = t
                seq.last_itl = None
            else:
                seq.last_itl = t - seq.last_token_s  # type: ignore[operator]
            seq.last_token_s = t
            emitted.append(seq)
            if k + 1 >= seq.target_out:
                finished.append(seq)
        for seq in finished:
            self._finish(seq, t)
        c.generation_tokens += len(result.emitted)
        return result

    def _finish(self, seq: Sequence, t: float) -> None:
        if seq.id in self.hold_ids:  # P/D prefill: the blocks stay pinned for the decode side
            self.hold_ids.discard(seq.id)
            self.held[seq.id], seq.blocks = seq.blocks, []
        self.scheduler.drop(seq)
        seq.status = Status.FINISHED
        seq.finish_s = t
        self.requests.pop(seq.id, None)
        if self.lora is not None:
            self.lora.release(seq.id)
            self.lora.touch_metric(self.requests, t)
        c = self.counters
        c.requests_served += 1
        if seq.stop_at_length:
            c.finished_length += 1
        else:
            c.finished_stop += 1
