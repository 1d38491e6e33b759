"""A private redis-server that dies, freezes, forgets its scripts or runs out of memory while
routing goes on: the index never raises, logs once per outage, and heals by itself."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator

import pytest
import redis.asyncio as aioredis

from prefix_index import RedisIndex, RedisTuning
from tests.support import at_once, free_port

S = "m5:model"
A = [1_000_003 + i for i in range(12)]
B = A[:5] + [2_000_006 + i for i in range(7)]
FAST = RedisTuning(timeout_s=0.5, retry_s=0.05)  # detects an outage fast
STEADY = RedisTuning(timeout_s=2.0, retry_s=0.05)  # no false outage on a busy CI machine


class PrivateRedis:
    """redis-server on a free loopback port, no persistence: a restart forgets everything."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.frozen = False

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],  # fmt: skip
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # poll readiness
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def kill(self) -> None:
        if self.proc is not None:
            if self.frozen:
                self.thaw()
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def freeze(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)
        self.frozen = False


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (scripts/ensure-redis installs it)")
    server = PrivateRedis(binary)
    server.start()
    yield server
    server.kill()


async def until(predicate: Callable[[], bool], within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "prefix_index" and r.levelno >= logging.WARNING]


async def test_routing_goes_on_while_redis_restarts(
    private_redis: PrivateRedis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="prefix_index")
    index = RedisIndex(private_redis.url, local_cache_s=0, tuning=STEADY)
    try:
        await index.record(S, "r1", A)
        assert await index.match(S, A, ["r1", "r2"]) == {"r1": 12, "r2": 0}

        private_redis.kill()
        # the first request finds Redis gone (its connection refused) and goes on
        assert await index.match(S, A, ["r1", "r2"]) == {"r1": 12, "r2": 0}
        assert not index.healthy
        for _ in range(200):  # requests keep coming: no exception, and no wait at all
            assert at_once(index.match(S, A, ["r1", "r2"])) in (
                {"r1": 12, "r2": 0},
                {"r1": 12, "r2": 5},
            )
            at_once(index.record(S, "r2", B))  # buffered for Redis, kept in the local view
        assert await index.match(S, B, ["r1", "r2"]) == {"r1": 5, "r2": 12}  # the local view
        assert not await index.flush()
        assert (await index.stats()).healthy is False
        assert len(warnings_of(caplog)) == 1  # one line per outage, not per request

        private_redis.start()  # same port, empty (no persistence)
        await until(lambda: index.healthy)
        assert await index.flush()
        fresh = RedisIndex(private_redis.url, local_cache_s=0, tuning=STEADY)
        try:  # the buffered writes reached the new Redis; what it lost stays lost
            assert await fresh.match(S, B, ["r1", "r2"]) == {"r1": 0, "r2": 12}
        finally:
            await fresh.aclose()
        await index.record(S, "r1", A)  # and the index works normally again
        assert await index.match(S, A, ["r1", "r2"]) == {"r1": 12, "r2": 5}
        assert len(warnings_of(caplog)) == 1
        assert any("is back" in r.getMessage() for r in caplog.records)
    finally:
        await index.aclose()


async def test_a_frozen_redis_costs_one_timeout_then_nothing(
    private_redis: PrivateRedis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="prefix_index")
    index = RedisIndex(private_redis.url, local_cache_s=0, tuning=FAST)
    try:
        await index.record(S, "r1", A)
        private_redis.freeze()  # accepts bytes, never answers
        # after one timeout: the match's own deadline fires long before a reference of four
        # of them, armed with it on this loop
        first = asyncio.create_task(index.match(S, A, ["r1"]))
        await asyncio.wait([first], timeout=4 * FAST.timeout_s)
        assert first.done() and first.result() == {"r1": 12}
        assert not index.healthy
        for _ in range(200):  # then nothing: no timeout, no wait at all, while it is out
            assert at_once(index.match(S, A, ["r1"])) == {"r1": 12}
        at_once(index.record(S, "r2", B))
        assert len(warnings_of(caplog)) == 1

        private_redis.thaw()
        await until(lambda: index.healthy)
        assert await index.flush()
        fresh = RedisIndex(private_redis.url, local_cache_s=0, tuning=STEADY)
        try:
            assert await fresh.match(S, B, ["r1", "r2"]) == {"r1": 5, "r2": 12}
        finally:
            await fresh.aclose()
        assert len(warnings_of(caplog)) == 1
    finally:
        await index.aclose()


