"""A short soak (the CI size of `bench/soak.py`): 5k requests through a gateway process, with bad
requests, unknown keys and clients that hang up mid-stream; its fds and asyncio tasks at idle return
to their count after the warm-up and its RSS stays flat. `python -m bench.soak` runs 100k.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.soak import run_soak

pytestmark = pytest.mark.chaos


async def test_no_fd_task_or_memory_leak_over_5k_requests(tmp_path: Path) -> None:
    result = await run_soak(5000, concurrency=16, warmup=1000, workdir=tmp_path)
    print("\n" + result.table())
    assert not result.problems(max_growth=0.10), result.table()
    assert result.statuses["abort_mid_stream 499"] > 50  # the cancellation path really ran
    assert result.statuses["json 200"] + result.statuses["stream 200"] > 4000
