"""Prefix index benchmark: hashing, memory match, Redis match and bytes per indexed block.

Run from the repo root: `python -m bench.index` (about a minute; `--quick` for a smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
import tracemalloc
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import redis.asyncio as aioredis

from prefix_index import ByteChunker, MemoryIndex, RedisIndex, RedisTuning, scope_key

CHAINS = (128, 512, 2048)
REPLICAS = (8, 64)
SCOPE = scope_key("bench-model")


@dataclass(frozen=True)
class Timing:
    p50_us: float
    p90_us: float

    def __str__(self) -> str:
        return f"{self.p50_us:,.0f} ({self.p90_us:,.0f})"


def summary(samples: list[float]) -> Timing:
    samples.sort()
    return Timing(statistics.median(samples), samples[int(len(samples) * 0.9)])


async def timed(call: Callable[[], Awaitable[object]], iterations: int) -> Timing:
    for _ in range(min(50, iterations)):
        await call()
    samples = []
    clock = time.perf_counter
    for _ in range(iterations):
        start = clock()
        await call()
        samples.append((clock() - start) * 1e6)
    return summary(samples)


def timed_sync(call: Callable[[], object], iterations: int) -> Timing:
    for _ in range(min(50, iterations)):
        call()
    samples = []
    clock = time.perf_counter
    for _ in range(iterations):
        start = clock()
        call()
        samples.append((clock() - start) * 1e6)
    return summary(samples)


def depths_shared(n: int, replicas: int) -> list[int]:
    """A system prompt (the first quarter) everywhere; a few replicas hold longer prefixes."""
    deep = [n, 3 * n // 4, n // 2]
    return [deep[i] if i < len(deep) else n // 4 for i in range(replicas)]


def depths_distinct(n: int, replicas: int) -> list[int]:
    """The worst case for a binary search: every replica stops at a different depth."""
    return [n * (i + 1) // replicas for i in range(replicas)]


def random_chain(rng: random.Random, n: int) -> list[int]:
    return [rng.getrandbits(64) for _ in range(n)]


@contextmanager
def private_redis(binary: str) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()


async def used_memory(url: str) -> int:
    client = aioredis.Redis.from_url(url)
    try:
        return int((await client.info("memory"))["used_memory"])
    finally:
        await client.aclose()


async def fill(index: MemoryIndex | RedisIndex, blocks: int, replicas: Sequence[str]) -> None:
    """Background: `blocks` indexed blocks in 64-block chains, spread over the replicas."""
    rng = random.Random(1)
    for i in range(blocks // 64):
        await index.record(SCOPE, replicas[i % len(replicas)], random_chain(rng, 64))


async def memory_bytes_per_block(n: int) -> tuple[float, float]:
    """tracemalloc: bytes per block held by one replica, and per extra replica holding it."""
    rng = random.Random(2)
    chains = [random_chain(rng, 64) for _ in range(n // 64)]
    gc.collect()
    tracemalloc.start()
    index = MemoryIndex(capacity_blocks=n)
    base = tracemalloc.get_traced_memory()[0]
    for c in chains:
        index.record_now(SCOPE, "r0", c)
    one = tracemalloc.get_traced_memory()[0]
    for replica in ("r1", "r2", "r3"):
        for c in chains:
            index.record_now(SCOPE, replica, c)
    four = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    # The hash ints are the caller's until the request ends; the index keeps them alive.
    return (one - base) / n, (four - one) / (3 * n)


async def redis_bytes_per_block(url: str, n: int) -> tuple[float, float]:
    """INFO used_memory: bytes per block held by one replica, and per extra replica."""
    namespace = f"kvgwmem-{uuid.uuid4().hex[:8]}"
    index = RedisIndex(url, namespace=namespace, local_cache_s=0, capacity_blocks=n)
    rng = random.Random(3)
    chains = [random_chain(rng, 64) for _ in range(n // 64)]
    try:
        base = await used_memory(url)
        for c in chains:
            await index.record(SCOPE, "r0", c)
        one = await used_memory(url)
        for replica in ("r1", "r2", "r3"):
            for c in chains:
                await index.record(SCOPE, replica, c)
        four = await used_memory(url)
        for replica in ("r0", "r1", "r2", "r3"):
            await index.forget(replica)
    finally:
        await index.aclose()
    return (one - base) / n, (four - one) / (3 * n)


async def run(args: argparse.Namespace) -> None:
    iterations = 60 if args.quick else args.iterations
    background = 50_000 if args.quick else args.background
    redis_background = 20_000 if args.quick else args.redis_background
    names = [f"replica-{i}" for i in range(max(REPLICAS))]
    rng = random.Random(0)
    chunker = ByteChunker(64)
    loop_name = type(asyncio.get_running_loop()).__module__.split(".")[0]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"# prefix index benchmark (python {sys.version.split()[0]}, {loop_name} loop, "
          f"{os.cpu_count()} cpus, load average {load})")  # fmt: skip

    started = time.monotonic()
    memory = MemoryIndex(capacity_blocks=10_000_000, ttl_s=600.0)  # the gateway's default TTL
    await fill(memory, background, names)
    print(f"# memory index: {background:,} background blocks ({time.monotonic() - started:.1f} s)")
    shared = RedisIndex(args.redis_url, namespace=f"kvgwbench-{uuid.uuid4().hex[:8]}",
                        local_cache_s=0, capacity_blocks=10_000_000,
                        tuning=RedisTuning(timeout_s=5.0))  # fmt: skip
    started = time.monotonic()
    await fill(shared, redis_background, names)
    print(f"# redis index: {redis_background:,} background blocks "
          f"({time.monotonic() - started:.1f} s)")  # fmt: skip

    admin = aioredis.Redis.from_url(args.redis_url)
    rows = []
    for n in CHAINS:
        text = "".join(chr(rng.randint(32, 126)) for _ in range(n * 64 + 17))
        token_ids = [rng.randint(0, 150_000) for _ in range(n * 16)]
        hash_text = timed_sync(lambda t=text: chunker.hash_text(SCOPE, t), iterations)
        hash_tokens = timed_sync(lambda t=token_ids: chunker.hash_tokens(SCOPE, t), iterations)
        # the dispatch's write of a chain the replica holds already (a repeated prefix)
        held = random_chain(rng, n)
        memory.record_now(SCOPE, "replica-0", held)
        record = timed_sync(lambda c=held: memory.record_now(SCOPE, "replica-0", c), iterations)
        for r in REPLICAS:
            replicas = names[:r]
            row = [f"{n:,}", str(r), str(hash_text), str(hash_tokens), str(record)]
            for depths in (depths_shared, depths_distinct):
                query = random_chain(rng, n)
                for name, depth in zip(replicas, depths(n, r), strict=True):
                    await memory.record(SCOPE, name, query[:depth])
                    await shared.record(SCOPE, name, query[:depth])
                want = await memory.match(SCOPE, query, replicas)
                assert await shared.match(SCOPE, query, replicas) == want
                mem = await timed(lambda q=query, r=replicas: memory.match(SCOPE, q, r), iterations)
                await admin.config_resetstat()
                red = await timed(lambda q=query, r=replicas: shared.match(SCOPE, q, r), iterations)
                lua = (await admin.info("commandstats"))["cmdstat_evalsha"]["usec_per_call"]
                row += [str(mem), f"{red} / {lua:,.0f}"]
            rows.append(row)
    miss = random_chain(rng, max(CHAINS))
    redis_miss = await timed(lambda: shared.match(SCOPE, miss, names), iterations)
    cached = RedisIndex(args.redis_url, namespace=shared.namespace, local_cache_s=60)
    cache_hit = await timed(lambda: cached.match(SCOPE, miss, names), iterations)
    await cached.aclose()
    await shared.aclose()
    await admin.aclose()

    mem_one, mem_more = await memory_bytes_per_block(64_000 if args.quick else 200_000)
    red_one, red_more = await redis_bytes_per_block(
        args.redis_url, 16_000 if args.quick else 64_000
    )

    header = ["blocks", "replicas", "hash text µs", "hash token ids µs", "memory record µs",
              "memory match µs",
              "redis match µs", "memory, depths distinct", "redis, depths distinct"]  # fmt: skip
    print()
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---:" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()
    print("Times are p50 (p90) in µs as the caller sees them; after the slash, the mean time")
    print("Redis spent in the match script (its CPU per match, whatever the client's load).")
    print("'memory record': recording a chain the replica already holds (what a dispatch writes")
    print("for a repeated prefix: each block moved to the LRU's end with a new expiry).")
    print("'memory/redis match': the first quarter of the chain is held by every replica and")
    print("three replicas hold 1, 3/4 and 1/2 of it; 'depths distinct': replica i holds")
    print("(i+1)/R of the chain, the binary search's worst case.")
    print(f"Redis match of a {max(CHAINS):,}-block chain nobody holds, {max(REPLICAS)} replicas: "
          f"{redis_miss} µs; the same answered by the local cache: {cache_hit} µs.")  # fmt: skip
    print()
    print("| backend | bytes per indexed block (one replica) | each further replica on it |")
    print("|---|---:|---:|")
    print(f"| memory | {mem_one:,.0f} | {mem_more:,.0f} |")
    print(f"| redis | {red_one:,.0f} | {red_more:,.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.index", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a smoke run (a few seconds)")
    parser.add_argument("--iterations", type=int, default=300, help="timed calls per cell")
    parser.add_argument("--background", type=int, default=1_000_000,
                        help="blocks indexed in the memory backend before timing")  # fmt: skip
    parser.add_argument("--redis-background", type=int, default=200_000,
                        help="blocks indexed in Redis before timing")  # fmt: skip
    parser.add_argument("--redis-url", default=None,
                        help="use this Redis (default: a private redis-server on a free port)")  # fmt: skip
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                        help="event loop (the gateway runs uvloop when installed)")  # fmt: skip
    args = parser.parse_args()
    runner: Callable[..., None] = asyncio.run
    if args.loop == "uvloop":
        try:
            import uvloop

            runner = uvloop.run
        except ImportError:
            pass
    if args.redis_url is not None:
        runner(run(args))
        return
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("no redis-server on PATH: pass --redis-url")
    with private_redis(binary) as url:
        args.redis_url = url
        runner(run(args))


if __name__ == "__main__":
    main()
