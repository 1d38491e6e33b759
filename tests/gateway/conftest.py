from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from bench.harness import stop_all
from gateway import create_app, parse_config
from tests.gateway.fake_replica import Upstream
from tests.support import Served, free_port, start_server


@dataclass
class Rig:
    url: str
    upstreams: list[Upstream]
    served: list[Served]
    app: Any

    @property
    def gateway(self) -> Any:
        return self.app.gateway


@contextlib.asynccontextmanager
async def rig(
    upstreams: list[Upstream],
    dead: int = 0,
    pool: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> AsyncIterator[Rig]:
    """Upstream servers (plus `dead` URLs nothing listens on) behind a gateway on loopback."""
    served = [await start_server(u) for u in upstreams]
    replicas: list[Any] = [
        {"url": s.url, "name": u.name} for s, u in zip(served, upstreams, strict=True)
    ]
    replicas += [
        {"url": f"http://127.0.0.1:{free_port()}", "name": f"dead{i}"} for i in range(dead)
    ]
    pool_cfg: dict[str, Any] = {
        "replicas": replicas,
        "policy": "round_robin",
        "health": {"interval_s": 0.2, "timeout_s": 0.5, "failures_to_open": 2, "open_s": 1.0},
        "timeouts": {"connect_s": 1, "first_byte_s": 5, "idle_s": 5, "total_s": 30},
        "scrape": {"interval_s": 0.2},
        **(pool or {}),
    }
    cfg = {"pools": {"chat": pool_cfg}, **(extra or {})}
    app = create_app(parse_config(cfg))
    gw = await start_server(app, lifespan="on")
    try:
        yield Rig(gw.url, upstreams, served, app)
    finally:
        await gw.stop()
        await stop_all(served)


@pytest.fixture
def make_rig() -> Any:
    return rig
