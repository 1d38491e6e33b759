"""Fault switches: errors, stalls, connections dying mid-stream, garbage, slow first bytes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from simulator import Fleet

pytestmark = pytest.mark.chaos
STREAM = {"prompt": "tell me everything " * 30, "max_tokens": 2000, "stream": True}


@pytest.fixture
async def url() -> AsyncIterator[str]:
    async with Fleet(n=1, speedup=50.0, seed=0) as fleet:
        yield fleet.urls[0]


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10.0) as client:
        yield client


async def set_fault(http: httpx.AsyncClient, url: str, **fault: Any) -> dict[str, Any]:
    r = await http.post(url + "/sim/fault", json=fault)
    assert r.status_code == 200, r.text
    return r.json()


async def engine_idle(http: httpx.AsyncClient, url: str) -> None:
    deadline = time.monotonic() + 10
    while True:
        s = (await http.get(url + "/sim/stats")).json()
        if s["running"] == 0 and s["waiting"] == 0 and s["kv_usage"] == 0.0:
            return
        assert time.monotonic() < deadline, s
        await asyncio.sleep(0.01)


async def test_error_faults_answer_with_error_bodies_for_count_requests(
        url: str, http: httpx.AsyncClient) -> None:
    await set_fault(http, url, mode="error_503", count=2)
    body = {"prompt": "x", "max_tokens": 1}
    for _ in range(2):
        r = await http.post(url + "/v1/completions", json=body)
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "ServiceUnavailableError"
        assert r.json()["error"]["code"] == 503
    assert (await http.post(url + "/v1/completions", json=body)).status_code == 200
    state = (await http.get(url + "/sim/fault")).json()
    assert state["mode"] == "none" and state["applied"] == 2
    await set_fault(http, url, mode="error_500")
    client = AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    try:
        with pytest.raises(openai.InternalServerError):
            await client.completions.create(model="qwen2.5-14b", prompt="x", max_tokens=1)
    finally:
        await client.close()
    assert (await http.get(url + "/health")).status_code == 200  # only completions fail


async def test_stall_sends_some_chunks_then_nothing(url: str, http: httpx.AsyncClient) -> None:
    await set_fault(http, url, mode="stall", after_chunks=2)
    frames = []
    with pytest.raises(httpx.ReadTimeout):
        async with http.stream("POST", url + "/v1/completions", json=STREAM,
                               timeout=httpx.Timeout(10.0, read=0.5)) as r:
            async for line in r.aiter_lines():
                if line:
                    frames.append(line)
    assert len(frames) == 2 and all(f.startswith("data: {") for f in frames)
    await engine_idle(http, url)  # the client went away: the request was aborted


async def test_die_midstream_resets_the_connection(url: str, http: httpx.AsyncClient) -> None:
    await set_fault(http, url, mode="die_midstream", after_chunks=3, count=1)
    frames = []
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        async with http.stream("POST", url + "/v1/completions", json=STREAM) as r:
            async for line in r.aiter_lines():
                if line:
                    frames.append(line)
    assert len(frames) == 3
    await engine_idle(http, url)
    ok = await http.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200


async def test_die_without_streaming(url: str, http: httpx.AsyncClient) -> None:
    await set_fault(http, url, mode="die_midstream", count=1)
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        await http.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 500})
    await engine_idle(http, url)


async def test_garbage_sse_is_not_json(url: str, http: httpx.AsyncClient) -> None:
    await set_fault(http, url, mode="garbage_sse", after_chunks=1, count=1)
    body = {**STREAM, "max_tokens": 10}
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        raw = b"".join([part async for part in r.aiter_bytes()])
    frames = [f for f in raw.split(b"\n\n") if f]
    assert len(frames) == 2 and frames[0].startswith(b'data: {"id"')
    client = AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    try:
        await set_fault(http, url, mode="garbage_sse", after_chunks=0, count=1)
        with pytest.raises(ValueError):
            stream = await client.completions.create(model="qwen2.5-14b", prompt="x",
                                                     max_tokens=5, stream=True)
            async for _ in stream:
                pass
    finally:
        await client.close()
    await engine_idle(http, url)


async def test_slow_first_byte_delays_the_response(url: str, http: httpx.AsyncClient) -> None:
    """The fault holds the next response 0.3 s, once: a request sent while that one is held is
    answered first, and the held one no sooner than its delay."""
    await set_fault(http, url, mode="slow_first_byte", delay_s=0.3, count=1)
    body = {"prompt": "x", "max_tokens": 1}
    t0 = time.monotonic()
    held = asyncio.create_task(http.post(url + "/v1/completions", json=body))
    for _ in range(1000):  # until the held one has taken the fault
        if (await http.get(url + "/sim/fault")).json()["applied"]:
            break
        await asyncio.sleep(0.01)
    r = await http.post(url + "/v1/completions", json=body)
    assert r.status_code == 200 and not held.done()
    assert (await held).status_code == 200 and time.monotonic() - t0 >= 0.3


async def test_bad_fault_bodies_are_rejected(url: str, http: httpx.AsyncClient) -> None:
    for body in ({"mode": "explode"}, {"mode": "stall", "after_chunks": -1},
                 {"mode": "stall", "count": 0}, {"mode": "stall", "extra": 1}, []):
        r = await http.post(url + "/sim/fault", json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == 400
    assert (await set_fault(http, url, mode="none"))["mode"] == "none"
