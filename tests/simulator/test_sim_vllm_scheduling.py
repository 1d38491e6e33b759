"""The scheduler's policy, case by case, against what vLLM's v1 scheduler does with the same queue
(vllm/v1/core/sched/scheduler.py, `Scheduler.schedule`): running requests first in admission order
(a decode is one token, a partial prefill its next chunk), then waiting ones while the token budget
and `max_num_seqs` last, the last admitted possibly with a partial chunk; a request's prompt tokens
in one step capped by `long_prefill_token_threshold`; and the batch defaults `vllm serve` picks."""

from __future__ import annotations

from typing import Any

import pytest

from simulator import Engine, build_config
from simulator.config import vllm_batch_defaults


def _engine(**overrides: Any) -> Engine:
    opts: dict[str, Any] = {"block_size": 16, "max_model_len": 4096, "num_gpu_blocks": 4000,
                            "enable_prefix_caching": False, "jitter_cv": 0.0}
    opts.update(overrides)
    return Engine(build_config("qwen2.5-14b", "a100-80g", **opts))


def _steps(e: Engine, n: int) -> list[dict[str, int]]:
    """Tokens each request got in each of the next `n` steps, by request id."""
    out = []
    for _ in range(n):
        s = e.begin_step(e.now_s)
        assert s is not None
        out.append({seq.id: k for seq, k in s.items.items()})
        e.end_step()
    return out


# (case, engine options, requests queued in order (id, prompt tokens, max tokens),
#  requests added after the first step (same form), tokens per request in each step)
CASES: list[tuple[str, dict[str, Any], list[tuple[str, int, int]], list[tuple[str, int, int]],
                  list[dict[str, int]]]] = [
    ("waiting requests are admitted while the budget lasts, the last one partially",
     {"max_num_batched_tokens": 1000}, [("a", 300, 5), ("b", 300, 5), ("c", 300, 5),
                                       ("d", 300, 5)], [],
     [{"a": 300, "b": 300, "c": 300, "d": 100},
      {"a": 1, "b": 1, "c": 1, "d": 200}]),
    ("a running partial prefill goes before a new admission",
     {"max_num_batched_tokens": 200}, [("a", 300, 5)], [("b", 500, 5)],
     [{"a": 200}, {"a": 100, "b": 100}, {"a": 1, "b": 199}]),
    ("decodes go first, a newcomer's chunk gets what is left",
     {"max_num_batched_tokens": 100}, [("a", 20, 9), ("b", 20, 9), ("c", 20, 9)],
     [("d", 500, 5)],
     [{"a": 20, "b": 20, "c": 20}, {"a": 1, "b": 1, "c": 1, "d": 97},
      {"a": 1, "b": 1, "c": 1, "d": 97}]),
    ("a partial prefill admitted earlier can use the whole budget: later decodes wait",
     {"max_num_batched_tokens": 100}, [("a", 400, 5)], [("b", 10, 5)],
     [{"a": 100}, {"a": 100}, {"a": 100}, {"a": 100, }, {"a": 1, "b": 10}]),
    ("max_num_seqs stops admissions whatever the budget",
     {"max_num_seqs": 2, "max_num_batched_tokens": 8192},
     [("a", 50, 3), ("b", 50, 3), ("c", 50, 3)], [],
     [{"a": 50, "b": 50}, {"a": 1, "b": 1}, {"a": 1, "b": 1}, {"c": 50}]),
    ("long_prefill_token_threshold caps each request's chunk, not the step",
     {"max_num_batched_tokens": 1000, "long_prefill_token_threshold": 64},
     [("a", 150, 3), ("b", 150, 3)], [],
     [{"a": 64, "b": 64}, {"a": 64, "b": 64}, {"a": 22, "b": 22}]),
    ("more than one partial prefill: the threshold is 4 % of max_model_len",
     {"max_num_batched_tokens": 1000, "max_num_partial_prefills": 2, "max_model_len": 1000},
     [("a", 100, 3)], [], [{"a": 40}, {"a": 40}, {"a": 20}, {"a": 1}]),
]


@pytest.mark.parametrize(("case", "opts", "first", "later", "want"), CASES,
                         ids=[c[0] for c in CASES])
def test_a_step_schedules_what_vllm_would(case: str, opts: dict[str, Any],
                                           first: list[tuple[str, int, int]],
                                           later: list[tuple[str, int, int]],
                                           want: list[dict[str, int]]) -> None:
    e = _engine(**opts)
    for i, (rid, n, out) in enumerate(first):
        e.add_request(rid, list(range(1000 * i, 1000 * i + n)), arrival_s=0.0, max_tokens=out)
    got = _steps(e, 1)
    for i, (rid, n, out) in enumerate(later, start=len(first)):
        e.add_request(rid, list(range(1000 * i, 1000 * i + n)), arrival_s=e.now_s,
                      max_tokens=out)
    got += _steps(e, len(want) - 1)
    assert got == want


@pytest.mark.parametrize(("threshold", "partial", "max_len", "want"), [
    (0, 1, 40960, 0),        # vLLM's default: no cap
    (0, 2, 40960, 1638),     # more than one partial prefill: 4 % of max_model_len
    (0, 4, 5120, 204),
    (512, 1, 40960, 512),    # given: kept
    (512, 4, 40960, 512),
])
def test_the_long_prefill_threshold_is_derived_as_vllm_derives_it(
        threshold: int, partial: int, max_len: int, want: int) -> None:
    cfg = build_config("qwen3-32b", "h100", tensor_parallel_size=2, max_model_len=max_len,
                       long_prefill_token_threshold=threshold,
                       max_num_partial_prefills=partial)
    assert cfg.effective_long_prefill_token_threshold == want


@pytest.mark.parametrize(("gpu", "tokens", "seqs"), [
    ("h100", 8192, 1024), ("h200", 8192, 1024), ("b200", 8192, 1024), ("mi300x", 8192, 1024),
    ("a100-80g", 2048, 256),  # 80 GB, but vLLM keeps A100 on the small defaults (PR #17885)
    ("l40s", 2048, 256),      # under 70 GiB
])
def test_vllm_serve_batch_defaults_by_gpu(gpu: str, tokens: int, seqs: int) -> None:
    assert vllm_batch_defaults(gpu) == {"max_num_batched_tokens": tokens, "max_num_seqs": seqs}


def test_bad_partial_prefill_options_are_refused() -> None:
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        build_config("qwen2.5-14b", "a100-80g", max_model_len=1024,
                     long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="max_num_partial_prefills"):
        build_config("qwen2.5-14b", "a100-80g", max_model_len=1024, max_num_partial_prefills=0)
