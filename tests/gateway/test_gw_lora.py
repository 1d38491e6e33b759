"""LoRA adapters through a real gateway to simulated vLLM replicas (docs/lora.md).

The replicas are the project's simulator with multi-LoRA on (simulator/lora.py): `/v1/models`
lists their adapters with `parent`, `vllm:lora_requests_info` is exposed as vLLM does, and the
runtime load/unload routes exist only when asked for. Also the metric's parsing on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import orjson
import pytest

from bench.harness import lifespan_done, read_body, stop_all
from gateway import create_app, parse_config
from gateway.config import ConfigError
from gateway.fleet.lora import (
    ReplicaAdapters,
    adapters_of,
    parse_lora_info,
    sglang_adapters,
    sglang_names,
    unserved,
)
from gateway.forwarding.lora_placement import LoraPlacement
from gateway.runtime.gateway import Gateway
from simulator.fleet import Fleet
from simulator.lora import LoraConfig
from tests.support import Served, poll_until, start_server

BASE = "qwen2.5-14b"


def _pool(fleet: Fleet, **extra: Any) -> dict[str, Any]:
    return {
        "pools": {
            "chat": {
                "replicas": [{"url": u, "name": f"r{i}"} for i, u in enumerate(fleet.urls)],
                "health": {"interval_s": 0.2},
                "scrape": {"interval_s": 0.1},
                "lora": {"refresh_s": 0.2, **extra},
            }
        },
        "tracing": {"exporter": "none"},
    }


@contextlib.asynccontextmanager
async def _gateway(cfg: dict[str, Any]) -> AsyncIterator[tuple[Any, Served]]:
    app = create_app(parse_config(cfg))
    gw = await start_server(app, lifespan="on")
    try:
        yield app, gw
    finally:
        await gw.stop()


async def _complete(url: str, model: str) -> tuple[int, dict[str, Any]]:
    body = {"model": model, "prompt": "hello adapters " * 20, "max_tokens": 4}
    async with aiohttp.ClientSession() as h, h.post(url + "/v1/completions", json=body) as res:
        return res.status, await res.json()


def test_the_newest_series_wins_and_names_in_flight_adapters() -> None:
    text = (
        "# HELP vllm:lora_requests_info Running stats on lora requests.\n"
        "# TYPE vllm:lora_requests_info gauge\n"
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",'
        'waiting_lora_adapters="a,b"} 1.7382173358407154e+09\n'
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="",'
        'waiting_lora_adapters=""} 1.7382173398407154e+09\n'
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="c",'
        'waiting_lora_adapters="c"} 1.7382173368407154e+09\n'
    )
    # the value is a timestamp: the series written last (all idle) is the current state, not
    # the one listed last, nor the union of every lingering series
    assert parse_lora_info(text) == (frozenset(), 4)
    newest_busy = text.replace("1.7382173368407154e+09", "1.7382173408407154e+09")
    assert parse_lora_info(newest_busy) == (frozenset({"c"}), 4)
    assert parse_lora_info("vllm:num_requests_running 3\n") is None  # absent: no info, no error


def test_models_cards_with_a_parent_are_adapters() -> None:
    cards = [{"id": BASE, "parent": None}, {"id": "sql", "parent": BASE, "root": "/x"}]
    assert adapters_of(cards) == (frozenset({"sql"}), frozenset({BASE}))
    plain = ReplicaAdapters()
    found = adapters_of([{"id": BASE, "parent": None}])
    assert found == (frozenset(), frozenset({BASE}))
    plain.set_models(*found)
    assert plain.view() is None  # no adapter: routing sees no LoRA, as before
    assert not unserved([plain], "anything")


def test_an_idle_adapter_leaves_the_metric_but_stays_resident() -> None:
    a = ReplicaAdapters()
    a.set_models(frozenset({"x", "y"}), frozenset({BASE}))
    a.set_metric(frozenset({"x"}), 2, None)
    view = a.view()
    assert view is not None and view.max_loras == 2 and view.inflight == {"x": 1}
    a.set_metric(frozenset(), 2, None)  # no request in flight: gone from the gauge
    view = a.view()
    assert view is not None and view.inflight == {} and view.resident == ("x",)


async def test_adapters_go_only_where_they_are_served_and_unknown_ones_get_404() -> None:
    lora = LoraConfig(("sql", "chat"), max_loras=2)
    async with Fleet(n=2, speedup=1000.0, lora=lora) as fleet:
        fleet.replicas[1].engine.lora.registered = {"poet": "/adapters/poet"}  # type: ignore[union-attr]
        async with _gateway(_pool(fleet)) as (app, served):
            replicas = app.gateway.all_replicas()
            await poll_until(lambda: all(r.lora.served for r in replicas))
            for _ in range(4):
                status, body = await _complete(served.url, "poet")
                assert status == 200 and body["model"] == "poet"  # the adapter's name echoed
            assert fleet.replicas[1].engine.counters.requests_received == 4
            assert fleet.replicas[0].engine.counters.requests_received == 0
            status, _ = await _complete(served.url, "sql")
            assert status == 200 and fleet.replicas[0].engine.counters.requests_received == 1
            status, body = await _complete(served.url, BASE)  # the base model: either replica
            assert status == 200
            status, body = await _complete(served.url, "no-such-adapter")
            assert status == 404
            assert body["error"]["code"] == "model_not_found"
            assert "no-such-adapter" in body["error"]["message"]
            assert "no replica of pool 'chat' serves it" in body["error"]["message"]  # ours
            assert sum(r.engine.counters.requests_received for r in fleet.replicas) == 6
            # the gateway learned the replica's slots from vllm:lora_requests_info
            await poll_until(lambda: replicas[1].lora.max_loras == 2)


async def test_managed_placement_loads_before_forwarding_and_unloads_idle_ones() -> None:
    lora = LoraConfig((), max_loras=2, runtime_updating=True)
    adapters = {"sql": "/adapters/sql", "poet": "/adapters/poet"}
    async with Fleet(n=2, speedup=1000.0, lora=lora) as fleet:
        cfg = _pool(fleet, manage=True, adapters=adapters, idle_unload_s=0.4)
        async with _gateway(cfg) as (app, served):
            replicas = app.gateway.all_replicas()
            await poll_until(lambda: all(r.lora.base for r in replicas))
            status, body = await _complete(served.url, "sql")
            assert status == 200, body
            assert body["model"] == "sql"

            def holders() -> int:
                return sum("sql" in r.engine.lora.registered for r in fleet.replicas)  # type: ignore[union-attr]

            assert holders() == 1  # loaded on the pick, before the request was forwarded
            for _ in range(3):  # one at a time: demand for one replica, it stays there
                assert (await _complete(served.url, "sql"))[0] == 200
            assert holders() == 1
            placement = app.pipeline.lora
            assert placement.loads == 1
            status, body = await _complete(served.url, "unmanaged")
            assert status == 404 and "unmanaged" in body["error"]["message"]
            # idle past idle_unload_s: the sweep on a later request unloads it
            await asyncio.sleep(0.5)
            assert (await _complete(served.url, "poet"))[0] == 200
            await poll_until(lambda: holders() == 0, timeout_s=5.0)
            # the engine drops the adapter before its answer reaches the gateway
            await poll_until(lambda: placement.unloads > 0, timeout_s=5.0)
            assert placement.unloads == 1
            await poll_until(lambda: all("sql" not in r.lora.served for r in replicas))
            async with aiohttp.ClientSession() as h, h.get(served.url + "/metrics") as res:
                text = await res.text()
            assert "gateway_lora_managed_loads_total 2.0" in text  # sql, then poet
            assert "gateway_lora_managed_unloads_total 1.0" in text


def test_managed_offers_more_replicas_as_demand_grows_up_to_the_bound() -> None:
    cfg = {
        "pools": {"chat": {
            "replicas": [{"url": f"http://10.0.0.{i}:8000", "name": f"r{i}"} for i in range(4)],
            "lora": {"manage": True, "adapters": {"sql": "/a/sql"}, "requests_per_replica": 2,
                     "max_replicas_per_adapter": 2},
        }},
        "tracing": {"exporter": "none"},
    }  # fmt: skip
    pool = Gateway(parse_config(cfg)).pools["chat"]
    r0, r1, r2, r3 = pool.replicas
    for r in pool.replicas:
        r.lora.set_models(frozenset(), frozenset({BASE}))
    placement = LoraPlacement(clock=lambda: 0.0)

    def offered() -> list[str]:
        offer = placement.offer(pool, "sql")
        assert offer is not None and offer.managed == {"sql"}
        return [r.name for r in pool.replicas if "sql" in offer.loadable.get(r.name, ())]

    assert offered() == ["r0", "r1", "r2", "r3"]  # nowhere yet: anywhere
    placement.did_load(r1, "sql")
    assert offered() == []  # demand 1: the one replica that has it
    r1.lora.own["sql"] = 2  # two in flight + this one: demand for a second replica
    assert offered() == ["r0", "r2", "r3"]
    placement.did_load(r3, "sql")
    r1.lora.own["sql"] = 9
    assert offered() == []  # at max_replicas_per_adapter
    placement.no_runtime.add("r0")
    placement.did_unload(r3, "sql")
    assert offered() == ["r2", "r3"]  # r0 has no runtime routes
    assert placement.needs_load(pool, r2, "sql") == "/a/sql"
    assert placement.needs_load(pool, r1, "sql") is None


def test_manage_needs_the_adapters_it_places() -> None:
    cfg = {"pools": {"chat": {"replicas": ["http://10.0.0.1:8000"], "lora": {"manage": True}}}}
    with pytest.raises(ConfigError, match="adapters: required with manage: true"):
        parse_config(cfg)


def _missing(fleet: Fleet, i: int, *paths: str) -> None:
    """Replica i cannot find these adapter paths: a load of one is vLLM's 404 NotFoundError."""
    lora = fleet.replicas[i].engine.lora
    assert lora is not None
    lora.config = replace(lora.config, missing=paths)


