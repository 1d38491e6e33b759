"""`python -m bench.sim_report`: the simulator's tables for docs/simulator.md."""

from __future__ import annotations

import pytest

from bench import sim_report as report
from simulator.profiles import load_gpus, load_models


def test_capacity_table_lists_every_model_and_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert report.main(["--table", "capacity"]) == 0
    out = capsys.readouterr().out
    # the engine's rule: 79.2 GiB x 0.9 - 26 GB weights - activation peak - 1 GiB non-torch
    assert "| llama-2-13b | a100-80g | 1 | 26.0 | 819,200 | 48.6 |" in out
    assert "| qwen2.5-14b | a100-80g | 1 |" in out and "| llama-3.1-70b | h200 | 2 |" in out
    assert "| deepseek-v3 | h200 | 8 |" in out and "| deepseek-v3 | a100-80g | > 8 |" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) - 1 == len(load_models()) * len(load_gpus())


async def test_prefix_cache_cuts_ttft_in_the_report_workload() -> None:
    rows = await report.cache_rows("qwen2.5-14b", "a100-80g", [1.0], 120, seed=0)
    on, off = rows
    assert on["cache"] == "on" and off["cache"] == "off"
    assert float(on["hit_ratio"]) > 0.85 and float(off["hit_ratio"]) == 0.0
    # both pay the request latency outside the engine (about 60 ms for 2,100 tokens)
    assert float(on["ttft_p50"]) < float(off["ttft_p50"]) / 3
    assert "| 1 | on |" in report.cache_table(rows)
