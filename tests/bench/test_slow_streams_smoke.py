"""Smoke test of `bench.slow_streams`: a few hundred paced streams through a real gateway process
and straight at the upstream; every stream must end with `[DONE]` on both paths, and the report
must carry the memory and CPU figures (no figure is asserted: no test asserts a time)."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

from bench.slow_streams import FD_SPARE, stream_cap

ROOT = Path(__file__).resolve().parents[2]


def test_a_few_hundred_slow_streams_all_complete() -> None:
    n = 300
    res = subprocess.run(
        [sys.executable, "-m", "bench.slow_streams", "--streams", str(n), "--chunks", "8",
         "--chunk-delay-ms", "100", "--ramp-s", "0.3", "--timeout-s", "60"],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    rows = {line.split()[0]: line.split() for line in res.stdout.splitlines() if line.strip()}
    for who in ("direct", "gateway"):
        done, failed, peak = (int(x) for x in rows[who][1:4])
        assert (done, failed) == (n, 0), res.stdout
        assert 0 < peak <= n
    gw = rows["gateway"]
    rss, grown, per_stream, us_chunk, us_all = (float(x) for x in gw[-5:])
    assert rss > 0 and grown >= 0 and per_stream >= 0 and us_chunk > 0 and us_all > 0


def test_streams_are_capped_by_the_descriptor_limit() -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap, limit = stream_cap(10**9)
    assert limit == soft and cap == max(1, (soft - FD_SPARE) // 2)  # two sockets per stream
    assert stream_cap(5) == (5, soft)
