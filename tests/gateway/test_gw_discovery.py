"""Replicas found by Kubernetes discovery take traffic once ready; those that go are drained and forgotten."""

from __future__ import annotations

from typing import Any

import httpx

from gateway import create_app, parse_config
from prefix_index.chunking import render_chat, scope_key
from tests.deploy.test_discovery import FakeApi
from tests.gateway.fake_replica import Upstream
from tests.support import poll_until, start_server

MESSAGES = [
    {"role": "system", "content": "Shared system prompt. " * 30},
    {"role": "user", "content": "hi"},
]


def slice_of(ports: list[int]) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "vllm-abc",
            "namespace": "llm",
            "labels": {"kubernetes.io/service-name": "vllm"},
        },
        "addressType": "IPv4",
        # one slice per port keeps the test honest about picking the port by name
        "ports": [{"name": "http", "port": ports[0], "protocol": "TCP"}],
        "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True, "serving": True}}],
    }


async def test_kubernetes_discovery_adds_and_removes_replicas() -> None:
    api = FakeApi()
    await api.start()
    a, b = Upstream("a"), Upstream("b")
    sa, sb = await start_server(a), await start_server(b)
    first = slice_of([sa.port])
    second = {**slice_of([sb.port]), "metadata": {**first["metadata"], "name": "vllm-def"}}
    await api.put("ADDED", first)
    cfg = parse_config(
        {
            "pools": {
                "chat": {
                    "discovery": {
                        "kind": "kubernetes",
                        "service": "vllm",
                        "namespace": "llm",
                        "port_name": "http",
                        "api_url": api.url,
                    },
                    "policy": "prefix_aware",
                }
            }
        }
    )
    app = create_app(cfg)
    gw = await start_server(app, lifespan="on")
    pool = lambda: app.gateway.pools["chat"]  # noqa: E731
    try:
        await poll_until(lambda: len(pool().replicas) == 1)
        async with httpx.AsyncClient(timeout=10) as h:
            body = {"model": "m", "messages": MESSAGES}
            assert (await h.post(gw.url + "/v1/chat/completions", json=body)).status_code == 200
            assert a.calls == 1
            await api.put("ADDED", second)
            await poll_until(lambda: len(pool().replicas) == 2)
            name_a = f"127.0.0.1:{sa.port}"
            scope = scope_key("m")
            hashes = app.gateway.chunker.hash_text(scope, render_chat(MESSAGES))
            assert (await app.gateway.index.match(scope, hashes, [name_a]))[name_a] == len(hashes)
            await api.put("DELETED", first)  # a's pod goes away
            await poll_until(lambda: [r.name for r in pool().replicas] == [f"127.0.0.1:{sb.port}"])
            for _ in range(3):
                assert (await h.post(gw.url + "/v1/chat/completions", json=body)).status_code == 200
            assert b.calls == 3 and a.calls == 1
            # drained (nothing in flight) and forgotten by the index
            await poll_until(lambda: not app.gateway.background.busy())
            assert (await app.gateway.index.match(scope, hashes, [name_a]))[name_a] == 0
    finally:
        await gw.stop()
        await sa.stop()
        await sb.stop()
        await api.stop()