def _held(fleet: Fleet, adapter: str) -> list[int]:
    return [i for i, r in enumerate(fleet.replicas) if adapter in r.engine.lora.registered]  # type: ignore[union-attr]


def _received(fleet: Fleet) -> int:
    return sum(r.engine.counters.requests_received for r in fleet.replicas)


async def test_a_failed_managed_load_moves_to_the_next_placement() -> None:
    lora = LoraConfig((), max_loras=2, runtime_updating=True)
    async with Fleet(n=3, speedup=1000.0, lora=lora) as fleet:
        _missing(fleet, 0, "/adapters/sql")  # round robin's first pick lacks the adapter's files
        cfg = _pool(fleet, manage=True, adapters={"sql": "/adapters/sql"})
        cfg["pools"]["chat"]["policy"] = "round_robin"
        async with _gateway(cfg) as (app, served):
            replicas = app.gateway.all_replicas()
            await poll_until(lambda: all(r.lora.base for r in replicas))
            status, body = await _complete(served.url, "sql")
            assert status == 200, body  # not replica 0's 404
            assert body["model"] == "sql" and _held(fleet, "sql") == [1]
            assert fleet.replicas[0].engine.counters.requests_received == 0
            placement = app.pipeline.lora
            assert (placement.loads, placement.load_failures) == (1, 1)
            # the decision stays as the policy made it: the placement moved the request, and
            # failover passes the failed load over, without editing the ranking
            assert app.gateway.decisions()[-1]["ranked"][0] == replicas[0].name
            for _ in range(3):  # where it is loaded now
                assert (await _complete(served.url, "sql"))[0] == 200
            assert fleet.replicas[1].engine.counters.requests_received == 4
            async with aiohttp.ClientSession() as h, h.get(served.url + "/metrics") as res:
                text = await res.text()
            assert "gateway_lora_managed_load_failures_total 1.0" in text


