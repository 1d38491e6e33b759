"""A disaggregated pool's sets under discovery: the gateway over HTTP, simulated P/D replicas
(simulator/pd.py), Kubernetes EndpointSlices from a fake API server on a real socket
(tests/deploy/test_discovery.py's `FakeApi`) and the static backend (docs/pd.md)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from gateway import create_app, parse_config
from gateway.config import ConfigError
from simulator.fleet import Fleet
from simulator.pd import PdOptions
from tests.deploy.test_discovery import FakeApi
from tests.support import poll_until, start_server

LONG = "You are a careful assistant. " * 60
TIMING = {
    "health": {"interval_s": 0.2, "timeout_s": 0.5, "failures_to_open": 2, "open_s": 1.0},
    "timeouts": {"connect_s": 1, "first_byte_s": 5, "idle_s": 5, "total_s": 20},
    "scrape": {"interval_s": 0.2},
}


def body(model: str, stream: bool = False, max_tokens: int = 8) -> dict[str, Any]:
    msgs = [{"role": "system", "content": LONG}, {"role": "user", "content": "hi"}]
    return {"model": model, "messages": msgs, "stream": stream, "max_tokens": max_tokens}


def slice_for(service: str, port: int, n: int) -> dict[str, Any]:
    """One EndpointSlice of `service`: 127.0.0.1 on `port` (one slice per simulated replica)."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{service}-{n}",
            "namespace": "llm",
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True}}],
    }


def name_of(url: str) -> str:
    return url.removeprefix("http://")


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@contextlib.asynccontextmanager
async def fleets(
    protocol: str, n_prefill: int, n_decode: int
) -> AsyncIterator[tuple[Fleet, Fleet]]:
    speedup = 20.0  # slow enough that a long stream holds its decode replica a while
    p = PdOptions("prefill", protocol, lease_s=speedup * 5, bootstrap_timeout_s=speedup * 5)  # type: ignore[arg-type]
    d = PdOptions("decode", protocol, waiting_timeout_s=speedup * 5)  # type: ignore[arg-type]
    async with (
        Fleet(n=n_prefill, speedup=speedup, pd=p) as pf,
        Fleet(n=n_decode, speedup=speedup, pd=d, seed=100) as df,
    ):
        yield pf, df


async def decision(h: httpx.AsyncClient, url: str, req: dict[str, Any]) -> dict[str, Any]:
    res = await h.post(url + "/v1/chat/completions", json=req, headers={"x-gateway-explain": "1"})
    assert res.status_code == 200, res.text
    return orjson.loads(res.headers["x-gateway-decision"])  # type: ignore[no-any-return]


