"""bench.trace_cost runs: one in-process gateway under load, its sampler switched window by window,
every sampled request's spans exported and none dropped, and the ratio line printed (no figure is
asserted: no test asserts a time)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_sampled_and_unsampled_windows_alternate_under_load() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "bench.trace_cost", "--windows", "4", "--window-s", "0.2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    first, goal = res.stdout.splitlines()[-2:]
    m = re.search(r"(\d+) requests; .* sampled (\d+) us, unsampled (\d+) us", first)
    assert m is not None and int(m.group(1)) > 0, first
    spans = re.search(r"(\d+) spans exported, 0 dropped", first)
    assert spans is not None and int(spans.group(1)) > 0, first  # the sampled windows exported
    assert "median of 2" in goal and re.search(r"\d\.\d\d  (PASS|FAIL)$", goal), goal
