"""Simulator KV tiers: GPU evictions spill to host memory, a prefix found there loads (and
the step pays the load), the shared store serves every replica (in the DES and over HTTP),
events carry the medium."""

from __future__ import annotations

import random

import httpx
import pytest

from simulator.cli import fleet_from_args, parser
from simulator.des import Cluster, RoundRobin, SimRequest, run
from simulator.fleet import Fleet
from simulator.kv_cache import PrefixCache
from simulator.tiers import EventTokens, SharedStore, StoreOutbox, Tiers, attach_shared

BS = 16
PROMPT = 2048  # 128 blocks


def prompt(seed: int, n: int = PROMPT) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 50_000) for _ in range(n)]


def trace(*prompts: list[int], gap_s: float = 5.0) -> list[SimRequest]:
    return [SimRequest(f"r{i}", i * gap_s, p, 1) for i, p in enumerate(prompts)]


def cluster(n: int = 1, **kw: object) -> Cluster:
    # 300 GPU blocks (4800 tokens): three 2K prompts after A push all of its blocks out
    return Cluster(n, num_gpu_blocks=300, max_model_len=4096, **kw)  # type: ignore[arg-type]


async def ttft_of_return(c: Cluster) -> tuple[float, int]:
    a = prompt(1)
    again = a[:-16] + prompt(9, 16)  # A's prefix, a new last block
    res = await run(trace(a, prompt(2), prompt(3), prompt(4), again), c, RoundRobin())
    rec = res.records[-1]
    return rec.ttft_s, rec.cached_tokens


async def test_an_evicted_prefix_loads_from_the_host_tier() -> None:
    cold_ttft, cold_hit = await ttft_of_return(cluster())
    c = cluster(cpu_kv_gb=4.0)
    warm_ttft, warm_hit = await ttft_of_return(c)
    assert cold_hit == 0  # GPU only: A was evicted
    assert warm_hit == PROMPT - BS  # everything but the new last block came from the host
    tiers = c.engines[0].cache.tiers
    assert tiers is not None and tiers.counters.hit_tokens["cpu"] == warm_hit
    bpt = c.config.perf.kv_bytes_per_token
    load_s = warm_hit * bpt / 50e9
    assert tiers.counters.load_s == {"cpu": pytest.approx(load_s), "shared": 0.0}
    assert tiers.counters.load_bytes["cpu"] == warm_hit * int(bpt)
    assert tiers.counters.spilled >= PROMPT // BS
    assert load_s < warm_ttft < cold_ttft  # loading costs time, less than recomputing


async def test_the_shared_store_serves_another_replica() -> None:
    c = cluster(2)
    store = SharedStore(10_000)
    attach_shared(c.engines, store)
    a = prompt(1)
    res = await run(trace(a, a[:-16] + prompt(9, 16)), c, RoundRobin())  # r0, then r1
    assert [r.replica for r in res.records] == [0, 1]
    assert res.records[1].cached_tokens == PROMPT - BS
    t1 = c.engines[1].cache.tiers
    assert t1 is not None and t1.counters.hit_tokens["shared"] == PROMPT - BS
    assert t1.counters.load_s["shared"] == pytest.approx(
        (PROMPT - BS) * c.config.perf.kv_bytes_per_token / 12.5e9
    )
    assert t1.counters.retrievals == 1


def test_spill_and_load_emit_tiered_events() -> None:
    cache = PrefixCache(4, BS)
    cache.tiers = Tiers(8, block_size=BS, bytes_per_token=1000.0)
    cache.events = []
    tokens = list(range(BS * 2))
    blocks = cache.allocate(2)
    assert blocks is not None
    cache.register(blocks[0], 11)
    cache.register(blocks[1], 12)
    cache.events.append(("stored", [11, 12], None, tokens))  # as the scheduler reports it
    cache.release(blocks)
    assert cache.allocate(4) is not None  # evicts both: spilled to the CPU tier
    assert cache.longest_prefix([11, 12]) == 2 and not cache.table
    out = EventTokens().expand(cache.events)
    assert out[0] == ("stored", [11, 12], None, tokens)
    assert ("stored", [11], None, tokens[:BS], "CPU") in out
    assert ("stored", [12], 11, tokens[BS:], "CPU") in out
    assert ("removed", 11) in out and ("removed", 12) in out
    assert out.index(("stored", [11], None, tokens[:BS], "CPU")) < out.index(("removed", 11))
    placeholders = EventTokens().expand(cache.events, placeholders=True)
    assert ("stored", [11], None, [], "CPU") in placeholders


