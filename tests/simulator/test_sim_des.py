"""Discrete-event mode: determinism, fused decode runs, stale views, routers and callbacks,
closed-loop clients."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Sequence

import pytest

from simulator import Cluster, ReplicaLoad, RequestRecord, SimRequest, chat_requests, run
from simulator.des import ClosedLoop, RoundRobin, fixed_length_users
from simulator.workloads import multi_turn, shared_prompts


def trace(n: int = 400, rate: float = 8.0, seed: int = 1) -> list[SimRequest]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(16, 50_000) for _ in range(rng.randint(300, 1500))]
                for _ in range(6)]
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        user = [rng.randrange(16, 50_000) for _ in range(rng.randint(5, 80))]
        out.append(SimRequest(f"q{i}", t, rng.choice(prefixes) + user, rng.randint(1, 120),
                              priority=rng.choice((0, 0, 1))))
    return out


class Clairvoyant:
    """Peeks at the engines' true caches (async, like the real index) and at loads."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.first: dict[str, float] = {}
        self.done: list[RequestRecord] = []

    async def route(self, req: SimRequest, view: Sequence[ReplicaLoad]) -> int:
        await asyncio.sleep(0)
        engines = self.cluster.engines
        return max(range(len(view)), key=lambda i: (
            engines[i].cached_prefix_tokens(req.prompt_tokens)
            - 300 * (view[i].waiting + view[i].running), -i))

    def on_first_token(self, req: SimRequest, replica: int, t: float) -> None:
        self.first[req.id] = t

    async def on_finish(self, req: SimRequest, replica: int, record: RequestRecord) -> None:
        self.done.append(record)


async def test_same_trace_and_seed_give_the_same_result() -> None:
    results = []
    for _ in range(2):
        cluster = Cluster(4, "qwen2.5-14b", "a100-80g", seed=3, num_gpu_blocks=600,
                          max_model_len=4096)
        results.append(await run(trace(), cluster, Clairvoyant(cluster)))
    a, b = results
    assert a.records == b.records and a.busy_s == b.busy_s
    assert a.summary() == b.summary()


@pytest.mark.parametrize("router", ["rr", "clairvoyant"])
async def test_fused_decode_runs_change_nothing(router: str) -> None:
    # small caches so that eviction and preemption happen inside the comparison
    results = []
    for fuse in (True, False):
        cluster = Cluster(3, "qwen2.5-14b", "a100-80g", seed=0, num_gpu_blocks=300,
                          max_model_len=4096, max_num_seqs=16, scheduling_policy="priority")
        r = RoundRobin() if router == "rr" else Clairvoyant(cluster)
        results.append(await run(trace(300, rate=12.0), cluster, r, fuse_decode=fuse,
                                 scrape_interval_s=0.5))
    fused, plain = results
    assert fused.records == plain.records
    assert fused.busy_s == plain.busy_s
    assert sum(r.preemptions for r in plain.records) > 0


async def test_records_callbacks_and_summary() -> None:
    cluster = Cluster(2, "llama-2-13b", "h100", seed=0)
    router = Clairvoyant(cluster)
    reqs = trace(120, rate=4.0)
    res = await run(reqs, cluster, router)
    assert [r.id for r in res.records] == [q.id for q in sorted(reqs, key=lambda q: q.arrival_s)]
    assert len(router.done) == 120 and len(router.first) == 120
    for rec, req in zip(res.records, reqs, strict=True):
        assert rec.arrival_s == req.arrival_s
        assert rec.arrival_s < rec.first_token_s <= rec.finish_s
        assert router.first[rec.id] == rec.first_token_s
        assert rec.output_tokens == req.max_tokens and rec.prompt_tokens == len(req.prompt_tokens)
        assert rec.cached_tokens % 16 == 0 and rec.cached_tokens < rec.prompt_tokens
    s = res.summary()
    assert s["requests"] == 120 and 0 < s["hit_ratio"] < 1
    assert s["ttft_p50"] <= s["ttft_p99"] and s["tpot_p50"] <= s["tpot_p99"]
    assert s["throughput_req_s"] > 0 and s["imbalance"] >= 1.0
    assert sum(res.busy_s) == pytest.approx(sum(e.counters.busy_time_s for e in cluster.engines))


