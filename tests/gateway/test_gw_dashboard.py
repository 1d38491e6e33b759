"""Observability surfaces: the rolling window, /admin/status and its guard, the status page in a
real headless Chromium, and the Prometheus rules / Grafana dashboard checked against real metrics."""

from __future__ import annotations

import asyncio
import json
import os
import re
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway import create_app, parse_config
from gateway.http.status import status_of
from gateway.runtime.gateway import Gateway
from gateway.telemetry.window import RollingWindow, quantile
from tests.gateway.conftest import rig
from tests.gateway.fake_replica import Upstream
from tests.support import CHROMIUM, chromium, poll_until, serving

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy/prometheus/alerts.yaml"
PROMETHEUS = ROOT / "deploy/prometheus/prometheus.yml"
GRAFANA = ROOT / "deploy/grafana/kv-gateway.json"
KEY = "test-admin-key"
SAVE_SHOT = os.environ.get("DASHBOARD_SCREENSHOT")  # a path: keep the browser test's screenshot

# vLLM's exported names this repo's rules and dashboard rely on, as vLLM 0.33 exposes them
# (vllm/v1/metrics/loggers.py; /work/shared/reference/vllm-sglang-interfaces.md section 3; the
# simulator exports the same). prometheus_client adds `_total` to counters.
VLLM_NAMES = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
}
PROMETHEUS_SYNTHETIC = {"up"}  # series Prometheus itself writes per scrape target

_PROMQL_WORDS = {
    # functions and aggregations
    *"abs absent absent_over_time avg avg_over_time bottomk ceil changes clamp clamp_max clamp_min "
    "count count_over_time delta deriv floor histogram_quantile increase irate label_replace "
    "last_over_time max max_over_time min min_over_time quantile quantile_over_time rate resets "
    "round scalar sort sort_desc stddev sum sum_over_time time topk vector".split(),
    # keywords
    *"and or unless bool offset by without on ignoring group_left group_right inf nan".split(),
}


# --- the rolling window ------------------------------------------------------------------------
class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def observe(w: RollingWindow, replica: str = "r1", pool: str = "chat", **kw: Any) -> None:
    sample: dict[str, Any] = {
        "ttft_s": 0.1,
        "tpot_s": 0.02,
        "e2e_s": 1.0,
        "prompt_tokens": 100,
        "prompt_blocks": 4,
        "predicted_hit_blocks": 2,
        "cached_tokens": None,
        "input_tokens": 100,
        "ok": True,
    }
    w.observe(pool, replica, **{**sample, **kw})


def test_window_percentiles_per_bucket_and_pool() -> None:
    clock = FakeClock()
    w = RollingWindow(span_s=60, bucket_s=10, clock=clock)
    for i in range(1, 101):  # 100 requests in the current bucket: TTFT 1..100 ms
        observe(w, ttft_s=i / 1000, tpot_s=i / 10000)
    observe(w, pool="batch", replica="b1", ttft_s=5.0, tpot_s=None)
    s = w.series()
    assert s["span_s"] == 60 and s["bucket_s"] == 10
    assert len(s["fleet"]) == 6 and [p["n"] for p in s["fleet"]] == [0, 0, 0, 0, 0, 101]
    chat = s["pools"]["chat"][-1]
    assert chat["ttft_p50"] == pytest.approx(0.050) and chat["ttft_p99"] == pytest.approx(0.099)
    assert chat["tpot_p50"] == pytest.approx(0.0050)
    assert s["fleet"][-1]["ttft_p99"] == pytest.approx(0.100)  # 101 samples: rank 100
    assert s["pools"]["batch"][-1]["tpot_p50"] is None  # not measured is not zero
    assert s["fleet"][0]["ttft_p50"] is None and s["fleet"][0]["age_s"] > s["fleet"][-1]["age_s"]


