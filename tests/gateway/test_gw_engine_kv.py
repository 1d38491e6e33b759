"""The engine's KV cache geometry from its `cache_config_info` metric: read from the scrape, it
sizes a replica in the index when the config gives no `capacity_blocks`, and a block size that
differs from tokens mode's is named in the log."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from gateway import create_app, parse_config
from gateway.fleet.scrape import parse_metrics
from simulator import Fleet
from tests.simulator.tiny_tokenizer import train_tokenizer
from tests.support import poll_until, start_server


def test_vllm_and_sglang_cache_info_are_read() -> None:
    vllm = (
        'vllm:cache_config_info{block_size="16",enable_prefix_caching="True",'
        'gpu_memory_utilization="0.9",num_gpu_blocks="3960"} 1.0\n'
        'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="40"} 1.0\n'  # DP rank 2
        "vllm:num_requests_waiting 3\n"
    )
    s = parse_metrics(vllm)
    assert (s.block_size, s.kv_blocks, s.kv_tokens, s.waiting) == (16, 4000, 64000, 3.0)
    s = parse_metrics('sglang:cache_config_info{page_size="1",num_pages="12345"} 1\n')
    assert (s.block_size, s.kv_tokens) == (1, 12345)
    for unsized in ('num_gpu_blocks="None"', 'num_gpu_blocks="0"', 'other="1"'):
        assert parse_metrics(f'vllm:cache_config_info{{block_size="16",{unsized}}} 1\n').kv_tokens is None


def config(url: str, **chunking: object) -> dict[str, object]:
    return {
        "pools": {"chat": {"replicas": [url], "scrape": {"interval_s": 0.1}}},
        "index": {"backend": "memory", "chunking": chunking},
    }


async def test_an_unsized_replica_is_bounded_by_what_its_engine_holds() -> None:
    async with Fleet(n=1, speedup=1000.0) as fleet:
        engine = fleet.replicas[0].engine
        kv_tokens = engine.config.block_size * engine.config.num_blocks
        app = create_app(parse_config(config(fleet.urls[0])))
        gw = await start_server(app, lifespan="on")
        try:
            index = app.gateway.index
            name = app.gateway.all_replicas()[0].name
            tokens_per_block = app.gateway.chunker.tokens_per_block
            await poll_until(lambda: name in index._capacity)  # the bound the index holds
            assert index._capacity[name] == int(kv_tokens / tokens_per_block)
        finally:
            await gw.stop()


async def test_a_configured_capacity_wins_over_the_engine_report() -> None:
    async with Fleet(n=1, speedup=1000.0) as fleet:
        cfg = config(fleet.urls[0])
        cfg["pools"]["chat"]["capacity_blocks"] = 123  # type: ignore[index]
        app = create_app(parse_config(cfg))
        gw = await start_server(app, lifespan="on")
        try:
            replica = app.gateway.all_replicas()[0]
            await poll_until(lambda: replica.engine_kv is not None)
            assert app.gateway.index._capacity[replica.name] == 123
        finally:
            await gw.stop()


async def test_a_block_size_unlike_the_engines_is_named(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    tok = train_tokenizer(tmp_path / "tok.json")
    async with Fleet(n=1, speedup=1000.0, tokenizer=tok) as fleet:
        cfg = config(fleet.urls[0], mode="tokens", tokenizer=str(tok), block_size=32)
        app = create_app(parse_config(cfg))
        with caplog.at_level(logging.WARNING, logger="gateway"):
            gw = await start_server(app, lifespan="on")
            try:
                replica = app.gateway.all_replicas()[0]
                await poll_until(lambda: replica.engine_kv is not None)
            finally:
                await gw.stop()
    assert replica.engine_kv is not None and replica.engine_kv[0] == 16
    assert any(
        "the engine's KV block is 16 tokens, index.chunking.block_size is 32" in r.getMessage()
        for r in caplog.records
    )


async def test_the_whole_index_holds_no_more_than_twice_its_replicas_kv() -> None:
    """Client-chosen scopes (a `cache_salt` each) share an engine's KV: the index's bound over all
    scopes is twice the replicas' KV blocks together (issue 39), within index.max_blocks."""
    async with Fleet(n=2, speedup=1000.0) as fleet:
        engine = fleet.replicas[0].engine
        kv_tokens = engine.config.block_size * engine.config.num_blocks
        cfg = {"pools": {"chat": {"replicas": fleet.urls, "scrape": {"interval_s": 0.1}}},
               "index": {"backend": "memory", "capacity_blocks": 20000}}  # fmt: skip
        app = create_app(parse_config(cfg))
        gw = await start_server(app, lifespan="on")
        try:
            index = app.gateway.index
            per_replica = int(kv_tokens / app.gateway.chunker.tokens_per_block)
            # before the first scrape, index.capacity_blocks sizes each replica
            assert index._max_blocks in (2 * 2 * 20000, 2 * (20000 + per_replica), 4 * per_replica)
            await poll_until(lambda: all(r.engine_kv for r in app.gateway.all_replicas()))
            assert index._max_blocks == 2 * 2 * per_replica
            cfg["pools"]["chat"]["capacity_blocks"] = 300_000  # type: ignore[index]
            cfg["index"]["max_blocks"] = 1_000_000  # type: ignore[index]
            await app.gateway.reconfigure(parse_config(cfg))
            await poll_until(lambda: app.gateway.index._max_blocks == 1_000_000)  # the lower
        finally:
            await gw.stop()