async def test_the_view_is_as_stale_as_the_scrape_interval() -> None:
    seen: list[tuple[float, float]] = []

    class Spy(RoundRobin):
        def route(self, req: SimRequest, view: Sequence[ReplicaLoad]) -> int:
            seen.append((req.arrival_s, view[0].scraped_at_s))
            return 0

    await run(trace(100, rate=20.0), Cluster(1, seed=0), Spy(), scrape_interval_s=1.0)
    assert all(at <= t < at + 1.0 for t, at in seen)
    assert all(at == math.floor(t) for t, at in seen)
    seen.clear()
    await run(trace(50, rate=20.0), Cluster(1, seed=0), Spy(), scrape_interval_s=0)
    assert all(at == t for t, at in seen)


async def test_the_view_shows_queueing() -> None:
    loads: list[int] = []

    class Spy(RoundRobin):
        def route(self, req: SimRequest, view: Sequence[ReplicaLoad]) -> int:
            loads.append(view[0].waiting + view[0].running)
            return 0

    # requests reach the engine after the API server's latency (tens of ms): spread them
    burst = [SimRequest(f"b{i}", 0.01 * i, list(range(i * 1000, i * 1000 + 3000)), 50)
             for i in range(40)]
    await run(burst, Cluster(1, seed=0), Spy(), scrape_interval_s=0)
    assert max(loads) > 10


async def test_a_bad_router_answer_is_an_error() -> None:
    class Bad:
        def route(self, req: SimRequest, view: Sequence[ReplicaLoad]) -> int:
            return 5

    with pytest.raises(ValueError, match="router returned 5"):
        await run(trace(3), Cluster(2, seed=0), Bad())


async def test_chat_workloads_replay_with_prefix_hits() -> None:
    reqs = chat_requests(shared_prompts(60, k=2, rate=5.0, prompt_tokens=(500, 500)))
    res = await run(reqs, Cluster(1, seed=0), RoundRobin())
    assert res.summary()["hit_ratio"] > 0.7
    chats = chat_requests(multi_turn(10, turns=3, rate=2.0))
    summary = (await run(chats, Cluster(1, seed=0), RoundRobin())).summary()
    assert summary["requests"] == 30 and summary["hit_ratio"] > 0.3


def test_cluster_engines_expose_true_state() -> None:
    cluster = Cluster(2, "qwen2.5-14b", "h200", seed=0)
    e = cluster.engines[0]
    assert (e.num_waiting, e.num_running, e.kv_usage) == (0, 0, 0.0)
    assert e.cached_prefix_tokens(list(range(100))) == 0


async def test_closed_loop_clients_send_after_each_reply_and_think() -> None:
    made: list[tuple[int, int]] = []

    def next_request(user: int, k: int) -> SimRequest | None:
        if k >= 3:
            return None
        made.append((user, k))
        return SimRequest(f"u{user}-{k}", 0.0, list(range(user * 500, user * 500 + 200)), 20)

    loop = ClosedLoop(4, next_request, think_time_s=0.5)
    res = await run(loop, Cluster(1, "qwen2.5-14b", "h100", seed=0), RoundRobin())
    assert len(res.records) == 12 and sorted(made) == [(u, k) for u in range(4) for k in range(3)]
    by_user: dict[str, list] = {}
    for r in res.records:
        by_user.setdefault(r.id.split("-")[0], []).append(r)
    for recs in by_user.values():
        assert recs[0].arrival_s == 0.0
        for prev, nxt in zip(recs, recs[1:], strict=False):
            assert nxt.arrival_s == pytest.approx(prev.finish_s + 0.5)
    # never more than 4 requests outstanding
    events = sorted([(r.arrival_s, 1) for r in res.records] + [(r.finish_s, -1) for r in res.records],
                    key=lambda e: (e[0], e[1]))
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    assert peak <= 4


async def test_ttft_includes_the_request_latency_and_concurrency_queues() -> None:
    ttft = {}
    for c in (1, 16):
        cluster = Cluster(1, "llama-3.1-8b", "h100", seed=0, max_model_len=4096)
        users = fixed_length_users(c, 1024, 64, requests_per_user=2)
        recs = (await run(users, cluster, RoundRobin())).records
        ttft[c] = sum(r.ttft_s for r in recs) / len(recs)
        perf = cluster.config.perf
        assert min(r.ttft_s for r in recs) >= perf.request_latency_s(1024)
    assert ttft[16] > 2 * ttft[1]  # a burst of 16 prompts queues for the token budget
