"""P/D disaggregation over HTTP: a real prefill and a real decode simulator, vLLM NIXL and SGLang."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import orjson
import pytest

from simulator import Fleet
from simulator.pd import PdOptions, transfer_seconds

MODEL = "qwen2.5-14b"
SPEEDUP = 200.0
PROMPT = "tell me a story " * 200  # ~3200 byte tokens


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=20.0) as client:
        yield client


def pd_fleet(role: str, protocol: str = "vllm-nixl", **kw: Any) -> Fleet:
    return Fleet(n=1, model=MODEL, gpu="a100-80g", speedup=SPEEDUP,
                 pd=PdOptions(role, protocol, **kw))  # type: ignore[arg-type]


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def pd_stats(http: httpx.AsyncClient, url: str) -> dict[str, Any]:
    return dict((await http.get(url + "/sim/stats")).json()["pd"])


async def kv_usage(http: httpx.AsyncClient, url: str) -> float:
    return float((await http.get(url + "/sim/stats")).json()["kv_usage"])


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
    assert m is not None, name
    return float(m.group(1))


P_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}


async def prefill(http: httpx.AsyncClient, url: str, prompt: str = PROMPT) -> dict[str, Any]:
    r = await http.post(url + "/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 1, "stream": False,
        "kv_transfer_params": P_PARAMS}, headers={"X-Request-Id": "rid-1"})
    assert r.status_code == 200, r.text
    return dict(r.json())


async def sse_lines(resp: httpx.Response) -> list[dict[str, Any]]:
    out = []
    async for line in resp.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(orjson.loads(line[6:]))
    return out


async def test_nixl_prefill_returns_params_and_decode_streams_then_p_frees(
        http: httpx.AsyncClient) -> None:
    async with pd_fleet("prefill") as p, pd_fleet("decode") as d:
        answer = await prefill(http, p.urls[0])
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == 1
        kv = answer["kv_transfer_params"]
        assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
        assert isinstance(kv["remote_block_ids"], list) and len(kv["remote_block_ids"]) == 1
        assert all(isinstance(b, int) for b in kv["remote_block_ids"][0])
        assert len(kv["remote_block_ids"][0]) == -(-answer["usage"]["prompt_tokens"] // 16)
        assert isinstance(kv["remote_engine_id"], str) and kv["remote_request_id"]
        assert kv["remote_host"] == "127.0.0.1" and isinstance(kv["remote_port"], int)
        assert kv["tp_size"] == 1 and kv["transfer_mode"] == "pull"
        assert (await pd_stats(http, p.urls[0]))["held_blocks"] == len(kv["remote_block_ids"][0])
        async with http.stream("POST", d.urls[0] + "/v1/completions", json={
                "model": MODEL, "prompt": PROMPT, "max_tokens": 20, "stream": True,
                "stream_options": {"include_usage": True}, "kv_transfer_params": kv}) as resp:
            assert resp.status_code == 200
            chunks = await sse_lines(resp)
        assert sum(1 for c in chunks if c["choices"]) == 20
        assert chunks[-1]["usage"]["completion_tokens"] == 20
        assert "kv_transfer_params" not in chunks[0]
        ps, ds = await pd_stats(http, p.urls[0]), await pd_stats(http, d.urls[0])
        assert ps["held_blocks"] == 0 and ps["held_requests"] == 0  # freed on D's read
        assert ds["transfers"] == 1 and ds["failed"] == 0 and ds["bytes"] > 0
        text = (await http.get(d.urls[0] + "/metrics")).text
        assert metric(text, "vllm:nixl_xfer_time_seconds_count") == 1
        assert metric(text, "vllm:external_prefix_cache_hits_total") == \
            answer["usage"]["prompt_tokens"]
        assert await kv_usage(http, d.urls[0]) == 0.0  # finished: D's blocks are released


async def test_nixl_decode_with_missing_keys_recomputes_locally(http: httpx.AsyncClient) -> None:
    async with pd_fleet("decode") as d:
        r = await http.post(d.urls[0] + "/v1/completions", json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 3,
            "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "x"}})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        ds = await pd_stats(http, d.urls[0])
        assert ds["recomputed"] == 1 and ds["transfers"] == 0


async def test_nixl_stale_params_fail_with_500_and_free_decode_blocks(
        http: httpx.AsyncClient) -> None:
    async with pd_fleet("prefill") as p, pd_fleet("decode") as d:
        kv = (await prefill(http, p.urls[0]))["kv_transfer_params"]
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": kv}
        assert (await http.post(d.urls[0] + "/v1/completions", json=body)).status_code == 200
        again = await http.post(d.urls[0] + "/v1/completions", json=body)  # already read
        assert again.status_code == 500
        err = again.json()["error"]
        assert err["type"] == "InternalServerError" and "kv_load_failure_policy" in err["message"]
        assert (await pd_stats(http, d.urls[0]))["failed"] == 1
        assert await kv_usage(http, d.urls[0]) == 0.0


async def test_nixl_lease_expiry_frees_p_and_counts(http: httpx.AsyncClient) -> None:
    async with pd_fleet("prefill", lease_s=2.0) as p, \
            pd_fleet("decode", load_failure_policy="recompute") as d:
        kv = (await prefill(http, p.urls[0]))["kv_transfer_params"]
        await until(lambda: _held_zero(http, p.urls[0]))
        text = (await http.get(p.urls[0] + "/metrics")).text
        assert metric(text, "vllm:nixl_num_kv_expired_reqs_total") == 1
        assert await kv_usage(http, p.urls[0]) == 0.0
        r = await http.post(d.urls[0] + "/v1/completions", json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": kv})
        assert r.status_code == 200  # policy recompute: a slow local prefill, HTTP 200
        ds = await pd_stats(http, d.urls[0])
        assert ds["failed"] == 1 and ds["recomputed"] == 1 and ds["transfers"] == 0


async def _held_zero(http: httpx.AsyncClient, url: str) -> bool:
    return (await pd_stats(http, url))["held_blocks"] == 0


async def test_decode_abort_frees_its_blocks(http: httpx.AsyncClient) -> None:
    async with pd_fleet("prefill") as p, pd_fleet("decode") as d:
        kv = (await prefill(http, p.urls[0]))["kv_transfer_params"]
        async with http.stream("POST", d.urls[0] + "/v1/completions", json={
                "model": MODEL, "prompt": PROMPT, "max_tokens": 4000, "stream": True,
                "kv_transfer_params": kv}) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    break
            assert await kv_usage(http, d.urls[0]) > 0
        await until(lambda: _idle(http, d.urls[0]))
        assert (await http.get(d.urls[0] + "/sim/stats")).json()["requests_aborted"] == 1


async def _idle(http: httpx.AsyncClient, url: str) -> bool:
    return await kv_usage(http, url) == 0.0


async def test_transfer_time_is_bytes_over_bandwidth(http: httpx.AsyncClient) -> None:
    async with pd_fleet("prefill") as p, pd_fleet("decode", kv_link_gbps=10.0) as d:
        answer = await prefill(http, p.urls[0])
        tokens = answer["usage"]["prompt_tokens"]
        r = await http.post(d.urls[0] + "/v1/completions", json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 2,
            "kv_transfer_params": answer["kv_transfer_params"]})
        assert r.status_code == 200
        per_token = d.replicas[0].engine.perf.kv_bytes_per_token
        assert per_token == 48 * 8 * 128 * 2 * 2  # layers x kv_heads x head_dim x (K,V) x bf16
        text = (await http.get(d.urls[0] + "/metrics")).text
        # the whole prompt's blocks, rounded up to full blocks, cross the link once
        pulled = -(-tokens // 16) * 16
        want = transfer_seconds(min(pulled, tokens), per_token, 10.0)
        assert metric(text, "vllm:nixl_xfer_time_seconds_sum") == pytest.approx(want, rel=1e-6)
        assert metric(text, "vllm:nixl_bytes_transferred_sum") == pytest.approx(
            min(pulled, tokens) * per_token)
        assert want == pytest.approx(tokens * per_token * 8 / 10e9)


async def test_sglang_bootstrap_flow(http: httpx.AsyncClient) -> None:
    async with pd_fleet("prefill", "sglang") as p, pd_fleet("decode", "sglang") as d:
        info = (await http.get(p.urls[0] + "/server_info")).json()
        assert info["disaggregation_mode"] == "prefill"
        assert (await http.get(d.urls[0] + "/get_server_info")).json()[
            "disaggregation_mode"] == "decode"
        body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": 12, "stream": True, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": info["disaggregation_bootstrap_port"],
                "bootstrap_room": 2 ** 62 + 5}

        async def decode() -> list[dict[str, Any]]:
            async with http.stream("POST", d.urls[0] + "/v1/chat/completions",
                                   json=body) as resp:
                assert resp.status_code == 200
                return await sse_lines(resp)

        chunks, p_resp = await asyncio.gather(
            decode(), http.post(p.urls[0] + "/v1/chat/completions",
                                json={**body, "stream": False}))
        assert p_resp.status_code == 200
        assert p_resp.json()["usage"]["completion_tokens"] == 1  # P: prefill and one token
        content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
        assert len(content) == 12
        assert (await pd_stats(http, d.urls[0]))["transfers"] == 1
        assert (await pd_stats(http, p.urls[0]))["held_blocks"] == 0


async def test_sglang_decode_without_its_prefill_times_out_500(http: httpx.AsyncClient) -> None:
    async with pd_fleet("prefill", "sglang", bootstrap_timeout_s=2.0) as p, \
            pd_fleet("decode", "sglang") as d:
        port = (await http.get(p.urls[0] + "/server_info")).json()[
            "disaggregation_bootstrap_port"]
        r = await http.post(d.urls[0] + "/v1/completions", json={
            "model": MODEL, "prompt": "hi", "max_tokens": 2, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": port, "bootstrap_room": 7})
        assert r.status_code == 500 and r.json()["error"]["code"] == 500
        assert await kv_usage(http, d.urls[0]) == 0.0
        missing = await http.post(p.urls[0] + "/v1/completions",
                                  json={"model": MODEL, "prompt": "hi"})
        assert missing.status_code == 400


async def test_cli_roles_serve_the_nixl_flow_between_processes(http: httpx.AsyncClient) -> None:
    from simulator.fleet import simulated_fleet

    async with simulated_fleet(1, "--role", "prefill", "--speedup", "200") as p, \
            simulated_fleet(1, "--role", "decode", "--speedup", "200",
                            "--kv-link-gbps", "100") as d:
        assert (await http.get(p[0] + "/server_info")).json()["disaggregation_mode"] == "prefill"
        kv = (await prefill(http, p[0]))["kv_transfer_params"]
        r = await http.post(d[0] + "/v1/completions", json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 5, "kv_transfer_params": kv})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert (await pd_stats(http, d[0]))["transfers"] == 1
        assert (await pd_stats(http, p[0]))["held_blocks"] == 0