def test_window_expires_old_buckets_and_stays_bounded() -> None:
    clock = FakeClock()
    w = RollingWindow(span_s=30, bucket_s=10, clock=clock, max_samples=8)
    for _ in range(1000):
        observe(w)
    assert len(w._buckets) == 1 and len(w._buckets[0][1][("chat", "r1")].ttft) == 8
    for step in range(10):  # 100 s later only the last 3 buckets remain
        clock.t += 10
        observe(w, ttft_s=float(step))
    assert len(w._buckets) == 3
    s = w.series()
    assert [p["n"] for p in s["fleet"]] == [1, 1, 1]
    assert s["replicas"]["chat"]["r1"]["requests"] == 3
    clock.t += 1000  # idle: everything has aged out
    s = w.series()
    assert all(p["n"] == 0 for p in s["fleet"]) and s["replicas"] == {}


def test_window_rates_and_hit_ratios_per_replica() -> None:
    clock = FakeClock()
    w = RollingWindow(span_s=300, bucket_s=10, clock=clock)
    for i in range(40):
        clock.t += 0.5  # 2 requests/s for 20 s
        observe(
            w, "r1", predicted_hit_blocks=3, prompt_blocks=4, cached_tokens=50, input_tokens=100
        )
        observe(w, "r2", ok=i % 4 != 0, predicted_hit_blocks=0, cached_tokens=None)
    reps = w.series()["replicas"]["chat"]
    r1, r2 = reps["r1"], reps["r2"]
    assert r1["requests"] == 40 and r1["request_rate"] == pytest.approx(40 / 19.5)
    assert r1["predicted_hit_rate"] == pytest.approx(0.75)
    assert r1["observed_hit_rate"] == pytest.approx(0.5) and r1["error_rate"] == 0
    assert r2["predicted_hit_rate"] == 0 and r2["observed_hit_rate"] is None
    assert r2["error_rate"] == pytest.approx(0.25)
    assert r1["ttft_p50"] == pytest.approx(0.1) and r1["e2e_p99"] == pytest.approx(1.0)


def test_quantile_is_nearest_rank() -> None:
    assert quantile([], 0.5) is None
    assert quantile([3.0], 0.99) == 3.0
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0
    assert quantile([float(i) for i in range(1, 1001)], 0.99) == 990.0


# --- /admin/status and the guard ---------------------------------------------------------------
def window_of(gw: Gateway, monkeypatch: pytest.MonkeyPatch) -> RollingWindow:
    return gw.window


async def chat(
    client: httpx.AsyncClient, url: str, text: str, stream: bool = True, model: str = "test-model"
) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "stream": stream,
        "max_tokens": 8,
    }
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        await resp.aread()


async def test_admin_routes_need_the_key() -> None:
    async with (
        rig([Upstream("r1"), Upstream("r2")], extra={"server": {"admin_key": KEY}}) as r,
        httpx.AsyncClient(base_url=r.url, timeout=10) as client,
    ):
        await chat(client, "", "hello", stream=False)
        for path in ("/admin/status", "/debug/decisions"):
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
                resp = await client.get(path, headers=headers)
                assert resp.status_code == 401, (path, headers)
                err = resp.json()["error"]
                assert err["type"] == "authentication_error" and set(err) == {
                    "message",
                    "type",
                    "param",
                    "code",
                }
                assert resp.headers["www-authenticate"] == "Bearer"
                assert KEY not in resp.text
            ok = await client.get(path, headers={"authorization": f"Bearer {KEY}"})
            assert ok.status_code == 200, path
        assert (
            await client.get("/debug/decisions", headers={"authorization": f"bearer {KEY}"})
        ).json()["decisions"][0]["ranked"]
        page = await client.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "connect-src 'self'" in page.headers["content-security-policy"]
        assert "<canvas" in page.text and "127.0.0.1" not in page.text


async def test_an_empty_admin_key_opens_nothing() -> None:
    async with (
        rig([Upstream("r1")], extra={"server": {"admin_key": ""}}) as r,
        httpx.AsyncClient(base_url=r.url, timeout=10) as client,
    ):
        for headers in ({}, {"authorization": "Bearer"}, {"authorization": "Basic x"}):
            assert (await client.get("/admin/status", headers=headers)).status_code == 401


