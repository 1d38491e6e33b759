"""The comparison bench in small (`bench.engine_routing`, issue 43 item 5), so it cannot rot: the
package's two real vLLM replicas, vLLM's own client, one real peer (sglang-router cache_aware)
and the gateway as shipped, on the same requests, the caches emptied before each run."""

from __future__ import annotations

import math
from pathlib import Path

from bench.engine.client import Client
from bench.engine_routing import one_run
from tests.engine.conftest import Engine

REQUESTS = 32  # a router, 64 in all (the dataset makes a multiple of its 4 prefixes)
# vLLM's prefix_repetition dataset: 4 shared prefixes of 256 tokens, 32-token suffixes
DATASET = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "256",
           "--prefix-repetition-suffix-len", "32", "--prefix-repetition-num-prefixes", "4",
           "--prefix-repetition-output-len", "8"]  # fmt: skip


def test_the_gateway_and_sglang_router_on_the_same_requests(engine: Engine, tmp_path: Path) -> None:
    engine.revive()
    got, receipts = {}, {}
    with Client(tmp_path / "client.log") as client:
        for router in ("sglang-cache_aware", "gateway"):
            hit, result, counts = one_run(client, engine.fleet, router, DATASET, REQUESTS, 8.0,
                                          tmp_path, seed=0)  # fmt: skip
            assert result.completed == REQUESTS and result.failed == 0, (router, result.errors)
            assert result.ttft_mean_ms > 0 and result.e2el_mean_ms >= result.ttft_mean_ms
            assert not math.isnan(hit), router
            got[router] = hit
            receipts[router] = counts
    # 4 prefixes over 32 requests: a router that keeps each prefix on one replica reuses it on
    # 28 of them (~0.8 of the prompt tokens); round robin over 2 replicas on 24 (~0.7)
    assert got["gateway"] > 0.5, got
    assert got["sglang-cache_aware"] > 0.3, got
    # the gateway's route receipts, read from its /metrics by the bench: one per streamed answer
    # (each ended with its usage), and at most one `unreported` for the call vLLM's client opens
    # with (not streamed, no usage); none promised a prefix the engine did not have; a peer has
    # none
    assert receipts["sglang-cache_aware"] == {}
    mine = receipts["gateway"]
    assert sum(mine.values()) - mine["unreported"] == REQUESTS and mine["unreported"] <= 1, mine
    assert mine["cold"] >= 2 and mine["over"] == 0, mine
