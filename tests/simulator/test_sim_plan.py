"""`gateway plan`: the figures follow the performance model, the seeds' worked numbers appear when
their inputs are given, and the replicas it asks for carry the rate within the SLOs."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from simulator.plan import PlanRequest, make_plan, parse_duration, render


def gateway_plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", "plan", *args], capture_output=True, text=True
    )


def figure(text: str, label: str) -> str:
    """The rest of the line that starts with `label` (after the indent)."""
    m = re.search(rf"^  {re.escape(label)}\s+(.*)$", text, re.MULTILINE)
    assert m is not None, f"no {label!r} line in:\n{text}"
    return m.group(1)


# --- the seeds' worked numbers ----------------------------------------------------------------


def test_seed_13b_kv_bytes_capacity_and_concurrency() -> None:
    # the seed: 2 x 40 x 40 x 128 x 2 = 819,200 B a token; 80 GB x 0.90 - 26 GB weights - 6 GB
    # overhead = 40 GB of KV; a 4K sequence is 3.36 GB, so 40 / 3.36 = 11.9 sequences
    res = gateway_plan(
        "--model", "llama-2-13b", "--gpu", "a100-80g", "--overhead-gb", "6",
        "--gpu-memory-utilization", "0.9", "--prompt-tokens", "4096",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert figure(out, "KV bytes per token").startswith("819,200 B (800.0 KiB)")
    assert figure(out, "weights").startswith("26.0 GB per GPU")
    assert figure(out, "KV capacity").startswith("40.0 GB")
    assert figure(out, "max concurrent sequences").startswith(
        "11.9 of 4,096 tokens (prompt 4,096 + output 0)"
    )


def test_seed_13b_figures_on_the_plan_object() -> None:
    plan = make_plan(PlanRequest("llama-2-13b", "a100-80g", overhead_gb=6.0, max_model_len=4096))
    assert plan.kv_bytes_per_token == 819_200
    assert plan.kv_capacity_bytes / 1e9 == pytest.approx(40.0, abs=0.1)
    assert plan.concurrency == pytest.approx(11.9, abs=0.05)  # at max_model_len, 4096


def test_seed_70b_on_h100_tpot_floor_is_42_ms() -> None:
    # the seed: 140 GB of FP16 weights / 3.35 TB/s = 42 ms a token at batch 1, the physical limit
    res = gateway_plan("--model", "llama-3.1-70b", "--gpu", "h100", "--tp", "1")
    assert res.returncode == 1  # it does not fit on one GPU, and says so
    assert "does not fit" in res.stdout and "--tp 4 fits" in res.stdout
    assert figure(res.stdout, "TPOT floor").startswith("42.1 ms at batch 1, empty context")
    plan = make_plan(PlanRequest("llama-3.1-70b", "h100", tp=1))
    assert plan.tpot_floor_s == pytest.approx(0.042, abs=0.0005)


def test_seed_14b_tpot_floor_at_8_sequences_of_7_8k_is_20_ms() -> None:
    # the seed: 8 concurrent 7.8K-token requests of Qwen2.5-14B on an A100 80 GB read 28 GB of
    # weights and 12 GB of KV a step; over 2 TB/s that is about 20 ms
    res = gateway_plan(
        "--model", "qwen2.5-14b", "--gpu", "a100-80g", "--prompt-tokens", "7800",
        "--output-tokens", "16",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    (row,) = [line for line in res.stdout.splitlines() if re.match(r"^\s+8\s+\d", line)]
    assert row.split()[1:3] == ["20.5", "ms"]
    plan = make_plan(PlanRequest("qwen2.5-14b", "a100-80g", prompt_tokens=7800, output_tokens=16))
    (eight,) = [p for p in plan.points if p.batch == 8]
    assert eight.tpot_floor_s == pytest.approx(0.020, abs=0.001)


# --- the figures follow the model -------------------------------------------------------------


def test_every_figure_is_the_performance_models() -> None:
    plan = make_plan(PlanRequest("qwen2.5-14b", "h100", prompt_tokens=2000, output_tokens=200))
    pm = plan.perf
    assert plan.fits and plan.tp == 1
    assert plan.kv_bytes_per_token == pm.kv_bytes_per_token
    assert plan.kv_capacity_bytes == pm.kv_capacity_bytes
    assert plan.concurrency == pm.max_concurrency(2200)
    assert plan.prefill_s_per_1k == pm.prefill_time(1000)
    one = plan.points[0]
    assert one.batch == 1
    assert one.tpot_s >= pm.step_time(0, 1, 2100)  # decoding, plus the next prompt's prefill
    assert one.tpot_floor_s < one.tpot_s  # the floor is a floor
    text = render(plan)
    assert f"{pm.prefill_time(1000) * 1000:.1f} ms per 1K prompt tokens" in text


def test_auto_tp_is_the_smallest_that_holds_one_sequence() -> None:
    plan = make_plan(PlanRequest("llama-3.1-70b", "h100"))
    assert plan.fits and plan.smallest_tp == plan.tp and plan.tp > 1
    smaller = make_plan(PlanRequest("llama-3.1-70b", "h100", tp=plan.tp // 2))
    assert not smaller.fits and smaller.smallest_tp == plan.tp


# --- replicas for a rate under SLOs ------------------------------------------------------------


def test_replicas_carry_the_rate_within_the_slos() -> None:
    req = PlanRequest(
        "qwen2.5-14b", "h100", prompt_tokens=1000, output_tokens=200, rate=20.0,
        ttft_slo_s=1.0, tpot_slo_s=0.05,
    )  # fmt: skip
    plan = make_plan(req)
    best = plan.best
    assert best is not None and plan.replicas is not None
    assert best.tpot_s <= 0.05 and best.ttft_s <= 1.0
    assert plan.replicas * best.requests_per_s >= 20.0 > (plan.replicas - 1) * best.requests_per_s
    bigger = [p for p in plan.points if p.batch > best.batch]
    assert all(p.tpot_s > 0.05 or p.ttft_s > 1.0 for p in bigger)
    out = render(plan)
    assert f"replicas for 20 req/s: {plan.replicas} ({plan.replicas} GPUs)" in out


def test_a_tighter_slo_needs_at_least_as_many_replicas() -> None:
    def replicas(tpot: float) -> int:
        plan = make_plan(
            PlanRequest("qwen2.5-14b", "a100-80g", prompt_tokens=500, output_tokens=300,
                        rate=50.0, tpot_slo_s=tpot)
        )  # fmt: skip
        assert plan.replicas is not None
        return plan.replicas

    counts = [replicas(t) for t in (0.2, 0.08, 0.04, 0.03)]
    assert counts == sorted(counts) and counts[0] < counts[-1]


def test_an_slo_no_batch_meets_is_said_plainly() -> None:
    plan = make_plan(
        PlanRequest("llama-2-13b", "a100-80g", prompt_tokens=3000, output_tokens=100, rate=1.0,
                    ttft_slo_s=0.05)
    )  # fmt: skip
    assert plan.best is None and plan.replicas is None
    assert "even one sequence misses the SLOs" in render(plan)


# --- the command ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--model", "gpt-9", "--gpu", "h100"), "unknown model 'gpt-9'; known: "),
        (("--model", "llama-2-13b", "--gpu", "tpu"), "unknown gpu 'tpu'; known: "),
        (("--model", "llama-2-13b", "--gpu", "h100", "--rate", "5"), "--rate needs --prompt-tokens"),
        (
            ("--model", "llama-2-13b", "--gpu", "h100", "--prompt-tokens", "10",
             "--output-tokens", "10", "--rate", "-1"),
            "--rate must be a positive",
        ),
    ],
)  # fmt: skip
def test_bad_input_exits_2_with_one_line(args: tuple[str, ...], message: str) -> None:
    res = gateway_plan(*args)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr


def test_help_lists_the_flags() -> None:
    res = gateway_plan("--help")
    assert res.returncode == 0
    for flag in ("--model", "--gpu", "--tp", "--prompt-tokens", "--output-tokens", "--rate",
                 "--ttft-slo", "--tpot-slo"):  # fmt: skip
        assert flag in res.stdout


@pytest.mark.parametrize(
    ("text", "seconds"), [("2", 2.0), ("0.5s", 0.5), ("50ms", 0.05), (" 1.5 s ", 1.5)]
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("soon")