async def test_admin_routes_are_off_without_a_key() -> None:
    async with (
        rig([Upstream("r1")]) as r,
        httpx.AsyncClient(base_url=r.url, timeout=10) as client,
    ):
        for path in ("/admin/status", "/debug/decisions"):
            resp = await client.get(path, headers={"authorization": f"Bearer {KEY}"})
            assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found_error"
        assert (await client.get("/dashboard")).status_code == 200  # the page holds no data


async def test_status_snapshot_reports_state_without_addresses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with (
        rig(
            [Upstream("r1"), Upstream("r2"), Upstream("r3")],
            extra={"server": {"admin_key": KEY}},
        ) as r,
        httpx.AsyncClient(base_url=r.url, timeout=10) as client,
    ):
        window_of(r.gateway, monkeypatch)
        for i in range(12):
            await chat(client, "", f"the same long prefix for every request {i % 3} " * 4)
        resp = await client.get("/admin/status", headers={"authorization": f"Bearer {KEY}"})
        assert resp.status_code == 200
        text = resp.text
        for s in r.served:  # no internal address leaks out of the status JSON
            assert s.url not in text and f":{s.port}" not in text
        assert "http://" not in text and "https://" not in text
        data = resp.json()
        (pool,) = data["pools"]
        assert pool["name"] == "chat" and pool["policy"] == "round_robin"
        reps = {rep["name"]: rep for rep in pool["replicas"]}
        assert set(reps) == {"r1", "r2", "r3"}
        for rep in reps.values():
            assert "url" not in rep and rep["circuit"] == "closed" and rep["healthy"]
            assert rep["waiting"] is None  # the test upstream exports no waiting gauge: unknown
            assert rep["recent"]["requests"] == 4 and rep["recent"]["ttft_p50"] is not None
        assert set(data["admission"]["chat"]) == {"interactive", "batch"}
        assert data["admission"]["chat"]["interactive"]["admitted"] == 12
        assert len(data["decisions"]) == 12
        d = data["decisions"][-1]
        assert {"policy", "reason", "ranked", "scores", "totals", "filtered"} <= set(d)
        assert {
            "predicted_hit_blocks",
            "pool",
            "prompt_tokens",
            "blocks",
            "request_id",
            "t",
        } <= set(d)
        assert sum(p["n"] for p in data["series"]["fleet"]) == 12
        # the snapshot keeps the last 50 decisions only, newest last
        last = r.gateway.recent[-1]
        for i in range(60):
            r.gateway.recent.append((last[0], str(i), *last[2:]))
        decisions = status_of(r.gateway, None)["decisions"]
        assert len(decisions) == 50 and decisions[-1]["request_id"] == "59"


# --- Prometheus rules and Grafana dashboard against real metric names ---------------------------
def metric_names(expr: str) -> set[str]:
    """Metric names an expression reads (PromQL, or Grafana's label_values(metric, label))."""
    e = re.sub(r"label_values\(\s*([\w:]+)(\{[^}]*\})?\s*,[^)]*\)", r" \1 ", expr)
    e = re.sub(r"\$\{[^}]*\}|\$[\w]+", " ", e)  # Grafana variables
    e = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', " ", e)  # strings
    e = re.sub(r"\{[^}]*\}", " ", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", " ", e)  # ranges and subqueries
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"\b\d+(\.\d+)?(e[+-]?\d+)?[smhdwy]?\b", " ", e)  # numbers and durations
    return {t for t in re.findall(r"[A-Za-z_:][\w:]*", e) if t not in _PROMQL_WORDS}


def exposed_names(exposition: str) -> set[str]:
    """Every name a query may use for the families in a text exposition (suffixes by type)."""
    names: set[str] = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(maxsplit=3)
            suffixes = {
                "histogram": ("_bucket", "_sum", "_count"),
                "summary": ("", "_sum", "_count"),
                "counter": ("_total",),
            }.get(kind, ("",))
            base = family.removesuffix("_total") if kind == "counter" else family
            names.update(base + s for s in suffixes)
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return {n for n in names if not n.endswith("_created")}