def test_a_load_waits_for_free_gpu_blocks() -> None:
    cache = PrefixCache(2, BS)
    cache.tiers = Tiers(8, block_size=BS, bytes_per_token=1000.0)
    for h in (1, 2, 3):
        cache.tiers.spill(h, None)
    held = cache.allocate(1)  # one block in use: room to load only one
    assert held is not None
    assert len(cache.cached_blocks([1, 2, 3])) == 1
    assert cache.tiers.take_load_s() == pytest.approx(BS * 1000.0 / 50e9)


@pytest.mark.parametrize("encoding", ["map", "legacy"])
def test_the_publisher_encodes_the_medium(encoding: str) -> None:
    pytest.importorskip("msgspec")
    from prefix_index.event_decode import BlockRemoved, BlockStored, decode_batch
    from simulator.kv_publisher import encode_batch

    tokens = list(range(BS))
    events = [("stored", [11], 10, tokens, "CPU"), ("stored", [12], None, [], "CPU"),
              ("removed", 11, "CPU"), ("stored", [13], None, tokens)]  # fmt: skip
    got = decode_batch(encode_batch(events, encoding, BS, 0.0)).events
    assert isinstance(got[0], BlockStored) and got[0].medium == "CPU"
    assert (got[0].parent_block_hash, got[0].token_ids, got[0].block_size) == (10, tokens, BS)
    assert isinstance(got[1], BlockStored)
    assert (got[1].token_ids, got[1].block_size, got[1].medium) == ([], 0, "CPU")  # placeholder
    assert got[2] == BlockRemoved([11], medium="CPU", group_idx=0 if encoding == "map" else None)
    assert isinstance(got[3], BlockStored) and got[3].medium == "GPU"


def test_the_block_a_replica_announced_is_removed_by_it() -> None:
    store = SharedStore(2)
    mine, theirs = StoreOutbox(), StoreOutbox()
    woken: list[str] = []
    mine.wake = lambda: woken.append("mine")
    store.write(1, mine)
    store.write(2, theirs)
    store.write(1, theirs)  # held already: no second announcement, 1 is now the most recent
    store.write(3, theirs)  # pushes 2 out: theirs announced it, theirs removes it
    store.write(4, theirs)  # pushes 1 out: mine announced it, so mine removes it and is woken
    assert mine.events == [("tier_stored", "EXTERNAL", 1), ("tier_removed", "EXTERNAL", 1)]
    assert theirs.events == [
        ("tier_stored", "EXTERNAL", 2),
        ("tier_stored", "EXTERNAL", 3),
        ("tier_removed", "EXTERNAL", 2),
        ("tier_stored", "EXTERNAL", 4),
    ]
    assert woken == ["mine"]


def test_the_cli_sizes_the_shared_store_in_gb() -> None:
    args = parser().parse_args(["--replicas", "2", "--shared-kv-gb", "2", "--shared-kv-gbps",
                                "25"])  # fmt: skip
    fleet = fleet_from_args(args)
    assert fleet.shared is not None and fleet.shared.gbps == 25.0
    bpt = fleet.config.perf.kv_bytes_per_token
    assert fleet.shared.capacity == int(2e9 / (bpt * fleet.config.block_size))
    assert fleet_from_args(parser().parse_args(["--replicas", "2"])).shared is None


def sample(metrics: str, name: str, label: str = "") -> float:
    """The value of `name`'s series whose labels hold `label`; 0 when it has none."""
    line = next((x for x in metrics.splitlines() if x.startswith(name + "{") and label in x),
                None)  # fmt: skip
    return 0.0 if line is None else float(line.rsplit(" ", 1)[1])


def tier_hits(metrics: str, tier: str) -> float:
    return sample(metrics, "vllm:prefix_cache_tier_hits_total", f'tier="{tier}"')


