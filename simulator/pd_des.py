"""Discrete-event mode for disaggregated fleets: x prefill + y decode engines and the KV link.

`await run_pd(requests, PdCluster(2, 6, ...), prefill_router, pick_decode)`. A request goes to
a prefill engine chosen by `prefill_router` (a `simulator.des.Router` over the prefill engines),
runs its prefill and one token there; its blocks stay held. Then `pick_decode` chooses a decode
engine, which reserves the prompt's blocks (locally cached blocks are not pulled; when nothing
fits the transfer waits for the next decode step to free some), the KV crosses the decode
engine's link (`kv_link_gbps`; transfers into one decode engine queue on its link), the prefill
engine frees its blocks and the decode engine decodes; its steps never carry a prefill (only the
last prompt token is computed there). TTFT counts from arrival to the decode engine's first
token (P's token is not the client's), TPOT from the decode engine's tokens.
"""

from __future__ import annotations

import heapq
import inspect
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from simulator.config import EngineConfig, build_config
from simulator.des import ReplicaLoad, Router, SimRequest, StepEnds
from simulator.engine import Engine
from simulator.kv_cache import PromptHasher
from simulator.pd_kv import adopt, reserve_blocks, transfer_seconds
from simulator.profiles import GpuProfile, ModelProfile
from simulator.results import RequestRecord, RunResult

DecodePicker = Callable[[SimRequest, Sequence[ReplicaLoad], Sequence[Engine]], int]


