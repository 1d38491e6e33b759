"""Config validation: every error names its key path; unknown keys are errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import ConfigError, load_config, parse_config

EXAMPLE = """
server: {host: 127.0.0.1, port: 8080, max_body_bytes: 8388608}
pools:
  chat:
    replicas:
      - http://127.0.0.1:9001
      - {url: http://127.0.0.1:9002, name: r2}
    policy: least_loaded
    max_inflight_per_replica: 64
    health: {path: /health, interval_s: 2, timeout_s: 1, failures_to_open: 3}
    timeouts: {connect_s: 2, first_byte_s: 60, total_s: 600}
    retries: 2
routes:
  - {match: {model: "qwen*"}, pool: chat}
  - {match: {}, pool: chat}
"""


def problems(data: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return info.value.problems


def test_issue_example_parses(tmp_path: Path) -> None:
    p = tmp_path / "routes.yaml"
    p.write_text(EXAMPLE)
    cfg = load_config(p)
    pool = cfg.pools["chat"]
    assert [r.display_name for r in pool.replicas] == ["127.0.0.1:9001", "r2"]
    assert pool.health.failures_to_open == 3 and pool.retries == 2
    assert cfg.pool_for("qwen-7b", 10) == "chat" and cfg.pool_for("llama", 10) == "chat"


def test_bad_url_names_its_path() -> None:
    data = {"pools": {"chat": {"replicas": ["http://a:1", {"url": "ftp://x"}]}}}
    assert problems(data) == ["pools.chat.replicas[1].url: not an http(s) URL"]


def test_unknown_keys_are_errors() -> None:
    data = {"pools": {"chat": {"replicas": ["http://a:1"], "helth": {}}}, "sever": {}}
    assert sorted(problems(data)) == [
        "pools.chat.helth: unknown key (did you mean 'health'?)",
        "sever: unknown key (did you mean 'server'?)",
    ]


def test_wrong_types_and_ranges() -> None:
    data = {
        "pools": {
            "chat": {"replicas": ["http://a:1"], "retries": -1, "health": {"interval_s": "soon"}}
        }
    }
    out = problems(data)
    assert any(p.startswith("pools.chat.retries:") for p in out)
    assert any(p.startswith("pools.chat.health.interval_s:") for p in out)


def test_missing_and_empty() -> None:
    assert problems({}) == ["pools: required"]
    assert problems({"pools": {"chat": {"replicas": []}}})[0].startswith("pools.chat.replicas:")


def test_route_to_unknown_pool_and_multi_pool_needs_routes() -> None:
    data = {"pools": {"a": {"replicas": ["http://a:1"]}}, "routes": [{"pool": "b"}]}
    assert problems(data) == ["routes[0].pool: unknown pool 'b' (defined: a)"]
    data2 = {"pools": {"a": {"replicas": ["http://a:1"]}, "b": {"replicas": ["http://b:1"]}}}
    assert problems(data2) == ["routes: required when more than one pool is defined"]


def test_unknown_policy_is_named() -> None:
    out = problems({"pools": {"chat": {"replicas": ["http://a:1"], "policy": "best_guess"}}})
    assert len(out) == 1 and out[0].startswith("pools.chat.policy:") and "best_guess" in out[0]


def test_duplicate_replica_names() -> None:
    out = problems(
        {"pools": {"chat": {"replicas": ["http://a:1", {"url": "http://b:1", "name": "a:1"}]}}}
    )
    assert "repeats" in out[0]


def test_env_substitution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UPSTREAM_KEY", "s3cret")
    monkeypatch.setenv("REPLICA_HOST", "10.1.2.3")
    cfg = parse_config(
        {
            "pools": {
                "chat": {
                    "replicas": [
                        "http://${REPLICA_HOST}:8000",
                        "http://${NOPE_HOST:-127.0.0.2}:8000",
                    ],
                    "upstream_api_key": "${UPSTREAM_KEY}",
                }
            }
        }
    )
    pool = cfg.pools["chat"]
    assert [r.url for r in pool.replicas] == ["http://10.1.2.3:8000", "http://127.0.0.2:8000"]
    assert (
        pool.upstream_api_key is not None and pool.upstream_api_key.get_secret_value() == "s3cret"
    )
    assert "s3cret" not in str(cfg.redacted())
    monkeypatch.delenv("UPSTREAM_KEY")
    with pytest.raises(ConfigError) as info:
        parse_config(
            {"pools": {"chat": {"replicas": ["http://a:1"], "upstream_api_key": "${UPSTREAM_KEY}"}}}
        )
    assert info.value.problems == [
        "pools.chat.upstream_api_key: environment variable UPSTREAM_KEY is not set"
    ]


def gateway_check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", "check", "--config", str(path)],
        capture_output=True,
        text=True,
    )


def test_cli_check(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(EXAMPLE)
    res = gateway_check(good)
    assert res.returncode == 0, res.stderr
    assert '"max_inflight_per_replica": 64' in res.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools: {chat: {replicas: [ftp://x]}}\n")
    res = gateway_check(bad)
    assert res.returncode == 1
    assert "pools.chat.replicas[0].url: not an http(s) URL" in res.stderr
    res = gateway_check(tmp_path / "none.yaml")
    assert res.returncode == 1 and "cannot read" in res.stderr


def test_cli_check_fails_on_a_redis_url_that_is_not_one(tmp_path: Path) -> None:
    path = tmp_path / "routes.yaml"
    path.write_text(
        "pools: {chat: {replicas: [http://a:1]}}\nindex: {backend: redis, redis_url: not-a-url}\n"
    )
    res = gateway_check(path)
    assert res.returncode == 1
    assert "  index.redis_url: not a Redis URL" in res.stderr
    assert "Traceback" not in res.stderr
