"""The dev harness's own helpers (bench/harness.py), where a test does not already lean on them."""

from __future__ import annotations

from bench.harness import pd_fleets

MODEL = "qwen2.5-14b"


async def test_harness_pd_fleets() -> None:
    async with pd_fleets(1, 2, "sglang", model=MODEL, lease_s=5.0) as (p, d):
        assert len(d.urls) == 2 and p.replicas[0].pd is not None
        assert p.replicas[0].pd.opts.lease_s == 5.0 and d.replicas[1].pd.opts.role == "decode"
