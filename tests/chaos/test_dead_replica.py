"""A dead replica: reported down the whole time, and its trial requests cost clients nothing."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from gateway import create_app, parse_config
from tests.gateway.conftest import rig
from tests.gateway.fake_replica import Upstream
from tests.support import free_port, start_server

BODY = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def replica_up(metrics: str, name: str) -> str:
    return next(
        line.split()[-1]
        for line in metrics.splitlines()
        if line.startswith("gateway_replica_up") and f'replica="{name}"' in line
    )


async def test_a_dead_replica_reads_down_and_is_not_ready_while_it_flaps() -> None:
    pool = {"policy": "round_robin", "health": {"interval_s": 0.1, "timeout_s": 0.2,
                                                "failures_to_open": 1, "open_s": 0.3}}  # fmt: skip
    async with rig([Upstream("good")], dead=1, pool=pool) as r, httpx.AsyncClient(timeout=10) as h:
        await asyncio.sleep(0.3)  # the first probes open its circuit
        ups, ready = [], []
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2.0:  # several open -> half-open -> open cycles
            ups.append(replica_up((await h.get(r.url + "/metrics")).text, "dead0"))
            ready.append((await h.get(r.url + "/ready")).json()["available_replicas"]["chat"])
            await asyncio.sleep(0.02)
        assert set(ups) == {"0.0"}, ups
        assert set(ready) == {1}, ready


async def test_a_failed_trial_of_a_half_open_replica_is_retried_elsewhere() -> None:
    """With `retries: 0` a request has one attempt; the trial request a half-open dead replica
    gets must still not cost its client a 502 (it is retried on a healthy replica)."""
    pool = {"policy": "round_robin", "retries": 0,
            "health": {"interval_s": 60, "failures_to_open": 1, "open_s": 0.05}}  # fmt: skip
    async with rig([Upstream("good")], dead=1, pool=pool) as r, httpx.AsyncClient(timeout=10) as h:
        statuses = []
        for _ in range(40):
            res = await h.post(r.url + "/v1/chat/completions", json=BODY)
            statuses.append(res.status_code)
            await asyncio.sleep(0.06)  # past open_s: the dead replica is half-open again
        dead = r.gateway.pools["chat"].by_name["dead0"]
        assert dead.circuit.failures > 1  # it did get trial requests
        # the first request, before the circuit ever opened, is the only one that may fail
        assert statuses[1:] == [200] * 39, statuses


async def test_a_replica_url_password_reaches_no_client_and_no_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A replica URL with user:pass@ that cannot be reached: the 502 text and the log lines
    name the replica without its password."""
    dead = f"http://chaos:secret-pw-123@127.0.0.1:{free_port()}"
    cfg = {"pools": {"chat": {"replicas": [{"url": dead, "name": "d"}], "retries": 0}}}
    gw = await start_server(create_app(parse_config(cfg)), lifespan="on")
    try:
        async with httpx.AsyncClient(timeout=10) as h:
            res = await h.post(gw.url + "/v1/chat/completions", json=BODY)
        assert res.status_code in (502, 503, 504)
        assert "secret-pw-123" not in res.text
        assert "secret-pw-123" not in caplog.text
    finally:
        await gw.stop()