async def test_redis_down_from_the_start_is_no_error(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="prefix_index")
    index = RedisIndex(f"redis://127.0.0.1:{free_port()}/0", tuning=STEADY)
    try:
        assert not await index.connect()
        await index.record(S, "r1", A)
        assert await index.match(S, A, ["r1"]) == {"r1": 12}  # the local view
        await index.forget("r1")
        assert await index.match(S, A, ["r1"]) == {"r1": 0}
        assert (await index.stats()).pending_writes == 2
        assert len(warnings_of(caplog)) == 1
    finally:
        await index.aclose()


async def test_the_outage_buffer_is_bounded(caplog: pytest.LogCaptureFixture) -> None:
    tuning = RedisTuning(timeout_s=2.0, retry_s=0.05, max_pending=5)
    index = RedisIndex(f"redis://127.0.0.1:{free_port()}/0", tuning=tuning)
    try:
        assert not await index.connect()
        for i in range(20):
            await index.record(S, f"r{i}", A)
        stats = await index.stats()
        assert (stats.pending_writes, stats.dropped_writes) == (5, 15)
        assert await index.match(S, A, ["r0", "r19"]) == {"r0": 12, "r19": 12}  # local view
    finally:
        await index.aclose()


async def test_scripts_flushed_behind_its_back_are_loaded_again(
    private_redis: PrivateRedis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="prefix_index")
    index = RedisIndex(private_redis.url, local_cache_s=0, tuning=STEADY)
    admin = aioredis.Redis.from_url(private_redis.url)
    try:
        await index.record(S, "r1", A)
        await admin.script_flush()
        assert await index.match(S, A, ["r1"]) == {"r1": 12}
        await admin.script_flush()
        await index.record(S, "r2", B)
        assert await index.match(S, B, ["r1", "r2"]) == {"r1": 5, "r2": 12}
        assert index.healthy and caplog.records == []
    finally:
        await admin.aclose()
        await index.aclose()


async def test_refused_writes_are_not_an_outage(
    private_redis: PrivateRedis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="prefix_index")
    index = RedisIndex(private_redis.url, local_cache_s=0, tuning=STEADY)
    admin = aioredis.Redis.from_url(private_redis.url)
    try:
        await index.record(S, "r1", A)
        await admin.config_set("maxmemory", "1")  # every write is refused with OOM
        for _ in range(20):
            await index.record(S, "r2", B)
        assert await index.match(S, B, ["r1", "r2"]) == {"r1": 5, "r2": 0}  # reads still work
        assert index.healthy
        assert len(warnings_of(caplog)) == 1  # one line per kind of refusal
        await admin.config_set("maxmemory", "0")
        await index.record(S, "r2", B)
        assert await index.match(S, B, ["r1", "r2"]) == {"r1": 5, "r2": 12}
    finally:
        await admin.aclose()
        await index.aclose()


async def test_a_stop_ends_a_task_that_swallowed_its_first_cancellation() -> None:
    """`cancel` (every background loop that talks to Redis stops with it): a loop whose library
    swallowed the first CancelledError, as redis-py's cluster client mid-failover did, still
    ends; before, the gateway's shutdown waited on it forever."""
    from prefix_index.redis_client import cancel

    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed += 1  # what the library did: carry on as if nothing happened

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel(task, None), 10)
    assert task.cancelled() and swallowed == 1
