"""A running simulated replica, driven with the openai SDK and raw HTTP on real sockets."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import openai
import orjson
import pytest
from openai import AsyncOpenAI

from simulator import Fleet
from simulator.kv_cache import block_hashes

MODEL = "qwen2.5-14b"
CHAT = [{"role": "system", "content": "You are terse. " * 40},
        {"role": "user", "content": "Say something."}]


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    async with Fleet(n=2, model=MODEL, gpu="a100-80g", speedup=2000.0, seed=0) as f:
        yield f


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10.0) as client:
        yield client


@pytest.fixture
async def sdk(fleet: Fleet) -> AsyncIterator[AsyncOpenAI]:
    client = AsyncOpenAI(base_url=fleet.urls[0] + "/v1", api_key="sk-sim", max_retries=0)
    yield client
    await client.close()


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def stats(http: httpx.AsyncClient, url: str) -> dict[str, Any]:
    return (await http.get(url + "/sim/stats")).json()


async def test_chat_completion_honours_max_tokens_and_reports_cached_tokens(
        sdk: AsyncOpenAI, fleet: Fleet, http: httpx.AsyncClient) -> None:
    first = await sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12)
    choice = first.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert first.usage is not None and first.usage.completion_tokens == 12
    tokenized = (await http.post(fleet.urls[0] + "/tokenize", json={"messages": CHAT})).json()
    assert first.usage.prompt_tokens == tokenized["count"] == len(tokenized["tokens"])
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = await sdk.chat.completions.create(model=MODEL, messages=CHAT,
                                               max_completion_tokens=3)
    assert second.usage.completion_tokens == 3
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == (second.usage.prompt_tokens - 1) // 16 * 16 > 0
    assert first.id.startswith("chatcmpl-") and first.model == MODEL


async def test_chat_stream_is_vllm_shaped(sdk: AsyncOpenAI) -> None:
    stream = await sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6,
                                               stream=True,
                                               stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks[1:] if c.choices]
    assert len(content) == 6 and all(c.choices[0].delta.content for c in content)
    assert [c.choices[0].finish_reason for c in content] == [None] * 5 + ["length"]
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage is not None
    assert usage.usage.completion_tokens == 6
    assert usage.usage.prompt_tokens_details.cached_tokens is not None


async def test_raw_sse_frames(fleet: Fleet, http: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 3, "stream": True}
    async with http.stream("POST", fleet.urls[0] + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join([part async for part in r.aiter_bytes()])
    frames = raw.split(b"\n\n")
    assert frames[-2:] == [b"data: [DONE]", b""]
    payloads = [orjson.loads(f.removeprefix(b"data: ")) for f in frames[:-2]]
    assert all(f.startswith(b"data: ") for f in frames[:-1])
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(p["object"] == "chat.completion.chunk" for p in payloads)
    assert "usage" not in payloads[-1]  # no usage chunk unless asked for


async def test_completions_accept_every_prompt_shape(sdk: AsyncOpenAI) -> None:
    for prompt, n in (("hello world", 1), (["a b", "c d"], 2), ([5, 6, 7], 1),
                      ([[5, 6, 7], [8, 9]], 2)):
        r = await sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
        assert [c.index for c in r.choices] == list(range(n))
        assert all(c.finish_reason == "length" and c.text for c in r.choices)
        assert r.usage.completion_tokens == 4 * n
    assert (await sdk.completions.create(model=MODEL, prompt=[5, 6, 7],
                                         max_tokens=1)).usage.prompt_tokens == 3
    stream = await sdk.completions.create(model=MODEL, prompt=["x", "y"], max_tokens=3,
                                          stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    per_choice = {0: 0, 1: 0}
    for c in chunks[:-1]:
        per_choice[c.choices[0].index] += 1
    assert per_choice == {0: 3, 1: 3} and chunks[-1].usage.completion_tokens == 6


async def test_output_length_distribution_when_max_tokens_is_absent(
        http: httpx.AsyncClient) -> None:
    async with Fleet(n=1, speedup=5000.0, output_lengths="fixed:5") as f:
        r = (await http.post(f.urls[0] + "/v1/completions", json={"prompt": "hi"})).json()
    assert r["usage"]["completion_tokens"] == 5 and r["choices"][0]["finish_reason"] == "stop"


async def test_errors_have_vllm_shape(sdk: AsyncOpenAI, fleet: Fleet,
                                      http: httpx.AsyncClient) -> None:
    url = fleet.urls[0]
    r = await http.post(url + "/v1/chat/completions", json={"model": "gpt-x", "messages": CHAT})
    assert r.status_code == 404
    assert r.json() == {"error": {"message": f"The model `gpt-x` does not exist. Valid aliases: "
                                  f"{MODEL}.", "type": "NotFoundError", "param": "model",
                                  "code": 404}}
    # vLLM's request-model validation says "Bad Request"; its own checks say BadRequestError
    for body, kind in ((b"{not json", "Bad Request"), (b"[]", "Bad Request"),
                       (b'{"messages": []}', "BadRequestError"),
                       (b'{"messages": [{"content": 1}]}', "Bad Request")):
        r = await http.post(url + "/v1/chat/completions", content=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == 400
        assert r.json()["error"]["type"] == kind, body
    for body2 in ({"prompt": {"a": 1}}, {"prompt": [1, "x"]}, {"prompt": "x", "max_tokens": 0},
                  {"prompt": [-1]}, {"prompt": "x", "n": 2}):
        r = await http.post(url + "/v1/completions", json=body2)
        assert r.status_code == 400, body2
    too_long = {"prompt": list(range(16, 32786)), "max_tokens": 1}  # 32,770 > 32,768
    r = await http.post(url + "/v1/completions", json=too_long)
    assert r.status_code == 400 and "maximum context length is 32768" in r.json()["error"]["message"]
    # a prompt that fits: max_tokens is cut to what the context has left, as vLLM does
    cut = {"prompt": list(range(16, 32016)), "max_tokens": 1000}
    r = await http.post(url + "/v1/completions", json=cut)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 32768 - 32000
    with pytest.raises(openai.NotFoundError):
        await sdk.chat.completions.create(model="nope", messages=CHAT)
    with pytest.raises(openai.BadRequestError):
        await sdk.completions.create(model=MODEL, prompt=[], max_tokens=1)


async def test_models_health_tokenize(fleet: Fleet, http: httpx.AsyncClient,
                                      sdk: AsyncOpenAI) -> None:
    url = fleet.urls[1]
    assert (await http.get(url + "/health")).status_code == 200
    models = (await http.get(url + "/v1/models")).json()
    assert models["object"] == "list"
    card = models["data"][0]
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "vllm"
    assert card["max_model_len"] == 32768
    assert [m.id async for m in sdk.models.list()] == [MODEL]
    tok = (await http.post(url + "/tokenize", json={"prompt": "abcdefgh"})).json()
    assert tok == {"count": 2, "max_model_len": 32768, "tokens": tok["tokens"], "token_strs": None}
    assert (await http.post(url + "/tokenize", json={})).status_code == 400


async def test_served_model_name_override(http: httpx.AsyncClient) -> None:
    async with Fleet(n=1, speedup=5000.0, served_model_name="my-model") as f:
        ok = await http.post(f.urls[0] + "/v1/completions",
                             json={"model": "my-model", "prompt": "x", "max_tokens": 1})
        bad = await http.post(f.urls[0] + "/v1/completions",
                              json={"model": MODEL, "prompt": "x", "max_tokens": 1})
    assert ok.status_code == 200 and ok.json()["model"] == "my-model"
    assert bad.status_code == 404


async def test_metrics_use_vllm_names_types_and_labels(fleet: Fleet, sdk: AsyncOpenAI,
                                                       http: httpx.AsyncClient) -> None:
    for _ in range(2):
        await sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5)
    text = (await http.get(fleet.urls[0] + "/metrics")).text
    types = {"vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
             "vllm:kv_cache_usage_perc": "gauge", "vllm:prefix_cache_queries": "counter",
             "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter",
             "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
             "vllm:request_success": "counter",
             "vllm:time_to_first_token_seconds": "histogram",
             "vllm:inter_token_latency_seconds": "histogram",
             "vllm:e2e_request_latency_seconds": "histogram",
             "vllm:request_queue_time_seconds": "histogram",
             "vllm:request_prefill_time_seconds": "histogram",
             "vllm:request_decode_time_seconds": "histogram"}
    for name, kind in types.items():
        assert f"# TYPE {name}{'_total' if kind == 'counter' else ''} {kind}" in text or \
            f"# TYPE {name} {kind}" in text, name
    label = f'{{engine="0",model_name="{MODEL}"}}'
    assert f"vllm:generation_tokens_total{label} 10.0" in text
    assert f"vllm:time_to_first_token_seconds_count{label} 2.0" in text
    assert f"vllm:inter_token_latency_seconds_count{label} 8.0" in text
    assert ('vllm:request_success_total{engine="0",finished_reason="length",'
            f'model_name="{MODEL}"}} 2.0') in text
    hits = [line for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total")]
    assert hits and float(hits[0].split()[-1]) > 0


async def test_tokens_arrive_at_simulated_step_times(http: httpx.AsyncClient) -> None:
    """Tokens come no sooner than the simulated steps allow (wall = simulated / speedup), and no
    later: the same stream at a tenth of the speedup, side by side, takes several times longer
    (a fixed lag, or a clock that ignored the speedup, would bring the two together)."""
    body = {"prompt": list(range(16, 1016)), "max_tokens": 40, "stream": True}

    async def timed(url: str) -> list[float]:
        t0 = time.monotonic()
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            return [time.monotonic() - t0 async for _ in r.aiter_lines() if _]

    speedup = 20.0
    async with Fleet(n=1, speedup=speedup) as f, Fleet(n=1, speedup=speedup / 10) as slow:
        stamps, slow_stamps = await asyncio.gather(timed(f.urls[0]), timed(slow.urls[0]))
        s = await stats(http, f.urls[0])
    busy_wall = s["busy_time_s"] / speedup  # about 40 steps of ~17 ms simulated
    assert s["steps"] == 40 and busy_wall > 0.025
    assert stamps[-1] >= 0.9 * busy_wall
    assert slow_stamps[-1] > 3 * stamps[-1], (slow_stamps[-1], stamps[-1])  # ~10x
    first_step_wall = (stamps[1] - 0.0)
    assert first_step_wall >= 0.9 * (0.001 + 1000 * 0.000189) / speedup


async def test_client_disconnect_aborts_the_request_and_frees_blocks(
        http: httpx.AsyncClient) -> None:
    async with Fleet(n=1, speedup=50.0) as f:
        url = f.urls[0]
        body = {"prompt": list(range(16, 2016)), "max_tokens": 5000, "stream": True}
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += bool(line)
                if seen == 3:
                    break
        assert (await stats(http, url))["requests_served"] == 0

        async def aborted() -> bool:
            s = await stats(http, url)
            return s["requests_aborted"] == 1 and s["running"] == 0 and s["kv_usage"] == 0.0

        await until(aborted)


async def test_sim_stats_reset_and_cache_dump(fleet: Fleet, sdk: AsyncOpenAI,
                                              http: httpx.AsyncClient) -> None:
    url = fleet.urls[0]
    await sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    await sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    s = await stats(http, url)
    assert s["requests_served"] == 2 and s["prefix_hit_tokens"] > 0
    assert s["prompt_tokens"] == 2 * (await http.post(url + "/tokenize", json={
        "messages": CHAT})).json()["count"]
    assert s["busy_time_s"] > 0 and s["running"] == 0 and s["waiting"] == 0
    assert s["cached_blocks"] > 0 and 0 < s["hit_ratio"] < 1
    tokens = (await http.post(url + "/tokenize", json={"messages": CHAT})).json()["tokens"]
    dump = (await http.get(url + "/sim/cache")).json()
    assert dump["block_size"] == 16
    cached = {b["hash"] for b in dump["blocks"]}
    assert set(block_hashes(tokens, 16)) <= cached
    reset = (await http.post(url + "/sim/stats/reset")).json()
    assert reset["requests_served"] == 0 and reset["prompt_tokens"] == 0
    assert reset["cached_blocks"] == s["cached_blocks"]  # a reset keeps the cache warm
    other = await stats(http, fleet.urls[1])
    assert other["requests_served"] == 0


async def test_fleet_kill_and_restart_on_the_same_port(fleet: Fleet, http: httpx.AsyncClient) -> None:
    url = fleet.urls[1]
    body = {"prompt": "warm the cache " * 20, "max_tokens": 2}
    assert (await http.post(url + "/v1/completions", json=body)).status_code == 200
    await fleet.stop(1)
    with pytest.raises(httpx.ConnectError):
        await http.get(url + "/health")
    await fleet.start(1)
    assert fleet.urls[1] == url
    assert (await http.get(url + "/health")).status_code == 200
    s = await stats(http, url)
    assert s["requests_served"] == 0 and s["cached_blocks"] == 0
    assert (await http.post(url + "/v1/completions", json=body)).status_code == 200


async def test_a_killed_replica_drops_streams_in_flight(http: httpx.AsyncClient) -> None:
    async with Fleet(n=1, speedup=50.0) as f:
        body = {"prompt": "x", "max_tokens": 5000, "stream": True}
        with pytest.raises(httpx.TransportError):
            async with http.stream("POST", f.urls[0] + "/v1/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    await f.stop(0)


async def test_priority_scheduling_accepts_priorities(http: httpx.AsyncClient) -> None:
    async with Fleet(n=1, speedup=5000.0, scheduling_policy="priority") as f:
        r = await http.post(f.urls[0] + "/v1/completions",
                            json={"prompt": "x", "max_tokens": 2, "priority": -5})
    assert r.status_code == 200


def two_free_ports() -> int:
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return int(port)
    raise RuntimeError("no two consecutive free ports")


async def test_fleet_on_consecutive_ports(http: httpx.AsyncClient) -> None:
    base = two_free_ports()
    async with Fleet(n=2, speedup=5000.0, base_port=base) as f:
        assert f.urls == [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"]
        for url in f.urls:
            assert (await http.get(url + "/health")).status_code == 200
