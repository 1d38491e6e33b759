"""Every gateway config under deploy/ loads as `gateway check` would, the example configs stay on
the recommended policy, and the SGLang example points at SGLang's defaults."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gateway.config import PoolConfig, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RECOMMENDED = PoolConfig.model_fields["policy"].default  # docs/routing-benchmark.md's pick
EXAMPLES = sorted(DEPLOY.glob("routes*.yaml")) + [DEPLOY / "compose" / "routes.yaml"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_example_config_passes_gateway_check(path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "gateway", "check", "--config", str(path)],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    assert load_config(path).pools


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_the_first_pool_of_each_example_uses_the_recommended_policy(path: Path) -> None:
    config = load_config(path)
    first = next(iter(config.pools.values()))
    assert first.policy == RECOMMENDED == "ttft"


def test_the_kubernetes_configmap_uses_the_recommended_policy() -> None:
    (configmap,) = yaml.safe_load_all((DEPLOY / "k8s" / "configmap.yaml").read_text())
    data = yaml.safe_load(configmap["data"]["routes.yaml"])
    for pool in data["pools"].values():
        assert pool.get("policy", RECOMMENDED) == RECOMMENDED


def test_the_sglang_example_matches_sglang_defaults() -> None:
    config = load_config(DEPLOY / "routes.sglang.yaml")
    (pool,) = config.pools.values()
    assert {r.url.rsplit(":", 1)[1] for r in pool.replicas} == {"30000"}  # SGLang's default port
    assert pool.health.path == "/health"  # not /health_generate, which runs a generation
    assert pool.scrape.path == "/metrics"
    assert config.server.expose_upstream_errors is False
    text = (DEPLOY / "routes.sglang.yaml").read_text()
    assert "--enable-metrics" in text  # SGLang exports /metrics only with it: say so


def test_the_readme_points_at_the_sglang_example() -> None:
    assert "deploy/routes.sglang.yaml" in (ROOT / "README.md").read_text()


def test_the_sglang_example_parses_with_scrape_off_too() -> None:
    data = yaml.safe_load((DEPLOY / "routes.sglang.yaml").read_text())
    data["pools"]["chat"]["scrape"] = {"enabled": False}
    assert parse_config(data).pools["chat"].scrape.enabled is False