async def test_host_tier_transfers_show_as_vllm_offload_counters() -> None:
    # 160 GPU blocks of 16: five 1.5K-token prompts push the first one out to the host tier
    rng = random.Random(4)
    texts = [" ".join(f"w{rng.randrange(10_000)}" for _ in range(1000)) for _ in range(6)]
    async with Fleet(n=1, speedup=1000.0, num_gpu_blocks=160, max_model_len=2048,
                     cpu_kv_gb=3.0, cpu_kv_gbps=20.0) as fleet, \
            httpx.AsyncClient(timeout=10) as h:  # fmt: skip
        url = fleet.urls[0]
        for t in [*texts, texts[0]]:  # the last one loads from the host tier
            res = await h.post(
                url + "/v1/completions", json={"model": "qwen2.5-14b", "prompt": t, "max_tokens": 1}
            )
            assert res.status_code == 200
        metrics = (await h.get(url + "/metrics")).text
    assert tier_hits(metrics, "cpu") > 0
    loaded = sample(metrics, "vllm:kv_offload_total_bytes_total", 'transfer_type="cpu_to_gpu"')
    spent = sample(metrics, "vllm:kv_offload_total_time_total", 'transfer_type="cpu_to_gpu"')
    bpt = fleet.config.perf.kv_bytes_per_token
    assert loaded == pytest.approx(tier_hits(metrics, "cpu") * bpt, rel=1e-6)
    assert loaded / spent == pytest.approx(20e9, rel=1e-6)  # --cpu-kv-gbps
    spilled = sample(metrics, "vllm:kv_offload_total_bytes_total", 'transfer_type="gpu_to_cpu"')
    spill_s = sample(metrics, "vllm:kv_offload_total_time_total", 'transfer_type="gpu_to_cpu"')
    assert spilled > 0 and spilled / spill_s == pytest.approx(20e9, rel=1e-6)
    assert "lmcache:" not in metrics  # no shared store: nothing LMCache would report


@pytest.mark.parametrize("shared_kv_gb", [1.0, None])
async def test_an_http_replica_loads_what_another_computed(shared_kv_gb: float | None) -> None:
    rng = random.Random(3)
    text = " ".join(f"w{rng.randrange(10_000)}" for _ in range(1000))  # about 1.5K tokens
    async with Fleet(n=2, speedup=1000.0, shared_kv_gb=shared_kv_gb) as fleet, \
            httpx.AsyncClient(timeout=10) as h:  # fmt: skip
        cached, shared_hits = [], []
        for url in fleet.urls:  # replica 0 computes the prompt, then replica 1 gets it
            before = tier_hits((await h.get(url + "/metrics")).text, "shared")
            res = await h.post(
                url + "/v1/completions",
                json={"model": "qwen2.5-14b", "prompt": text, "max_tokens": 1},
            )
            assert res.status_code == 200
            usage = res.json()["usage"]
            cached.append(usage["prompt_tokens_details"]["cached_tokens"])
            metrics = (await h.get(url + "/metrics")).text
            shared_hits.append(tier_hits(metrics, "shared") - before)
        if shared_kv_gb is None:
            assert cached == [0, 0] and shared_hits == [0, 0]
            return
        # replica 1 never saw it: every full block before the last token comes from the store
        loaded = 16 * ((usage["prompt_tokens"] - 1) // 16)
        assert cached == [0, loaded] and shared_hits == [0, loaded]
        assert fleet.shared is not None and len(fleet.shared) * 16 >= loaded
        assert "vllm:shared_kv_store_blocks{" in metrics
        # as LMCache reports a retrieve: the tokens it served and the seconds it took
        assert sample(metrics, "lmcache:num_hit_tokens_total") == loaded
        assert sample(metrics, "lmcache:time_to_retrieve_count") == 1
        bpt = fleet.config.perf.kv_bytes_per_token
        assert sample(metrics, "lmcache:time_to_retrieve_sum") == pytest.approx(
            loaded * bpt / (fleet.shared.gbps * 1e9), rel=1e-6
        )
        assert "vllm:kv_offload_total_bytes" not in metrics  # no host tier: no vLLM transfers