async def test_when_every_placement_fails_the_client_gets_one_clear_error() -> None:
    lora = LoraConfig((), max_loras=2, runtime_updating=True)
    async with Fleet(n=3, speedup=1000.0, lora=lora) as fleet:
        for i in range(3):  # no replica has the adapter's files
            _missing(fleet, i, "/adapters/ghost")
        cfg = _pool(fleet, manage=True, adapters={"ghost": "/adapters/ghost"})
        async with _gateway(cfg) as (app, served):
            replicas = app.gateway.all_replicas()
            await poll_until(lambda: all(r.lora.base for r in replicas))
            for _ in range(2):  # each request: one answer, ours, and no replica saw it
                status, body = await _complete(served.url, "ghost")
                assert status == 404, body
                err = body["error"]
                assert (err["type"], err["code"], err["param"]) == (
                    "not_found_error", "model_not_found", "model")
                assert "ghost" in err["message"] and "could not be loaded" in err["message"]
                assert "/adapters" not in err["message"]  # the operator's paths stay private
            assert _received(fleet) == 0 and _held(fleet, "ghost") == []
            assert app.pipeline.lora.load_failures == 6  # 1 + retries (2) placements each
            async with aiohttp.ClientSession() as h, h.get(served.url + "/metrics") as res:
                text = await res.text()
            assert 'gateway_requests_total{model="ghost",pool="chat",priority="interactive",replica="none",status="404",tenant="anonymous"} 2.0' in text

    # loads that fail for the replicas' reasons (no runtime routes here): a 502 that says so
    async with Fleet(n=2, speedup=1000.0, lora=LoraConfig((), max_loras=2)) as fleet:
        cfg = _pool(fleet, manage=True, adapters={"sql": "/adapters/sql"})
        async with _gateway(cfg) as (app, served):
            replicas = app.gateway.all_replicas()
            await poll_until(lambda: all(r.lora.base for r in replicas))
            status, body = await _complete(served.url, "sql")
            assert status == 502, body
            assert body["error"]["code"] == "bad_gateway"
            assert "runtime LoRA" in body["error"]["message"]
            assert _received(fleet) == 0


