"""Discrete-event mode: the same engines in virtual time, no HTTP and no wall clock.

`await run(requests, Cluster(8, ...), router)` replays a trace through a routing policy.
"""

from __future__ import annotations

import gc
import heapq
import inspect
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from simulator.config import EngineConfig, build_config
from simulator.engine import Engine
from simulator.kv_cache import PromptHasher, salt_seed
from simulator.lora import lora_salt
from simulator.perf_model import jitter_factor
from simulator.profiles import GpuProfile, ModelProfile
from simulator.results import RequestRecord, RunResult
from simulator.tokenizer import ByteTokenizer, Tokenizer


@dataclass(slots=True)
class SimRequest:
    id: str
    arrival_s: float
    prompt_tokens: Sequence[int]
    max_tokens: int
    priority: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica as a `/metrics` scrape taken at `scraped_at_s` shows it."""

    index: int
    waiting: int
    running: int
    kv_usage: float
    scraped_at_s: float


class ChatItem(Protocol):
    """A chat workload entry (as `simulator.workloads` makes them)."""

    @property
    def arrival_s(self) -> float: ...
    @property
    def messages(self) -> Sequence[Mapping[str, Any]]: ...
    @property
    def max_tokens(self) -> int: ...


def chat_requests(items: Iterable[ChatItem], tokenizer: Tokenizer | None = None,
                  ) -> list[SimRequest]:
    """Chat workload entries as SimRequests: messages rendered and tokenized the way a
    replica's HTTP endpoint would (`meta["item"]` keeps the entry)."""
    tok = tokenizer or ByteTokenizer()
    return [SimRequest(f"req-{i}", it.arrival_s, tok.encode_chat(it.messages),
                       it.max_tokens, meta={"item": it}) for i, it in enumerate(items)]


class Router(Protocol):
    """Picks a replica index. `on_first_token(req, replica, t)` and
    `on_finish(req, replica, record)` are optional and called when defined."""

    def route(self, req: SimRequest, view: Sequence[ReplicaLoad]) -> int | Awaitable[int]: ...


class RoundRobin:
    """The simplest router: replicas in turn, starting at 0."""

    def __init__(self) -> None:
        self.i = -1

    def route(self, req: SimRequest, view: Sequence[ReplicaLoad]) -> int:
        self.i += 1
        return self.i % len(view)


class Cluster:
    """`n_replicas` engines of one configuration; engine i is seeded `seed + i`."""

    def __init__(self, n_replicas: int, model: str | ModelProfile = "qwen2.5-14b",
                 gpu: str | GpuProfile = "a100-80g", seed: int = 0, **engine_overrides: Any):
        if n_replicas < 1:
            raise ValueError("a cluster needs at least one replica")
        self.config: EngineConfig = build_config(model, gpu, **engine_overrides)
        self.hasher = PromptHasher(self.config.block_size)
        self.engines = [Engine(self.config, seed=seed + i, hasher=self.hasher)
                        for i in range(n_replicas)]

    def loads(self, t: float) -> list[ReplicaLoad]:
        """What a scrape at virtual time `t` reads from each engine."""
        out = []
        for i, e in enumerate(self.engines):
            e.sync(t)
            out.append(ReplicaLoad(i, e.num_waiting, e.num_running, e.kv_usage, t))
        return out


@dataclass(slots=True)
class ClosedLoop:
    """`users` closed-loop clients: each sends a request, waits for its last token, thinks
    `think_time_s`, sends the next, as a benchmark with N concurrent clients does.

    `next_request(user, k)` gives user `user`'s `k`-th request (its `arrival_s` is set when
    it is sent), or None when that user is done. All users send their first request at
    `start_s` + `user x stagger_s`.
    """

    users: int
    next_request: Callable[[int, int], SimRequest | None]
    think_time_s: float = 0.0
    start_s: float = 0.0
    stagger_s: float = 0.0

    def __post_init__(self) -> None:
        if self.users < 1:
            raise ValueError("a closed loop needs at least one user")
        if self.think_time_s < 0 or self.stagger_s < 0:
            raise ValueError("think time and stagger must be >= 0")


