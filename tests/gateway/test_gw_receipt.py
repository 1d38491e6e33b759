"""The route receipt's verdicts (gateway/telemetry/receipt.py): a table of predictions against
engine reports, then a replica that reports no cached tokens behind a real gateway."""

from __future__ import annotations

import httpx
import pytest

from bench.access_log import access_lines
from bench.harness import serving
from gateway import create_app, parse_config
from gateway.telemetry.receipt import VERDICTS, Receipt, receipt
from tests.gateway.fake_replica import Upstream
from tests.support import poll_until, start_server

BLOCK = 32


@pytest.mark.parametrize(
    ("hit", "prompt", "cached", "verdict", "error"),
    [
        (0, 300, 0, "cold", 0),  # a first request: nothing predicted, nothing reused
        (0, 20, 0, "cold", 0),  # shorter than a block: nothing can be cached
        (256, 300, 256, "exact", 0),
        (300, 300, 288, "exact", 0),  # cut to prompt - 1, whole blocks: 288
        (256, 300, 224, "within_block", 32),
        (0, 300, 32, "within_block", -32),
        (256, 300, 0, "over", 256),  # predicted a hit the engine did not have
        (64, 300, 256, "under", -192),
        (256, 300, None, "unreported", None),  # the engine said nothing
        (0, 300, None, "unreported", None),
    ],
)
def test_verdicts(hit: int, prompt: int, cached: int | None, verdict: str, error: int | None) -> None:
    r = receipt(hit, prompt, prompt, cached, BLOCK, None)
    assert r.verdict == verdict and r.error == error, r
    assert verdict in VERDICTS


def test_a_cold_receipt_is_not_exact() -> None:
    assert Receipt(0, 0, BLOCK).verdict == "cold"
    assert Receipt(32, 32, BLOCK).verdict == "exact"


async def test_an_engine_that_reports_no_cached_tokens_gives_unreported_receipts() -> None:
    up = await start_server(Upstream("a"))  # its usage has no prompt_tokens_details
    config = parse_config({"pools": {"chat": {"replicas": [up.url], "policy": "prefix_aware"}}})
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hello " * 100}]}
    try:
        with access_lines() as lines:
            async with serving(create_app(config), lifespan="on") as gw, httpx.AsyncClient() as http:
                for _ in range(2):
                    res = await http.post(gw.url + "/v1/chat/completions", json=body)
                    assert res.status_code == 200
                await poll_until(lambda: len(lines) == 2, 5)
                text = (await http.get(gw.url + "/metrics")).text
    finally:
        await up.stop()
    assert 'gateway_route_receipts_total{pool="chat",verdict="unreported"} 2.0' in text
    assert "gateway_route_receipt_error_tokens_count" not in text  # no error without a report
    assert [line["cached_tokens"] for line in lines] == [None, None]