@dataclass
class SglangReplica:
    """An SGLang server as the gateway sees it (a handler on a real socket): `/v1/models` cards
    `owned_by: "sglang"` that list no adapter (SGLang before it added them there), the adapters
    in `/get_server_info`'s `lora_paths` (`form`: `refs`, the LoRARef dicts of today's
    `dataclasses.asdict(server_args)`; `dict`, older `{name: path}`), `max_loras_per_batch`, and
    completions that answer for the model they were sent (SGLang's `base:adapter` included)."""

    adapters: list[str]
    form: str = "refs"
    served: list[str] = field(default_factory=list)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if await lifespan_done(scope, receive, send):
            return
        path = scope["path"]
        if path == "/v1/models":
            card = {"id": BASE, "object": "model", "created": 0, "owned_by": "sglang",
                    "root": BASE, "parent": None, "max_model_len": 32768}
            return await _answer(send, 200, {"object": "list", "data": [card]})
        if path == "/get_server_info":
            paths: Any = [{"lora_id": f"{i:032x}", "lora_name": a, "lora_path": f"/lora/{a}",
                           "pinned": False} for i, a in enumerate(self.adapters)]
            if self.form == "dict":
                paths = {a: f"/lora/{a}" for a in self.adapters}
            return await _answer(send, 200, {"model_path": BASE, "enable_lora": True,
                                             "lora_paths": paths, "max_loras_per_batch": 4,
                                             "version": "0.5.0"})
        if path == "/v1/completions":
            model = orjson.loads(await read_body(receive))["model"]
            self.served.append(model)
            return await _answer(send, 200, {
                "id": "cmpl-1", "object": "text_completion", "model": model,
                "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})
        await _answer(send, 200 if path == "/health" else 404, {})


async def _answer(send: Any, status: int, data: Any) -> None:
    body = orjson.dumps(data)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


def test_sglang_server_info_names_its_adapters_in_each_of_its_forms() -> None:
    refs = {"enable_lora": True, "max_loras_per_batch": 3, "lora_paths": [
        {"lora_id": "a1", "lora_name": "sql", "lora_path": "/l/sql", "pinned": True}]}
    assert sglang_adapters(refs) == (frozenset({"sql"}), 2)  # one slot is the base model's
    assert sglang_adapters({"lora_paths": {"sql": "/l/sql", "poet": "/l/p"}}) == (
        frozenset({"sql", "poet"}), None)
    assert sglang_adapters({"lora_paths": ["sql=/l/sql", "/l/poet"]}) == (
        frozenset({"sql", "/l/poet"}), None)  # a bare path is its own name
    assert sglang_adapters({"enable_lora": True, "lora_paths": []}) == (frozenset(), None)
    assert sglang_adapters({"enable_lora": False, "lora_paths": None}) is None
    assert sglang_adapters("not json") is None
    assert sglang_names(frozenset({"sql"}), frozenset({BASE})) == {"sql", f"{BASE}:sql"}


@pytest.mark.parametrize("form", ["refs", "dict"])
async def test_adapters_of_sglang_replicas_are_read_from_their_server_info(form: str) -> None:
    with_sql, without = SglangReplica(["sql", "poet"], form), SglangReplica([], form)
    served = [await start_server(with_sql), await start_server(without)]
    try:
        cfg = _pool_of([s.url for s in served], policy="round_robin")
        async with _gateway(cfg) as (app, gw):
            r0, r1 = app.gateway.all_replicas()
            await poll_until(lambda: r0.lora.served and r1.lora.base)
            assert r0.lora.served >= {"sql", "poet", f"{BASE}:sql"}
            assert r0.lora.max_loras == 3  # max_loras_per_batch 4, less the base model's
            for model in (f"{BASE}:sql", "sql", f"{BASE}:poet") * 2:  # SGLang's name and ours
                status, body = await _complete(gw.url, model)
                assert status == 200 and body["model"] == model
            assert without.served == []  # round robin, yet only the replica holding them
            assert len(with_sql.served) == 6
            status, body = await _complete(gw.url, f"{BASE}:nope")
            assert status == 404 and body["error"]["code"] == "model_not_found"
            status, _ = await _complete(gw.url, BASE)  # the base model: either replica
            assert status == 200
    finally:
        await stop_all(served)


def _pool_of(urls: list[str], **pool: Any) -> dict[str, Any]:
    return {
        "pools": {"chat": {
            "replicas": [{"url": u, "name": f"r{i}"} for i, u in enumerate(urls)],
            "health": {"interval_s": 0.2}, "scrape": {"interval_s": 0.1},
            "lora": {"refresh_s": 0.2}, **pool,
        }},
        "tracing": {"exporter": "none"},
    }  # fmt: skip
