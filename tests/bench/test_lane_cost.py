"""bench.lane_cost runs: one in-process gateway under streamed load, a fast lane switched on and
off window by window, the lane really taken in its windows, and the ratio line printed (no
figure is asserted: no test asserts a time)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_lane_is_switched_window_by_window_under_load() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "bench.lane_cost", "--lane", "end", "--windows", "4",
         "--window-s", "0.2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    first, ratio = res.stdout.splitlines()[-2:]
    m = re.search(r"(\d+) 64-chunk streams; .* the lane wrote (\d+) times", first)
    assert m is not None and int(m.group(1)) > 0 and int(m.group(2)) > 0, first
    assert "median of 2" in ratio and re.search(r"\d\.\d{3}$", ratio), ratio