def least_loaded_decode(req: SimRequest, view: Sequence[ReplicaLoad],
                        engines: Sequence[Engine]) -> int:
    """The decode engine with room for the prompt and the fewest sequences, then most free KV."""
    bs = engines[0].config.block_size
    need = -(-(len(req.prompt_tokens) + req.max_tokens) // bs)
    return min(range(len(engines)), key=lambda i: (
        engines[i].cache.num_free < need, view[i].running + view[i].waiting,
        -engines[i].cache.num_free, i))


class PdCluster:
    """`n_prefill` + `n_decode` engines of one model and GPU (prefill engines first)."""

    def __init__(self, n_prefill: int, n_decode: int, model: str | ModelProfile = "qwen2.5-14b",
                 gpu: str | GpuProfile = "a100-80g", seed: int = 0, *,
                 kv_link_gbps: float = 400.0, decode_overrides: dict[str, Any] | None = None,
                 **engine_overrides: Any) -> None:
        if n_prefill < 1 or n_decode < 1:
            raise ValueError("a P/D cluster needs at least one prefill and one decode engine")
        self.config: EngineConfig = build_config(model, gpu, **engine_overrides)
        self.decode_config = build_config(model, gpu, **{**engine_overrides,
                                                         **(decode_overrides or {})})
        self.hasher = PromptHasher(self.config.block_size)
        self.prefill = [Engine(self.config, seed=seed + i, hasher=self.hasher)
                        for i in range(n_prefill)]
        self.decode = [Engine(self.decode_config, seed=seed + n_prefill + i, hasher=self.hasher)
                       for i in range(n_decode)]
        self.kv_link_gbps = kv_link_gbps

    @property
    def engines(self) -> list[Engine]:
        return self.prefill + self.decode

    @staticmethod
    def loads(engines: Sequence[Engine], t: float) -> list[ReplicaLoad]:
        out = []
        for i, e in enumerate(engines):
            e.sync(t)
            out.append(ReplicaLoad(i, e.num_waiting, e.num_running, e.kv_usage, t))
        return out


async def _maybe(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def run_pd(requests: Iterable[SimRequest], cluster: PdCluster, prefill_router: Router,
                 pick_decode: DecodePicker = least_loaded_decode, *,
                 fuse_decode: bool = True) -> RunResult:
    """Replay `requests` (open loop) through a P/D cluster; deterministic for a given input.
    Records carry the decode engine's index (prefill engines are 0..x-1, decode x..x+y-1)."""
    reqs = sorted(requests, key=lambda r: r.arrival_s)
    engines = cluster.engines
    n_p = len(cluster.prefill)
    first_cb = getattr(prefill_router, "on_first_token", None)
    finish_cb = getattr(prefill_router, "on_finish", None)
    ends = StepEnds(engines)
    push = ends.push
    # (time, order, kind, engine, request): 0 arrival, 1 at a prefill engine, 2 KV landed on D
    events: list[tuple[float, int, int, int, SimRequest]] = []
    order = {id(r): k for k, r in enumerate(reqs)}
    for k, r in enumerate(reqs):
        heapq.heappush(events, (r.arrival_s, k, 0, -1, r))
    records: dict[int, RequestRecord] = {}
    link_free = [0.0] * len(cluster.decode)
    waiting_room: list[list[tuple[SimRequest, int]]] = [[] for _ in cluster.decode]
    kv_per_token = cluster.config.perf.kv_bytes_per_token
    xfer: dict[str, tuple[list[int], int, int, float]] = {}  # id -> blocks, hit, P engine, s
    cached: dict[str, int] = {}

    def kick(i: int, t: float) -> None:
        e = engines[i]
        if e.in_flight is not None and e.in_flight.ends:
            e.sync(t)
            e.truncate()
            push(i)
        elif e.in_flight is None:
            e.begin_step(t, fuse=fuse_decode)
            push(i)

    def start_transfer(req: SimRequest, d: int, p: int, t: float) -> bool:
        eng = cluster.decode[d]
        got = reserve_blocks(eng, len(req.prompt_tokens), req.meta["hashes"])
        if got is None:
            return False
        blocks, hit = got
        tokens = max(0, len(req.prompt_tokens) - hit * eng.config.block_size)
        begin = max(t, link_free[d])
        secs = transfer_seconds(tokens, kv_per_token, cluster.kv_link_gbps)
        link_free[d] = begin + secs
        xfer[req.id] = (blocks, hit, p, secs)
        heapq.heappush(events, (begin + secs, order[id(req)], 2, n_p + d, req))
        return True

    while events or ends:
        t_event = events[0][0] if events else math.inf
        t = min(t_event, ends.next_s())
        if t_event <= t:
            _, k, kind, i, req = heapq.heappop(events)
            if kind == 0:
                view = cluster.loads(cluster.prefill, t)
                p = await _maybe(prefill_router.route(req, view))
                if not isinstance(p, int) or not 0 <= p < n_p:
                    raise ValueError(f"prefill router returned {p!r}; want 0..{n_p - 1}")
                delay = cluster.prefill[p].perf.request_latency_s(len(req.prompt_tokens))
                heapq.heappush(events, (t + delay, k, 1, p, req))
                continue
            e = engines[i]
            if kind == 1:
                req.meta["hashes"] = hashes = cluster.hasher(req.prompt_tokens, 0)
                seq = e.add_request(req.id, req.prompt_tokens, arrival_s=t, max_tokens=1,
                                    hashes=hashes)
                e.hold_ids.add(req.id)
            else:
                blocks, hit, p, _ = xfer.pop(req.id)
                cluster.prefill[p].release_held(req.id)  # D's read notification
                seq = e.add_request(req.id, req.prompt_tokens, arrival_s=req.arrival_s,
                                    max_tokens=req.max_tokens, hashes=req.meta["hashes"])
                adopt(seq, blocks, hit)
            seq.user = req
            kick(i, t)
            continue
        i = ends.pop()
        e = engines[i]
        result = e.end_step()
        if i < n_p:
            for seq in result.finished:
                req = seq.user
                cached[req.id] = seq.cached_tokens
                if first_cb is not None:
                    await _maybe(first_cb(req, i, t))
                if finish_cb is not None:
                    rec = RequestRecord(req.id, i, req.arrival_s, t, t, seq.prompt_len,
                                        seq.cached_tokens, 1, seq.preemptions)
                    await _maybe(finish_cb(req, i, rec))
                dview = cluster.loads(cluster.decode, t)
                d = pick_decode(req, dview, cluster.decode)
                if not start_transfer(req, d, i, t):
                    waiting_room[d].append((req, i))
        else:
            d = i - n_p
            for seq in result.finished:
                req = seq.user
                records[order[id(req)]] = RequestRecord(
                    seq.id, i, req.arrival_s, seq.first_token_s or t, t, seq.prompt_len,
                    cached.pop(req.id, 0), len(seq.output), seq.preemptions, seq.priority)
            room = waiting_room[d]
            while room and start_transfer(room[0][0], d, room[0][1], t):
                room.pop(0)
        if e.has_work:
            e.begin_step(t, fuse=fuse_decode)
            push(i)
    if any(waiting_room):
        raise RuntimeError("a decode engine never had room for a prompt (raise its KV size)")
    return RunResult([records[j] for j in range(len(reqs))],
                     [e.counters.busy_time_s for e in engines])