async def test_a_discovered_decode_set_grows_and_shrinks() -> None:
    api = FakeApi()
    await api.start()
    try:
        async with fleets("vllm-nixl", 1, 2) as (pf, df):
            d0, d1 = (name_of(u) for u in df.urls)
            kube = {"kind": "kubernetes", "service": "decode", "namespace": "llm",
                    "port_name": "http", "api_url": api.url, "retry_s": 0.05}  # fmt: skip
            cfg = {"pools": {"pd": {
                "protocol": "vllm-nixl",
                "prefill": {"replicas": [{"url": pf.urls[0], "name": "p0"}]},
                "decode": {"discovery": kube, "max_inflight_per_replica": 1},
                **TIMING,
            }}, "server": {"expose_upstream_errors": True}}  # fmt: skip
            app = create_app(parse_config(cfg))
            gw = await start_server(app, lifespan="on")
            sets = lambda: app.gateway.pools["pd"].pd  # noqa: E731
            decodes = lambda: [r.name for r in sets().decode.replicas]  # noqa: E731
            try:
                async with httpx.AsyncClient(timeout=20) as h:
                    # nothing discovered yet: the prefill set alone serves nothing
                    ready = await h.get(gw.url + "/ready")
                    assert ready.status_code == 503 and ready.json()["available_replicas"] == {
                        "pd": 0
                    }
                    prefill = sets().prefill.replicas[0]

                    await api.put("ADDED", slice_for("decode", port_of(df.urls[0]), 0))
                    await poll_until(lambda: decodes() == [d0])
                    first = sets().decode.replicas[0]
                    await poll_until(lambda: first.proven(time.monotonic()))
                    assert (await h.get(gw.url + "/ready")).status_code == 200
                    got = await decision(h, gw.url, body(model(pf)))
                    assert got["prefill_replica"] == "p0" and got["decode_replica"] == d0

                    # grows: the kept replica keeps its state object, the prefill set is untouched
                    await api.put("ADDED", slice_for("decode", port_of(df.urls[1]), 1))
                    await poll_until(lambda: decodes() == sorted([d0, d1]))
                    assert sets().decode.by_name[d0] is first
                    assert sets().prefill.replicas[0] is prefill
                    assert [r.name for r in app.gateway.pools["pd"].replicas] == ["p0", *decodes()]
                    # while a long stream holds d0 (max_inflight 1), the next request goes to d1
                    hold = body(model(pf), stream=True, max_tokens=2000)
                    async with h.stream("POST", gw.url + "/v1/chat/completions", json=hold,
                                        headers={"x-gateway-explain": "1"}) as s:  # fmt: skip
                        assert s.status_code == 200
                        held = orjson.loads(s.headers["x-gateway-decision"])["decode_replica"]
                        other = (await decision(h, gw.url, body(model(pf))))["decode_replica"]
                    assert {held, other} == {d0, d1}

                    # shrinks: d0 is drained and forgotten; requests go to d1 only
                    await api.put("DELETED", slice_for("decode", port_of(df.urls[0]), 0))
                    await poll_until(lambda: decodes() == [d1])
                    assert first.draining
                    for _ in range(3):
                        got = await decision(h, gw.url, body(model(pf)))
                        assert got["decode_replica"] == d1
                    await poll_until(lambda: not app.gateway.background.busy())
                    assert d0 not in {r.name for r in app.gateway.all_replicas()}
            finally:
                await gw.stop()
    finally:
        await api.stop()


def model(pf: Fleet) -> str:
    return pf.replicas[0].model_name


