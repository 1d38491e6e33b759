"""The performance model against the seeds' worked figures and formulas."""

from __future__ import annotations

import pytest

from simulator import Engine, build_config, get_gpu, get_model
from simulator.perf_model import PerfModel, auto_tp


def test_kv_bytes_per_token_match_the_seeds() -> None:
    assert get_model("llama-2-13b").kv_bytes_per_token == 819_200  # 2 x 40 x 40 x 128 x 2
    assert get_model("qwen2.5-14b").kv_bytes_per_token == 196_608  # 2 x 48 x 8 x 128 x 2
    assert get_model("llama-3.1-70b").kv_bytes_per_token == 327_680  # 2 x 80 x 8 x 128 x 2


def test_13b_on_80gb_holds_about_40gb_of_kv_and_11_9_sequences_of_4k() -> None:
    # the seed: 80 GB x 0.90 - 26 GB weights - 6 GB overhead = 40 GB; 40 / 3.36 = 11.9
    pm = PerfModel(get_model("llama-2-13b"), get_gpu("a100-80g"), gpu_memory_utilization=0.9)
    assert pm.weight_bytes_per_gpu / 1e9 == pytest.approx(26.0, abs=0.1)
    assert pm.kv_capacity_bytes / 1e9 == pytest.approx(40.0, abs=0.1)
    assert 4096 * pm.kv_bytes_per_token / 1e9 == pytest.approx(3.36, abs=0.01)
    assert pm.max_concurrency(4096) == pytest.approx(11.9, abs=0.05)


def test_gqa_fits_about_four_times_the_sequences_of_mha() -> None:
    mha = build_config("llama-2-13b", "a100-80g").perf
    gqa = build_config("qwen2.5-14b", "a100-80g").perf
    ratio = mha.kv_bytes_per_token / gqa.kv_bytes_per_token
    assert ratio == pytest.approx(4.17, abs=0.01)
    assert gqa.max_concurrency(4096) > 3.5 * mha.max_concurrency(4096)


def test_70b_needs_tensor_parallelism() -> None:
    m = get_model("llama-3.1-70b")
    assert auto_tp(m, get_gpu("a100-80g"), max_model_len=m.max_model_len) == 4
    assert auto_tp(m, get_gpu("h100"), max_model_len=m.max_model_len) == 4
    assert auto_tp(m, get_gpu("h200"), max_model_len=m.max_model_len) == 2
    with pytest.raises(ValueError, match="KV cache holds"):
        build_config("llama-3.1-70b", "a100-80g", tensor_parallel_size=2)
    tp4 = build_config("llama-3.1-70b", "a100-80g").perf
    assert tp4.kv_bytes_per_token_per_gpu == 327_680 / 4  # 8 KV heads shard over 4 GPUs


def test_prefill_time_is_linear_in_uncached_tokens() -> None:
    pm = build_config("qwen2.5-14b", "a100-80g").perf
    per_token = 2 * 14.77e9 / (312e12 * 0.5)  # 2 x params / (FLOP/s x MFU)
    assert pm.prefill_s_per_token == pytest.approx(per_token)
    for n in (1, 100, 2048, 8000):
        assert pm.prefill_time(n) == pytest.approx(n * per_token)
    assert pm.prefill_time(4000) == pytest.approx(2 * pm.prefill_time(2000))


def test_decode_step_grows_with_batch_kv_as_the_bandwidth_formula_says() -> None:
    pm = build_config("qwen2.5-14b", "a100-80g").perf
    bw = 2.039e12 * 0.9  # HBM bandwidth x MBU
    weights = 14.77e9 * 2
    for n_seqs, kv_tokens in ((1, 1000), (8, 8 * 4096), (32, 32 * 2000)):
        expected = (weights + kv_tokens * 196_608) / bw
        assert pm.decode_time(n_seqs, kv_tokens) == pytest.approx(expected)
    # the seed's case: 28 GB weights + 12 GB KV over 2 TB/s is about 20 ms a step
    assert pm.decode_time(8, int(12e9 / 196_608)) == pytest.approx(0.0226, abs=0.002)
    step = pm.step_time
    assert step(0.0, 8, 20_000) - step(0.0, 8, 10_000) == pytest.approx(10_000 * 196_608 / bw)


def test_a_mixed_step_costs_what_both_cost() -> None:
    pm = build_config("qwen2.5-14b", "a100-80g").perf
    prefill = pm.prefill_time(1000)
    mixed = pm.step_time(prefill, 16, 16 * 1000)
    assert mixed == pytest.approx(pm.step_overhead_s + prefill + pm.decode_time(16, 16_000))
    # prefill alone still reads the weights once; large prefills are compute-bound
    assert pm.step_time(pm.prefill_time(1), 0, 0) == pytest.approx(
        pm.step_overhead_s + pm.weight_read_s
    )
    assert pm.step_time(pm.prefill_time(4096), 0, 0) == pytest.approx(
        pm.step_overhead_s + pm.prefill_time(4096)
    )


def test_attention_flops_are_opt_in_and_quadratic() -> None:
    base = build_config("qwen2.5-14b", "a100-80g").perf
    att = build_config("qwen2.5-14b", "a100-80g", prefill_attention=True).perf
    assert att.prefill_time(1000) > base.prefill_time(1000)
    extra_1k = att.prefill_time(1000) - base.prefill_time(1000)
    extra_2k = att.prefill_time(2000) - base.prefill_time(2000)
    assert extra_2k == pytest.approx(4 * extra_1k, rel=0.01)


def _ttft(engine: Engine, prompt: list[int]) -> float:
    seq = engine.add_request(
        f"r{len(engine.requests)}-{len(prompt)}", prompt, arrival_s=engine.now_s, max_tokens=1
    )
    while not seq.finished:
        engine.begin_step(engine.now_s)
        engine.end_step()
    assert seq.first_token_s is not None
    return seq.first_token_s - seq.arrival_s


def test_ttft_of_a_fully_cached_prompt_is_far_below_an_uncached_one() -> None:
    engine = Engine(build_config("qwen2.5-14b", "a100-80g"))
    prompt = list(range(100, 4100))
    cold = _ttft(engine, prompt)
    warm = _ttft(engine, prompt)
    assert cold == pytest.approx(engine.perf.step_overhead_s + engine.perf.prefill_time(4000))
    assert warm < cold / 20
    assert engine.counters.cached_prompt_tokens == 4000 - 16  # the last block is recomputed
