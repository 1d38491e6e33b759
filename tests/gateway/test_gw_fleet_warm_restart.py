"""Warm restart: a gateway with the memory index and `index.snapshot_path` writes the index on
shutdown and, started again, routes a known prefix to the replica that holds it at once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from bench.harness import stop_all
from gateway import ConfigError, create_app, parse_config
from tests.gateway.fake_replica import Upstream
from tests.support import Served, start_server

DOC = "A long shared document about routing. " * 40


def config(urls: list[str], path: Path | None) -> dict[str, Any]:
    index: dict[str, Any] = {} if path is None else {"snapshot_path": str(path)}
    return {
        "server": {"expose_upstream_errors": True},
        "pools": {"chat": {"replicas": [{"url": u, "name": f"r{i}"} for i, u in enumerate(urls)],
                           "policy": "prefix_aware", "scrape": {"enabled": False}}},
        "index": index,
    }  # fmt: skip


async def ask(url: str, question: str) -> dict[str, Any]:
    body = {"model": "m", "messages": [{"role": "system", "content": DOC},
                                       {"role": "user", "content": question}]}  # fmt: skip
    async with aiohttp.ClientSession() as h, h.post(
        url + "/v1/chat/completions", json=body, headers={"x-gateway-explain": "1"}
    ) as r:
        assert r.status == 200
        return dict(orjson.loads(r.headers["x-gateway-decision"]))


async def run_once(urls: list[str], path: Path | None, question: str) -> dict[str, Any]:
    gw = await start_server(create_app(parse_config(config(urls, path))), lifespan="on")
    try:
        return await ask(gw.url, question)
    finally:
        await gw.stop()


async def test_a_restart_keeps_the_prefix_hits(tmp_path: Path) -> None:
    ups = [Upstream(f"u{i}") for i in range(3)]
    served: list[Served] = [await start_server(u) for u in ups]
    urls = [s.url for s in served]
    snap = tmp_path / "index.snap"
    try:
        first = await run_once(urls, snap, "first?")
        assert first["predicted_hit_blocks"] == 0 and snap.is_file()
        again = await run_once(urls, snap, "second?")
        assert again["ranked"][0] == first["ranked"][0]
        assert again["predicted_hit_blocks"] > 10  # the document's blocks, known at once
        cold = await run_once(urls, None, "third?")  # the control: no snapshot, no hit
        assert cold["predicted_hit_blocks"] == 0
    finally:
        await stop_all(served)


def test_only_the_memory_index_takes_a_snapshot_path() -> None:
    with pytest.raises(ConfigError, match="snapshot_path"):
        parse_config({"pools": {"p": {"replicas": ["http://127.0.0.1:9"]}},
                      "index": {"backend": "redis", "snapshot_path": "/tmp/x"}})  # fmt: skip
