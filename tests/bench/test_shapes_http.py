"""Every prompt shape end to end: its exact client bodies through the real gateway over HTTP to
simulated replicas (bench.routing_http's replay). With the default policy repeats get a
predicted hit, the fleet hits a good share of the oracle, and the prediction matches the hit."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from bench.routing_http import DEFAULT, drive, kv_tokens, summarize
from bench.routing_workloads import ENGINE, profile
from bench.shapes import SHAPES, to_sim_requests
from simulator import Fleet

SPEEDUP = 20.0
DOCS = {"docs": 6, "doc_tokens": (300, 600), "question_tokens": (5, 20), "max_tokens": 8}
PREFIX = {"k": 4, "prefix_tokens": (300, 600), "suffix_tokens": (5, 20), "max_tokens": 8}
TURNS = {"turns": 4, "systems": 2, "system_tokens": 300, "think_s": (0.2, 0.5)}
# shape -> (requests, arrivals/s, small params)
CASES: dict[str, tuple[int, float, dict[str, Any]]] = {
    "system": (
        40, 8.0, {"k": 4, "system_tokens": (300, 600), "user_tokens": (5, 20), "max_tokens": 8}
    ),
    "doc_question": (40, 8.0, DOCS),
    "text_parts": (40, 8.0, DOCS),
    "multi_turn": (40, 16.0, {**TURNS, "user_tokens": (30, 80), "reply_tokens": 30}),
    "agent": (
        40, 16.0, {**TURNS, "task_tokens": (30, 80), "result_tokens": (100, 200), "max_tokens": 8}
    ),
    "completion_text": (40, 8.0, PREFIX),
    "completion_ids": (40, 8.0, PREFIX),
    "trace": (48, 8.0, {"block_tokens": 32, "max_output": 8}),
}  # fmt: skip
CHAINED = {"multi_turn", "agent"}  # a conversation's next turn waits for the last answer


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Mooncake-format trace with sharing from the start (the public one's first records
    share little): 6 groups of 8 shared hash ids, then 2 ids of the record's own."""
    rng = random.Random(7)
    lines = []
    for i in range(48):
        g = rng.randrange(6)
        ids = [1000 * g + j for j in range(8)] + [100_000 + 2 * i, 100_001 + 2 * i]
        rec = {"timestamp": 100 * i, "input_length": 320 - rng.randrange(20),
               "output_length": 8, "hash_ids": ids}  # fmt: skip
        lines.append(json.dumps(rec) + "\n")
    path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    path.write_text("".join(lines))
    return path


def test_every_shape_is_covered() -> None:
    assert set(CASES) == set(SHAPES)


@pytest.mark.parametrize("name", list(CASES))
async def test_a_shape_through_the_gateway(name: str, trace_file: Path) -> None:
    n, rate, params = CASES[name]
    if name == "trace":
        params = {**params, "path": trace_file}
    shaped = SHAPES[name](n, rate, 0, ENGINE["model"], **params)
    oracle = profile(to_sim_requests(shaped), 16).oracle_hit_ratio
    async with Fleet(n=4, speedup=SPEEDUP, **ENGINE) as fleet:
        run = await drive(fleet.urls, DEFAULT, shaped, speedup=SPEEDUP,
                          kv_tokens=kv_tokens(ENGINE), chained=name in CHAINED)  # fmt: skip
    s = summarize(run, oracle, 4)
    assert run.errors == [] and s["requests"] == len(shaped)
    # the responses' usage agrees with the replicas' own counters
    assert s["hit_ratio"] == pytest.approx(s["sim_hit_ratio"], abs=1e-9)
    assert s["repeats"] > 0.5 * len(shaped)
    assert s["predicted_share"] >= 0.8, s
    assert s["hit_vs_oracle"] >= 0.7, s
    assert s["err_pct_p50"] <= 10.0, s  # bytes mode: a block of 64 bytes is ~16 tokens
