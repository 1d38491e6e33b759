"""Client-chosen `cache_salt` values cannot grow a gateway's memory (issue 39): 600 requests, each
with a salt of its own and a 64 KB prompt, through a gateway process in front of two simulated
replicas (a child process) with `index.capacity_blocks: 20000`; then 600 more.

Where the memory went (tracemalloc, a second round to tell a leak from a high-water mark): the
prefix index, every salt a scope of ~1,000 blocks, held up to `index.max_blocks` (2,000,000
entries, ~320 MB) however small the replicas' KV. Nothing else grew with the salts (the chunker's
seed cache and the Redis index's key cache are bounded, metric labels capped). Now the index holds
no more than twice the replicas' KV blocks together (their `capacity_blocks`, or the KV their
engines report): RSS grew 67 -> 172 -> 270 MB over the two rounds before, 66 -> 79 -> 81 MB after.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import aiohttp
import pytest

from simulator.fleet import simulated_fleet
from tests.chaos.conftest import GatewayProc, running_gateway

pytestmark = pytest.mark.chaos

REQUESTS = 600
PROMPT_BYTES = 64 * 1024


def prompts(n: int = 20) -> list[str]:
    rnd = random.Random(39)
    words = ["alpha", "beta", "gamma", "delta", "kv", "cache", "route", "prefix", "token", "block"]
    return [" ".join(rnd.choice(words) for _ in range(PROMPT_BYTES // 4))[:PROMPT_BYTES] for _ in range(n)]


async def salted_round(gw: GatewayProc, first: int, texts: list[str]) -> list[int]:
    """REQUESTS completions, each under a salt no other request used; their statuses."""
    sem = asyncio.Semaphore(16)
    bodies = [
        {"model": "qwen2.5-14b", "prompt": texts[i % len(texts)], "max_tokens": 1,
         "cache_salt": f"client-salt-{first + i:08d}"}
        for i in range(REQUESTS)
    ]  # fmt: skip

    async def one(h: aiohttp.ClientSession, body: dict[str, object]) -> int:
        async with sem, h.post(gw.url + "/v1/completions", json=body) as res:
            await res.read()
            return res.status

    async with aiohttp.ClientSession() as h:
        return await asyncio.gather(*(one(h, b) for b in bodies))


async def test_distinct_salts_and_64_kb_prompts_grow_memory_by_a_bounded_amount(
    tmp_path: Path,
) -> None:
    sim = ("--speedup", "1000", "--max-model-len", "70000", "--max-num-batched-tokens", "70000")
    texts = prompts()
    async with simulated_fleet(2, *sim) as urls:
        cfg = {
            "pools": {"chat": {"replicas": urls, "health": {"interval_s": 0.5}}},
            "index": {"capacity_blocks": 20000},
            "server": {"log_level": "warning"},
            "tracing": {"exporter": "none"},
        }
        with running_gateway(cfg, tmp_path) as gw:
            await asyncio.sleep(1.0)  # the first scrape read the engines' KV
            base = gw.rss_mb()
            statuses = await salted_round(gw, 0, texts)
            await asyncio.sleep(1.0)
            first = gw.rss_mb()
            statuses += await salted_round(gw, REQUESTS, texts)
            await asyncio.sleep(1.0)
            second = gw.rss_mb()
    assert statuses.count(200) == 2 * REQUESTS, {s: statuses.count(s) for s in set(statuses)}
    figures = f"RSS {base:.0f} -> {first:.0f} -> {second:.0f} MB"
    print(figures)
    assert first - base <= 30, figures
    assert second - first <= 5, figures  # flat: a bound reached, not a leak