@pytest.fixture(scope="module")
def gateway_names() -> set[str]:
    async def scrape() -> str:
        async with (
            rig([Upstream("r1")]) as r,
            httpx.AsyncClient(base_url=r.url, timeout=10) as client,
        ):
            await chat(client, "", "one request so every labelled family has a child")
            return (await client.get("/metrics")).text

    text = asyncio.run(scrape())
    names = exposed_names(text)
    assert "gateway_ttft_seconds_bucket" in names and "gateway_requests_total" in names
    assert "gateway_shed_total" in names and "gateway_replica_up" in names
    return names


def check_names(where: str, expr: str, gateway_names: set[str]) -> set[str]:
    used = metric_names(expr)
    assert used, f"{where}: no metric in {expr!r}"
    for name in used:
        if name.startswith("gateway_"):
            assert name in gateway_names, f"{where}: {name} is not exported by the gateway"
        elif name.startswith("vllm:"):
            assert name in VLLM_NAMES, f"{where}: {name} is not a vLLM metric this repo relies on"
        else:
            assert name in PROMETHEUS_SYNTHETIC, f"{where}: unknown metric {name!r} in {expr!r}"
    return used


def test_metric_name_extraction() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, pool) (rate(gateway_ttft_seconds_bucket{pool=~"$pool"}'
        "[$__rate_interval]))) > 2.5 and on(pool) increase(vllm:num_preemptions_total[1m]) > 0 "
        "or avg_over_time(x_y[1h:5m] offset 1d) < 0.5 * 1e3"
    )
    assert metric_names(expr) == {
        "gateway_ttft_seconds_bucket",
        "vllm:num_preemptions_total",
        "x_y",
    }
    assert metric_names("label_values(gateway_replica_up, pool)") == {"gateway_replica_up"}
    assert metric_names('label_values(m{pool=~"$pool"}, replica)') == {"m"}
    assert exposed_names('# TYPE a_total counter\n# TYPE h histogram\nh_bucket{le="1"} 0\n') == {
        "a_total",
        "h_bucket",
        "h_sum",
        "h_count",
    }


def alert_rules() -> Iterator[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        assert group["name"] and group["rules"]
        yield from group["rules"]


def test_alert_rules_parse_and_name_real_metrics(gateway_names: set[str]) -> None:
    rules = list(alert_rules())
    used: set[str] = set()
    for rule in rules:
        name = rule.get("alert") or rule.get("record")
        assert name and isinstance(rule["expr"], str), rule
        if "alert" in rule:
            assert rule["labels"]["severity"] in {"page", "warning", "info"}, name
            assert rule["annotations"]["summary"], name
            assert re.fullmatch(r"\d+[smh]", rule.get("for", "0s")), name
        used |= check_names(name, rule["expr"], gateway_names)
    alerts = {r["alert"] for r in rules if "alert" in r}
    assert len(alerts) >= 7
    assert "vllm:num_preemptions_total" in used and "up" in used
    assert {"gateway_replica_up", "gateway_prompt_length_tokens_bucket"} <= used
    preempt = next(r for r in rules if "vllm:num_preemptions_total" in r["expr"])
    assert "increase(" in preempt["expr"] and preempt["for"] == "1m"
    prom = yaml.safe_load(PROMETHEUS.read_text())
    for path in prom["rule_files"]:
        assert (PROMETHEUS.parent / path).resolve() == RULES.resolve()
    jobs = {c["job_name"] for c in prom["scrape_configs"]}
    assert {"kv-gateway", "vllm"} <= jobs


def grafana_exprs(node: Any, where: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        title = node.get("title") or node.get("name") or where
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield title, value
            elif key == "query" and isinstance(value, str) and "label_values(" in value:
                yield title, value
            elif key == "query" and isinstance(value, dict) and "query" in value:
                yield title, value["query"]
            else:
                yield from grafana_exprs(value, title)
    elif isinstance(node, list):
        for item in node:
            yield from grafana_exprs(item, where)


def test_grafana_dashboard_parses_and_names_real_metrics(gateway_names: set[str]) -> None:
    board = json.loads(GRAFANA.read_text())
    assert 36 <= board["schemaVersion"] <= 41 and board["uid"] and board["title"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert len(panels) >= 15
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
    used: set[str] = set()
    exprs = list(grafana_exprs(board))
    assert len(exprs) >= len(panels)
    for title, expr in exprs:
        used |= check_names(title, expr, gateway_names)
    assert {
        "gateway_ttft_seconds_bucket",
        "gateway_tpot_seconds_bucket",
        "gateway_predicted_hit_blocks_total",
        "gateway_observed_cached_tokens_total",
        "gateway_routing_decisions_total",
        "gateway_queue_length",
        "gateway_shed_total",
        "gateway_ratelimited_total",
        "vllm:num_preemptions_total",
    } <= used


def test_every_gateway_family_is_documented(gateway_names: set[str]) -> None:
    doc = (ROOT / "docs/observability.md").read_text()
    documented = set(re.findall(r"`(gateway_\w+)`", doc))
    for name in gateway_names:
        family = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in documented or family in documented, f"{family} missing from the docs"


async def test_vllm_names_are_what_the_simulator_exports() -> None:
    from simulator import Fleet

    async with Fleet(n=1, speedup=5000.0) as fleet, httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(fleet.urls[0] + "/metrics")).text
    assert VLLM_NAMES <= exposed_names(text)


# --- the status page in a real browser ----------------------------------------------------------
def png_facts(data: bytes) -> tuple[int, int, int]:
    """(width, height, distinct byte values in the decoded image data) of a PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, size = 8, b"", (0, 0)
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        chunk = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            size = struct.unpack(">II", chunk[:8])
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    return size[0], size[1], len(set(zlib.decompress(idat)))


@pytest.mark.slow
@pytest.mark.skipif(
    not CHROMIUM.exists(), reason="/usr/bin/chromium absent (apt-get install chromium)"
)
async def test_status_page_renders_in_headless_chromium(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from simulator import Fleet

    names = ["sim-a", "sim-b", "sim-c"]
    async with Fleet(n=3, speedup=200.0) as fleet:
        replicas = [{"url": u, "name": n} for u, n in zip(fleet.urls, names, strict=True)]
        health = {"interval_s": 0.2, "timeout_s": 0.5}
        pool = {"replicas": replicas, "health": health, "scrape": {"interval_s": 0.2}}
        cfg = {"server": {"admin_key": KEY}, "pools": {"chat": pool}}
        app = create_app(parse_config(cfg))
        async with serving(app, lifespan="on") as gw, httpx.AsyncClient(timeout=30) as client:
            window_of(app.gateway, monkeypatch)
            sem = asyncio.Semaphore(8)

            async def one(i: int) -> None:
                async with sem:
                    text = f"shared system prompt {i % 4} " * 20 + f"question {i}"
                    await chat(client, gw.url, text, model=fleet.replicas[0].model_name)

            await asyncio.gather(*(one(i) for i in range(48)))
            await poll_until(lambda: all(r.scraped is not None for r in app.gateway.all_replicas()))
            page = f"{gw.url}/dashboard#key={KEY}"
            shot = tmp_path / "dashboard.png"
            dom, _ = await asyncio.gather(
                chromium(page, "--dump-dom", profile=tmp_path / "p1"),
                chromium(page, f"--screenshot={shot}", profile=tmp_path / "p2"),
            )
    data = await asyncio.to_thread(shot.read_bytes)
    if SAVE_SHOT:
        await asyncio.to_thread(Path(SAVE_SHOT).write_bytes, data)
    width, height, distinct = png_facts(data)
    assert (width, height) == (1400, 1000)
    assert distinct > 32, "the screenshot is (nearly) uniform"
    html = dom.decode()
    assert 'data-rendered="1"' in html, "the page never rendered a status snapshot"
    for name in names:
        assert f'data-replica="{name}"' in html
    for chart in ("ttft", "tpot", "rps"):
        m = re.search(rf'<canvas[^>]*data-chart="{chart}"[^>]*>', html)
        assert m, chart
        points = re.search(r'data-points="(\d+)"', m.group(0))
        assert points and int(points.group(1)) > 0, f"{chart} chart drew no points"
    assert "data-decision=" in html
    banner = re.search(r'<div[^>]*id="banner"[^>]*>', html)
    assert banner and "hidden" in banner.group(0), "the page shows an error banner"
    assert KEY not in html