def fixed_length_users(users: int, prompt_tokens: int, output_tokens: int, *,
                       requests_per_user: int, seed: int = 0, think_time_s: float = 0.0,
                       vocab: tuple[int, int] = (16, 100_000)) -> ClosedLoop:
    """The benchmark clients of `vllm bench serve --max-concurrency N` on random data: every
    request a fresh random prompt of `prompt_tokens` tokens (no shared prefix) and exactly
    `output_tokens` tokens out."""
    import random

    lo, hi = vocab
    span = hi - lo

    def make(user: int, k: int) -> SimRequest | None:
        if k >= requests_per_user:
            return None
        rng = random.Random(seed * 1_000_003 + user * 10_007 + k)
        # one draw of random bytes for the whole prompt: a randrange per token was a fifth of
        # the fidelity replay's time (ids only need to be random, and in the vocabulary)
        words = memoryview(rng.randbytes(4 * prompt_tokens)).cast("I")
        prompt = [lo + w % span for w in words]
        return SimRequest(f"u{user}-{k}", 0.0, prompt, output_tokens)

    return ClosedLoop(users, make, think_time_s=think_time_s)


async def run(requests: Iterable[SimRequest] | ClosedLoop, cluster: Cluster, router: Router, *,
              scrape_interval_s: float = 1.0, fuse_decode: bool = True) -> RunResult:
    """Replay `requests` (open loop) or drive a `ClosedLoop` of clients through `router` onto
    `cluster`; deterministic for a given input.

    The router sees loads as of the last scrape (every `scrape_interval_s` virtual seconds;
    0 means live). A routed request reaches its engine after the engine profile's request
    latency (API server, tokenisation); its TTFT counts from its arrival. At equal times
    arrivals go before step completions. `fuse_decode` prices stretches of pure decode at
    once (same result, much faster); off, every step is an event. Records come in arrival
    order (closed loop: in the order requests were sent).
    """
    if isinstance(requests, ClosedLoop):
        loop: ClosedLoop | None = requests
        reqs: list[SimRequest] = []
    else:
        loop = None
        reqs = sorted(requests, key=lambda r: r.arrival_s)
    # A trace holds millions of token ids in long-lived lists; exempt everything that exists
    # now from the cyclic GC, or full collections re-scan them again and again.
    gc.freeze()
    try:
        return await _run(reqs, loop, cluster, router, scrape_interval_s, fuse_decode)
    finally:
        gc.unfreeze()


class StepEnds:
    """The engines' running steps by end time. A fused run cut short (a newcomer joined) is
    pushed again; its older entry is stale and skipped."""

    def __init__(self, engines: Sequence[Engine]) -> None:
        self._engines = engines
        self._heap: list[tuple[float, int, int]] = []  # (step end, push number, engine)
        self._current = [0] * len(engines)  # each engine's live push number
        self._pushes = 0

    def __bool__(self) -> bool:
        return bool(self._heap)

    def push(self, i: int) -> None:
        """Engine `i`'s step in flight, if any, ends when it says."""
        step = self._engines[i].in_flight
        if step is not None:
            self._pushes += 1
            self._current[i] = self._pushes
            heapq.heappush(self._heap, (step.end_s, self._pushes, i))

    def next_s(self) -> float:
        """When the next live step ends (inf: none runs)."""
        heap = self._heap
        while heap and heap[0][1] != self._current[heap[0][2]]:
            heapq.heappop(heap)
        return heap[0][0] if heap else math.inf

    def pop(self) -> int:
        """The engine whose step ends next (after `next_s`)."""
        return heapq.heappop(self._heap)[2]


