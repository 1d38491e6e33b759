"""Redis URLs in routes.yaml: checked at load (`gateway check`: test_gw_config.py), and a Redis that
does not answer fails open on a real gateway (the index routes without prefixes, the limiter
allows), never a 500."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.config import ConfigError, parse_config
from tests.gateway.conftest import rig
from tests.gateway.fake_replica import Upstream
from tests.support import free_port

POOL = {"pools": {"chat": {"replicas": ["http://127.0.0.1:9001"]}}}
KEY = "sk-tenant-redis-0123"


@pytest.mark.parametrize(
    "url",
    [
        "not-a-url",
        "http://127.0.0.1:6379/0",
        "redis://",
        "redis://127.0.0.1:notaport/0",
        "redis://127.0.0.1:6379/zero",
        "redis://127.0.0.1:6379/0?socket_timeout=soon",
        "unix://",
    ],
)
@pytest.mark.parametrize("section", ["index", "ratelimit"])
def test_a_bad_redis_url_names_its_key(section: str, url: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({**POOL, section: {"backend": "redis", "redis_url": url}})
    (line,) = info.value.problems
    assert line.startswith(f"{section}.redis_url: not a Redis URL"), line


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        "redis://redis",
        "rediss://user:p%40ss@cache.internal:6380/2",
        "redis://:secret@10.0.0.5:6379/0?socket_timeout=0.5",
        "unix:///run/redis.sock?db=1",
    ],
)
def test_good_redis_urls_load(url: str) -> None:
    cfg = parse_config({**POOL, "index": {"redis_url": url}, "ratelimit": {"redis_url": url}})
    assert cfg.index.redis_url == cfg.ratelimit.redis_url == url


def test_kv_events_load_with_the_redis_index_in_tokens_mode(tmp_path: Path) -> None:
    """The redis index keeps engine entries per gateway (prefix_index/_redis_local.py): KV
    events need tokens mode, whichever the backend."""
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text("{}")
    chunking = {"mode": "tokens", "tokenizer": str(tokenizer), "chat_template": "chatml"}
    index = {"backend": "redis", "events": {"enabled": True, "routed_ttl_s": 2.5}}
    cfg = parse_config({**POOL, "index": {**index, "chunking": chunking}})
    assert cfg.index.backend == "redis" and cfg.index.events.enabled
    with pytest.raises(ConfigError) as info:
        parse_config({**POOL, "index": index})
    (line,) = info.value.problems
    assert line.startswith("index.events.enabled: KV events require chunking.mode: tokens"), line


def test_a_password_in_a_bad_url_is_not_repeated() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({**POOL, "index": {"redis_url": "redis://:hunter2@host:70000/0"}})
    assert "hunter2" not in str(info.value)


async def test_unreachable_redis_fails_open_on_a_real_gateway() -> None:
    closed = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    extra: dict[str, Any] = {
        "index": {"backend": "redis", "redis_url": closed},
        "ratelimit": {"backend": "redis", "redis_url": closed},
        "tenants": [{"name": "t", "api_keys": [KEY], "limits": {"requests_per_minute": 1000}}],
    }
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hello " * 50}]}
    headers = {"authorization": f"Bearer {KEY}"}
    async with rig([Upstream("u")], extra=extra) as r, aiohttp.ClientSession() as h:
        for stream in (False, True, False):
            async with h.post(
                r.url + "/v1/chat/completions", json={**body, "stream": stream}, headers=headers
            ) as res:
                text = await res.text()
                assert res.status == 200, text
                assert "x-ratelimit-limit-requests" not in res.headers  # degraded: no headers
        assert r.upstreams[0].calls == 3
