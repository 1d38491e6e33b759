"""Continuous batching: batch limits, chunked prefill, prefix admission, preemption, priority."""

from __future__ import annotations

from typing import Any

import pytest

from simulator import Engine, build_config
from simulator.engine import Step


def engine(**overrides: Any) -> Engine:
    opts: dict[str, Any] = {"block_size": 16, "max_model_len": 1024, "num_gpu_blocks": 1000}
    opts.update(overrides)
    return Engine(build_config("qwen2.5-14b", "a100-80g", **opts))


def prompt(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def step(e: Engine) -> Step:
    s = e.begin_step(e.now_s)
    assert s is not None
    e.end_step()
    return s


def test_max_num_seqs_caps_the_running_batch() -> None:
    e = engine(max_num_seqs=4)
    for i in range(10):
        e.add_request(f"r{i}", prompt(20, 1000 * i), arrival_s=0.0, max_tokens=5)
    s = step(e)
    assert len(s.items) == 4 and e.num_running == 4 and e.num_waiting == 6
    while e.has_work:
        assert len(step(e).items) <= 4
    assert e.counters.requests_served == 10


def test_token_budget_chunks_a_long_prefill_over_steps() -> None:
    e = engine(max_num_batched_tokens=256)
    seq = e.add_request("long", prompt(1000), arrival_s=0.0, max_tokens=3)
    chunks = []
    while not seq.output:
        s = step(e)
        chunks.append(s.prefill_tokens)
    assert chunks == [256, 256, 256, 232]
    assert seq.first_token_s == pytest.approx(e.counters.busy_time_s)


def test_decodes_run_beside_a_prefill_chunk_within_the_budget() -> None:
    e = engine(max_num_batched_tokens=100)
    a = e.add_request("a", prompt(50), arrival_s=0.0, max_tokens=50)
    step(e)
    assert len(a.output) == 1
    e.add_request("b", prompt(500, 5000), arrival_s=e.now_s, max_tokens=5)
    s = step(e)
    assert s.decode_seqs == 1 and s.prefill_tokens == 99  # 1 decode token + 99 of prefill
    assert len(a.output) == 2


def test_a_request_reuses_the_cached_prefix_but_recomputes_the_last_token() -> None:
    e = engine()
    first = e.add_request("a", prompt(160), arrival_s=0.0, max_tokens=2)
    while e.has_work:
        step(e)
    again = e.add_request("b", prompt(160), arrival_s=e.now_s, max_tokens=2)
    longer = e.add_request("c", prompt(200), arrival_s=e.now_s, max_tokens=2)
    s = step(e)
    assert first.cached_tokens == 0
    assert again.cached_tokens == 144  # 160 cached, capped at (160 - 1) // 16 full blocks
    assert longer.cached_tokens == 160
    assert s.items[again] == 16 and s.items[longer] == 40
    assert e.counters.prefix_hits == 304 and e.counters.prefix_queries == 160 + 160 + 200


def test_finished_output_blocks_are_cached_for_the_next_turn() -> None:
    e = engine()
    turn1 = e.add_request("t1", prompt(40), arrival_s=0.0, max_tokens=40)
    while e.has_work:
        step(e)
    history = prompt(40) + turn1.output + prompt(8, 9000)  # what turn 2 resends
    turn2 = e.add_request("t2", history, arrival_s=e.now_s, max_tokens=1)
    step(e)
    # 79 tokens have KV (the last reply token was sampled, never fed back): 4 full blocks
    assert turn2.cached_tokens == 64


def test_preemption_when_blocks_run_out_then_recompute() -> None:
    e = engine(num_gpu_blocks=64, max_model_len=512)  # 1024 tokens of KV
    seqs = [
        e.add_request(f"r{i}", prompt(200, 1000 * (i + 1)), arrival_s=0.0, max_tokens=300)
        for i in range(4)
    ]
    preempted = 0
    while e.has_work:
        s = step(e)
        preempted += len(s.preempted)
        assert e.cache.num_free >= 0
    assert preempted > 0 and e.counters.preemptions == preempted
    assert all(len(s.output) == 300 for s in seqs)
    assert sum(s.preemptions for s in seqs) == preempted
    assert seqs[0].preemptions == 0  # FCFS preempts the latest admitted first
    assert e.kv_usage == 0.0


def test_no_admission_in_a_step_that_preempted() -> None:
    e = engine(num_gpu_blocks=32, max_model_len=256)
    e.add_request("a", prompt(240, 100), arrival_s=0.0, max_tokens=100)
    e.add_request("b", prompt(240, 5000), arrival_s=0.0, max_tokens=100)
    e.add_request("c", prompt(16, 9000), arrival_s=0.0, max_tokens=2)
    while e.has_work:
        s = step(e)
        if s.preempted:
            assert not s.admitted


def test_priority_scheduling_admits_lower_values_first() -> None:
    e = engine(scheduling_policy="priority", max_num_seqs=1)
    e.add_request("late-low", prompt(20, 100), arrival_s=0.0, max_tokens=1, priority=5)
    e.add_request("urgent", prompt(20, 200), arrival_s=0.0, max_tokens=1, priority=-1)
    e.add_request("normal", prompt(20, 300), arrival_s=0.0, max_tokens=1, priority=0)
    order = []
    while e.has_work:
        s = step(e)
        order += [q.id for q in s.admitted]
    assert order == ["urgent", "normal", "late-low"]


def test_priority_preemption_evicts_the_lowest_priority() -> None:
    e = engine(scheduling_policy="priority", num_gpu_blocks=40, max_model_len=512)
    low = e.add_request("low", prompt(200, 100), arrival_s=0.0, max_tokens=300, priority=9)
    high = e.add_request("high", prompt(200, 5000), arrival_s=0.0, max_tokens=300, priority=0)
    while e.has_work:
        step(e)
    assert high.preemptions == 0 and low.preemptions > 0


def test_abort_frees_blocks_at_once() -> None:
    e = engine()
    seq = e.add_request("a", prompt(300), arrival_s=0.0, max_tokens=100)
    step(e)
    assert e.kv_usage > 0
    assert e.abort("a") and not e.abort("a")
    assert e.kv_usage == 0.0 and not e.has_work and seq.finish_reason == "abort"


def test_output_length_distribution_applies_without_max_tokens() -> None:
    e = engine(output_lengths="fixed:7")
    seq = e.add_request("a", prompt(10), arrival_s=0.0)
    while e.has_work:
        step(e)
    assert len(seq.output) == 7 and seq.finish_reason == "stop"
    capped = engine(max_model_len=64).add_request("b", prompt(60), arrival_s=0.0, max_tokens=99)
    assert capped.target_out == 4
