"""bench.cprofile_gateway runs: an in-process gateway under load, profiled, answers without errors,
and the profile names the gateway's request path (no figure is asserted: no test asserts a time)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_profile_of_a_loaded_gateway_names_its_request_path() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "bench.cprofile_gateway", "--seconds", "0.5", "--top", "60",
         "--tracing", "--sort", "cumulative"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    first = res.stdout.splitlines()[0]
    assert "0 errors" in first and " 0 answers" not in first, first
    assert "gateway/pipeline/steps.py" in res.stdout and "(handle)" in res.stdout
    assert "export thread:" in res.stdout