async def _run(reqs: list[SimRequest], loop: ClosedLoop | None, cluster: Cluster,
               router: Router, scrape_interval_s: float, fuse: bool) -> RunResult:
    engines = cluster.engines
    n = len(engines)
    first_cb: Callable[..., Any] | None = getattr(router, "on_first_token", None)
    finish_cb: Callable[..., Any] | None = getattr(router, "on_finish", None)
    ends = StepEnds(engines)
    push = ends.push
    records: dict[int, RequestRecord] = {}
    # arrivals (kind 0: at the router) and entries (kind 1: at an engine), by time then order
    events: list[tuple[float, int, int, int, SimRequest]] = []
    order: dict[int, int] = {}
    latency = [e.perf.request_latency_s for e in engines]
    request_cv = [e.perf.engine.request_jitter_cv for e in engines]
    view = cluster.loads(0.0)
    next_scrape = scrape_interval_s
    issued = 0
    sent: dict[int, int] = {}  # closed loop: requests each user has sent

    def arrive(req: SimRequest) -> None:
        nonlocal issued
        order[id(req)] = issued
        heapq.heappush(events, (req.arrival_s, issued, 0, -1, req))
        issued += 1

    def send(user: int, t: float) -> None:
        assert loop is not None
        k = sent.get(user, 0)
        req = loop.next_request(user, k)
        if req is None:
            return
        sent[user] = k + 1
        req.arrival_s = t
        req.meta["user"] = user
        arrive(req)

    for req in reqs:
        arrive(req)
    if loop is not None:
        for u in range(loop.users):
            send(u, loop.start_s + u * loop.stagger_s)

    def start(i: int, t: float) -> None:
        engines[i].begin_step(t, fuse=fuse)
        push(i)

    while events or ends:
        t_event = events[0][0] if events else math.inf
        t = min(t_event, ends.next_s())
        if scrape_interval_s > 0 and t >= next_scrape:
            at = math.floor(t / scrape_interval_s) * scrape_interval_s
            view = cluster.loads(at)
            next_scrape = at + scrape_interval_s
        if t_event <= t:
            _, k, kind, choice, req = heapq.heappop(events)
            if kind == 0:
                for e in engines:
                    e.sync_at = t
                routed = router.route(req, view if scrape_interval_s > 0 else cluster.loads(t))
                if inspect.isawaitable(routed):
                    routed = await routed
                if not isinstance(routed, int) or not 0 <= routed < n:
                    raise ValueError(f"router returned {routed!r} for {req.id}; want 0..{n - 1}")
                delay = latency[routed](len(req.prompt_tokens))
                if delay > 0 and request_cv[routed]:
                    delay *= jitter_factor(engines[routed].seed + 7919, k, request_cv[routed])
                if delay > 0:
                    heapq.heappush(events, (t + delay, k, 1, routed, req))
                    continue
                choice = routed
            engine = engines[choice]
            if engine.in_flight is not None and engine.in_flight.ends:
                engine.sync(t)
                engine.truncate()  # the newcomer may join after the current step
                push(choice)
            adapter = req.meta.get("lora")  # the LoRA adapter the request names, if any
            if adapter is not None and engine.lora is not None:
                engine.lora.assign(req.id, adapter)
            salt = lora_salt(adapter, None)
            seq = engine.add_request(req.id, req.prompt_tokens, arrival_s=t,
                                     max_tokens=req.max_tokens, priority=req.priority,
                                     cache_salt=salt,
                                     hashes=cluster.hasher(req.prompt_tokens, salt_seed(salt)))
            seq.user = req
            if engine.in_flight is None:
                start(choice, t)
            continue
        i = ends.pop()
        result = engines[i].end_step()
        for seq in result.emitted:
            if first_cb is not None and seq.last_itl is None:
                await _maybe(first_cb(seq.user, i, t))
        for seq in result.finished:
            req = seq.user
            rec = RequestRecord(seq.id, i, req.arrival_s, seq.first_token_s or t, t,
                                seq.prompt_len, seq.cached_tokens, len(seq.output),
                                seq.preemptions, seq.priority)
            records[order[id(req)]] = rec
            if finish_cb is not None:
                await _maybe(finish_cb(req, i, rec))
            if loop is not None:
                send(req.meta["user"], t + loop.think_time_s)
        if engines[i].has_work:
            start(i, t)
    return RunResult([records[j] for j in range(issued)], [e.counters.busy_time_s for e in engines])


async def _maybe(value: Any) -> None:
    if inspect.isawaitable(value):
        await value
