"""bench.trace_cost runs as an operator runs tracing: two gateways from the CLI (one traced, one
not) loaded in turn, the traced one's spans exported to a collector process and none dropped,
and the ratio line printed (no figure is asserted: no test asserts a time)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_two_gateways_are_loaded_in_turn_and_the_traced_one_exports() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "bench.trace_cost", "--windows", "2", "--window-s", "0.3",
         "--warmup-s", "0.2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    head, cpu, threads, goal = res.stdout.splitlines()[-4:]
    m = re.search(r"(\d+) requests$", head)
    assert m is not None and int(m.group(1)) > 0, head
    assert re.search(r"traced \d+ us, untraced \d+ us", cpu), cpu
    spans = re.search(r"(\d+) spans exported, (\d+) waiting, 0 dropped", cpu)
    assert spans is not None and int(spans.group(1)) + int(spans.group(2)) > 0, cpu  # traced
    assert "untraced: loop" in threads and "traced: loop" in threads, threads
    assert "median of 1" in goal and re.search(r"\d\.\d\d  (PASS|FAIL)$", goal), goal
