"""`gateway serve` tunes the garbage collector once started: what exists then is frozen and young
collections run less often (a young collection every couple of requests cost ~8 % of the CPU per
request and most of the saturation p99: bench/overhead.py). Run in a child: it is process-wide."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import gc
from gateway.http.app import GC_GEN0_THRESHOLD, settle_garbage_collector
before = gc.get_threshold()
settle_garbage_collector()
after = gc.get_threshold()
assert after == (GC_GEN0_THRESHOLD, before[1], before[2]), (before, after)
assert gc.get_freeze_count() > 10_000, gc.get_freeze_count()  # the modules, config, objects
print("ok")
"""


def test_settling_freezes_what_exists_and_raises_the_young_threshold() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