async def test_sglang_discovered_prefill_replicas_take_the_sets_bootstrap_port(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with fleets("sglang", 1, 1) as (pf, df):
        p = pf.replicas[0]
        assert p.pd is not None
        cfg = {"pools": {"pd": {
            "protocol": "sglang",
            "prefill": {"discovery": {"kind": "static", "endpoints": pf.urls},
                        "bootstrap_port": p.pd.port},
            "decode": {"discovery": {"kind": "static", "endpoints": df.urls}},
            **TIMING,
        }}, "server": {"expose_upstream_errors": True}}  # fmt: skip
        app = create_app(parse_config(cfg))
        gw = await start_server(app, lifespan="on")
        try:
            pool = lambda: app.gateway.pools["pd"]  # noqa: E731
            await poll_until(lambda: len(pool().replicas) == 2)
            async with httpx.AsyncClient(timeout=20) as h:
                for stream in (False, True):  # the decode side reaches P's bootstrap server
                    res = await h.post(
                        gw.url + "/v1/chat/completions",
                        json=body(model(pf), stream=stream),
                        headers={"x-gateway-explain": "1"},
                    )
                    assert res.status_code == 200, res.text
                    got = orjson.loads(res.headers["x-gateway-decision"])
                    assert got["prefill_replica"] == name_of(pf.urls[0])
                    assert got["decode_replica"] == name_of(df.urls[0])
                    assert (b"data: [DONE]" in res.content) == stream

            # a reload that keeps the discovery settings keeps what discovery found, and state
            caplog.set_level(logging.WARNING, logger="gateway")
            kept = {r.name: r for r in pool().replicas}
            cfg["pools"]["pd"]["decode"]["retries"] = 0  # type: ignore[index]
            await app.gateway.reconfigure(parse_config(cfg))
            assert {r.name: r for r in pool().replicas} == kept
            assert all(kept[r.name] is r for r in pool().replicas)
            assert pool().pd.decode.config.retries == 0
            # one that changes a set's discovery restarts its watcher: the set follows it
            moved = {"kind": "static", "endpoints": [pf.urls[0]]}  # now a prefill server ...
            cfg["pools"]["pd"]["decode"]["discovery"] = moved  # type: ignore[index]
            await app.gateway.reconfigure(parse_config(cfg))
            # ... whose name the prefill set has: skipped, the decode set stays empty
            await poll_until(lambda: "already in the other set; skipped" in caplog.text)
            assert pool().pd.decode.replicas == ()
            assert [r.name for r in pool().pd.prefill.replicas] == [name_of(pf.urls[0])]
            cfg["pools"]["pd"]["decode"]["discovery"] = {"kind": "static", "endpoints": df.urls}  # type: ignore[index]
            await app.gateway.reconfigure(parse_config(cfg))
            await poll_until(
                lambda: [r.name for r in pool().pd.decode.replicas] == [name_of(df.urls[0])]
            )
            assert pool().pd.decode.replicas[0] is not kept[name_of(df.urls[0])]  # a fresh one
        finally:
            await gw.stop()


K8S = {"kind": "kubernetes", "service": "decode", "api_url": "http://127.0.0.1:1"}


@pytest.mark.parametrize(
    ("pool", "message"),
    [
        (
            {"protocol": "vllm-nixl", "prefill": {"replicas": ["http://a:1"]},
             "decode": {"replicas": ["http://b:1"], "discovery": K8S}},
            "pools.pd.decode.replicas: set either `replicas` or `discovery`, not both",
        ),
        (
            {"protocol": "vllm-nixl", "prefill": {"replicas": ["http://a:1"]},
             "decode": {"max_inflight_per_replica": 4}},
            "pools.pd.decode: expected a replica set: a mapping with `replicas`",
        ),
        (
            {"protocol": "vllm-nixl", "prefill": {"discovery": {"kind": "dns", "name": "p"}},
             "decode": {"replicas": ["http://b:1"]}},
            "pools.pd.prefill.discovery.port: required",
        ),
        (
            {"protocol": "vllm-nixl", "prefill": {"replicas": ["http://a:1"]},
             "decode": {"discovery": {**K8S, "servic": "x"}}},
            "pools.pd.decode.discovery.servic: unknown key",
        ),
        (
            {"protocol": "sglang", "prefill": {"replicas": ["http://a:1"]},
             "decode": {"discovery": K8S, "bootstrap_port": 8998}},
            "pools.pd.decode.bootstrap_port: only an sglang pool's prefill set",
        ),
        (
            {"protocol": "vllm-nixl", "discovery": K8S, "prefill": {"discovery": K8S},
             "decode": {"discovery": K8S}},
            "pools.pd.replicas: a disaggregated pool lists its replicas under prefill:",
        ),
    ],
)  # fmt: skip
def test_config_errors_name_their_key(pool: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config({"pools": {"pd": pool}})
    assert message in str(exc.value), str(exc.value)


def test_a_discovered_set_starts_empty_and_takes_the_sets_settings() -> None:
    cfg = parse_config({"pools": {"pd": {
        "protocol": "sglang", "timeouts": {"total_s": 30},
        "prefill": {"discovery": K8S, "bootstrap_port": 8998, "timeouts": {"first_byte_s": 3}},
        "decode": {"replicas": ["http://b:1"]},
    }}})  # fmt: skip
    from gateway.fleet.pools import build_pools

    pool = build_pools(cfg, {}, lambda r: None, [])["pd"]
    assert pool.pd is not None and pool.pd.prefill.replicas == ()
    assert pool.pd.prefill.config.discovery is not None and pool.pd.decode.config.discovery is None
    assert pool.pd.prefill.config.timeouts.first_byte_s == 3
    assert [r.name for r in pool.replicas] == ["b:1"]
    assert not pool.any_available()  # no prefill replica yet
