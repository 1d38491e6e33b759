"""Multi-LoRA in the simulator (simulator/lora.py): slots, loads, the metric, the HTTP surface."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from simulator.des import Cluster, RoundRobin, SimRequest, run
from simulator.fleet import Fleet
from simulator.lora import LoraConfig

PROMPT = list(range(2000, 2600))


def _req(i: int, t: float, adapter: str | None, prompt: list[int] = PROMPT) -> SimRequest:
    meta: dict[str, Any] = {} if adapter is None else {"lora": adapter}
    return SimRequest(f"r{i}", t, prompt, 16, meta=meta)


async def test_a_load_stalls_the_step_that_needs_it() -> None:
    ttft: dict[float, float] = {}
    for load_s in (0.0, 0.5):
        cluster = Cluster(1, lora=LoraConfig(("a",), load_s=load_s))
        other = list(range(5000, 5600))  # no prefix hit either
        result = await run([_req(0, 0.0, "a"), _req(1, 5.0, "a", other)], cluster, RoundRobin())
        ttft[load_s] = result.records[0].ttft_s
        assert cluster.engines[0].lora is not None and cluster.engines[0].lora.loads == 1
        # the second request finds the adapter on the GPU: no load, no stall
        assert abs(result.records[0].ttft_s - load_s - result.records[1].ttft_s) < 0.01
    assert abs(ttft[0.5] - ttft[0.0] - 0.5) < 1e-6


async def test_one_slot_makes_the_other_adapter_wait_and_evicts_lru() -> None:
    cluster = Cluster(1, lora=LoraConfig(("a", "b", "c"), max_loras=1, load_s=0.1))
    reqs = [_req(0, 0.0, "a"), _req(1, 0.0, "b"), _req(2, 0.0, "a"), _req(3, 0.0, None)]
    result = await run(reqs, cluster, RoundRobin())
    a0, b, a1, base = result.records
    # the second "a" and the base-model request are admitted past the waiting "b"
    assert a1.first_token_s < b.first_token_s and base.first_token_s < b.first_token_s
    assert b.first_token_s >= a0.finish_s and b.first_token_s >= a1.finish_s  # one slot: waits
    lora = cluster.engines[0].lora
    assert lora is not None and lora.loads == 2 and list(lora.gpu) == ["b"]  # "a" was evicted


async def test_blocks_of_different_adapters_never_share_the_cache() -> None:
    cluster = Cluster(1, lora=LoraConfig(("a", "b")))
    reqs = [_req(0, 0.0, "a"), _req(1, 2.0, "b"), _req(2, 4.0, "a"), _req(3, 6.0, None)]
    result = await run(reqs, cluster, RoundRobin())
    assert [r.cached_tokens > 0 for r in result.records] == [False, False, True, False]


async def _get(h: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with h.get(url) as res:
        return res.status, await res.text()


async def _post(h: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, str, str]:
    async with h.post(url, json=body) as res:
        return res.status, res.headers.get("content-type", ""), await res.text()


def _info_lines(metrics: str) -> list[str]:
    return [line for line in metrics.splitlines() if line.startswith("vllm:lora_requests_info{")]


async def test_models_metric_and_answers_as_vllm_gives_them() -> None:
    async with Fleet(n=1, speedup=1000.0, lora=LoraConfig(("sql",), max_loras=3)) as fleet:
        url = fleet.urls[0]
        async with aiohttp.ClientSession() as h:
            async with h.get(url + "/v1/models") as res:
                cards = {c["id"]: c for c in (await res.json())["data"]}
            base = fleet.replicas[0].model_name
            assert cards[base]["parent"] is None
            assert cards["sql"]["parent"] == base and cards["sql"]["root"] == "/adapters/sql"
            assert _info_lines((await _get(h, url + "/metrics"))[1]) == []  # absent before use
            body = {"model": "sql", "prompt": "select", "max_tokens": 200, "stream": True}
            async with h.post(url + "/v1/completions", json=body) as res:
                await res.content.readline()  # first chunk: the request is in flight
                lines = _info_lines((await _get(h, url + "/metrics"))[1])
                assert any('running_lora_adapters="sql"' in x and 'waiting_lora_adapters="sql"'
                           in x and 'max_lora="3"' in x for x in lines)  # fmt: skip
                assert float(lines[-1].rsplit(" ", 1)[1]) > 1.7e9  # the value is a timestamp
                await res.read()
            lines = _info_lines((await _get(h, url + "/metrics"))[1])
            newest = max(lines, key=lambda x: float(x.rsplit(" ", 1)[1]))
            assert 'running_lora_adapters=""' in newest  # idle: in neither label
            assert any('"sql"' in x for x in lines)  # the old series lingers
            status, _, _ = await _post(h, url + "/v1/completions", {**body, "model": "nope"})
            assert status == 404
            async with h.post(url + "/v1/completions", json={**body, "stream": False}) as res:
                assert (await res.json())["model"] == "sql"  # the adapter's name echoed
            # no runtime updating: the routes do not exist
            status, _, _ = await _post(h, url + "/v1/load_lora_adapter",
                                       {"lora_name": "x", "lora_path": "/x"})  # fmt: skip
            assert status == 404


async def test_runtime_load_and_unload_behind_the_flag() -> None:
    lora = LoraConfig((), runtime_updating=True)
    async with Fleet(n=1, speedup=1000.0, lora=lora) as fleet:
        url = fleet.urls[0]
        async with aiohttp.ClientSession() as h:
            load = {"lora_name": "poet", "lora_path": "/adapters/poet"}
            status, ctype, text = await _post(h, url + "/v1/load_lora_adapter", load)
            assert status == 200 and ctype.startswith("text/plain")
            assert text == "Success: LoRA adapter 'poet' added successfully."
            status, _, text = await _post(h, url + "/v1/load_lora_adapter", load)
            assert status == 400 and "has already been loaded" in text
            status, _, _ = await _post(h, url + "/v1/load_lora_adapter", {"lora_name": "x"})
            assert status == 400
            lora_state = fleet.replicas[0].engine.lora
            assert lora_state is not None
            lora_state.config = LoraConfig((), runtime_updating=True, missing=("/nowhere",))
            status, _, text = await _post(h, url + "/v1/load_lora_adapter",
                                          {"lora_name": "gone", "lora_path": "/nowhere"})  # fmt: skip
            assert status == 404  # vLLM's: the path holds no adapter
            assert "Loading lora gone failed: No adapter found for <path>" in text  # vLLM's words
            assert '"NotFoundError"' in text
            body = {"model": "poet", "prompt": "a rose", "max_tokens": 3}
            assert (await _post(h, url + "/v1/completions", body))[0] == 200
            status, _, text = await _post(h, url + "/v1/unload_lora_adapter", {"lora_name": "poet"})
            assert status == 200 and "removed successfully" in text
            status, _, _ = await _post(h, url + "/v1/unload_lora_adapter", {"lora_name": "poet"})
            assert status == 404
            assert (await _post(h, url + "/v1/completions", body))[0] == 404
            # unload forgets the name; the GPU copy stays until LRU eviction (vllm#54839)
            assert fleet.replicas[0].engine.lora is not None
            assert "poet" in fleet.replicas[0].engine.lora.gpu
    await asyncio.sleep(0)
