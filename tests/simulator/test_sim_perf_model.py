"""The performance model against the seeds' worked figures and formulas, and its new terms."""

from __future__ import annotations

import pytest

from simulator import Engine, build_config, get_gpu, get_model
from simulator.perf_model import PerfModel, auto_tp, jitter_factor
from simulator.profiles import GIB, GpuProfile


def test_kv_bytes_per_token_match_the_seeds() -> None:
    assert get_model("llama-2-13b").kv_bytes_per_token == 819_200  # 2 x 40 x 40 x 128 x 2
    assert get_model("qwen2.5-14b").kv_bytes_per_token == 196_608  # 2 x 48 x 8 x 128 x 2
    assert get_model("llama-3.1-70b").kv_bytes_per_token == 327_680  # 2 x 80 x 8 x 128 x 2


# the seed's accounting: an "80 GB" card in decimal GB and a flat 6 GB of overhead
SEED_80GB = GpuProfile("seed-80g", memory_gb=80, hbm_tbps=2.039, dense_tflops=312,
                       overhead_gb=6.0)


def test_13b_on_80gb_holds_about_40gb_of_kv_and_11_9_sequences_of_4k() -> None:
    # the seed: 80 GB x 0.90 - 26 GB weights - 6 GB overhead = 40 GB; 40 / 3.36 = 11.9
    pm = PerfModel(get_model("llama-2-13b"), SEED_80GB, gpu_memory_utilization=0.9)
    assert pm.weight_bytes_per_gpu / 1e9 == pytest.approx(26.0, abs=0.1)
    assert pm.kv_capacity_bytes / 1e9 == pytest.approx(40.0, abs=0.1)
    assert 4096 * pm.kv_bytes_per_token / 1e9 == pytest.approx(3.36, abs=0.01)
    assert pm.max_concurrency(4096) == pytest.approx(11.9, abs=0.05)
    # an explicit overhead_gb keeps the seeds' rule on any profile
    a100 = PerfModel(get_model("llama-2-13b"), get_gpu("a100-80g"), overhead_gb=6.0)
    assert a100.kv_capacity_bytes / 1e9 == pytest.approx(40.0, abs=0.1)


def test_kv_capacity_follows_the_engines_rule_in_gib() -> None:
    pm = build_config("llama-3.1-70b", "h100", tensor_parallel_size=4).perf
    act = pm.activation_peak_bytes()
    assert 0.3e9 < act < 3e9  # 8192 tokens' MLP intermediates and 256 sequences' logits
    expected = 79.1 * GIB * 0.9 - 70.55e9 * 2 / 4 - act - pm.engine.non_torch_gib * GIB
    assert pm.kv_capacity_bytes_per_gpu == pytest.approx(expected)
    bigger = build_config("llama-3.1-70b", "h100", tensor_parallel_size=4,
                          max_num_batched_tokens=32768).perf
    assert bigger.kv_capacity_bytes_per_gpu < pm.kv_capacity_bytes_per_gpu


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


def test_fp8_weights_and_kv() -> None:
    bf16 = build_config("llama-3.1-70b", "h100", tensor_parallel_size=4).perf
    fp8 = build_config("llama-3.1-70b", "h100", tensor_parallel_size=4, weight_dtype="fp8",
                       kv_cache_dtype="fp8").perf
    m = bf16.model
    # FP8 checkpoint: quantized layers at 1 byte, embeddings and LM head kept at 2
    assert fp8.weight_bytes == pytest.approx(m.params + m.embedding_params)
    assert fp8.kv_bytes_per_token == 327_680 / 2
    # FP8 matmuls run at the FP8 peak: half the prefill time per token
    assert fp8.prefill_s_per_token == pytest.approx(bf16.prefill_s_per_token / 2, rel=0.01)
    # an A100 has no FP8 units: FP8 weights halve the bytes, not the compute
    a100 = build_config("llama-3.1-70b", "a100-80g", tensor_parallel_size=4,
                        weight_dtype="fp8").perf
    a100_bf16 = build_config("llama-3.1-70b", "a100-80g", tensor_parallel_size=4).perf
    assert a100.prefill_s_per_token == pytest.approx(a100_bf16.prefill_s_per_token)
    assert a100.weight_read_s < 0.55 * a100_bf16.weight_read_s
    with pytest.raises(ValueError, match="unknown kv cache dtype"):
        build_config("qwen2.5-14b", "h100", kv_cache_dtype="fp4")


def test_moe_computes_active_params_and_reads_routed_experts() -> None:
    pm = build_config("deepseek-v3", "h200", tensor_parallel_size=8).perf
    m = pm.model
    assert pm.prefill_s_per_token == pytest.approx(2 * 37e9 / pm.effective_flops)
    assert pm.kv_bytes_per_token_per_gpu == 61 * 576 * 2  # MLA: one latent, on every GPU
    one, many = pm.weight_read_time(1), pm.weight_read_time(256)
    share = m.expert_params / m.params
    assert one == pytest.approx(pm.weight_read_s * (1 - share * (1 - 8 / 256)))
    assert one < 0.1 * many and many == pytest.approx(pm.weight_read_s, rel=0.01)


def test_prefill_time_is_linear_in_uncached_tokens() -> None:
    pm = build_config("qwen2.5-14b", "a100-80g").perf
    gpu = get_gpu("a100-80g")
    per_token = 2 * 14.77e9 / (312e12 * gpu.mfu)  # 2 x params / (FLOP/s x MFU)
    assert pm.prefill_s_per_token == pytest.approx(per_token)
    for n in (1, 100, 2048, 8000):
        assert pm.prefill_time(n) == pytest.approx(n * per_token)
    assert pm.prefill_time(4000) == pytest.approx(2 * pm.prefill_time(2000))


def test_decode_step_grows_with_batch_kv_as_the_bandwidth_formula_says() -> None:
    pm = build_config("qwen2.5-14b", "a100-80g").perf
    bw = 2.039e12 * get_gpu("a100-80g").mbu  # HBM bandwidth x MBU
    weights = 14.77e9 * 2 - 152064 * 5120 * 2  # the input embedding is gathered, not read
    for n_seqs, kv_tokens in ((1, 1000), (8, 8 * 4096), (32, 32 * 2000)):
        expected = (weights + kv_tokens * 196_608) / bw
        assert pm.decode_time(n_seqs, kv_tokens) == pytest.approx(expected)
    # the seed's case: 28 GB weights + 12 GB KV over 2 TB/s is about 20 ms a step
    assert pm.decode_time(8, int(12e9 / 196_608)) == pytest.approx(0.022, abs=0.002)
    step = pm.step_time
    assert step(0, 8, 20_000) - step(0, 8, 10_000) == pytest.approx(10_000 * 196_608 / bw)


def test_a_mixed_step_reads_the_weights_once() -> None:
    pm = build_config("qwen2.5-14b", "a100-80g").perf
    decode_only = pm.step_time(0, 16, 16 * 1000)
    prefill_only = pm.step_time(1000, 0, 0)
    mixed = pm.step_time(1000, 16, 16 * 1000)
    assert mixed < decode_only + prefill_only - pm.step_overhead_s - 0.5 * pm.weight_read_s
    assert pm.seq_s > 0  # the engine's CPU time per running sequence (calibrated)
    assert mixed == pytest.approx(pm.step_overhead_s + pm.prefill_time(1016) + 16 * pm.seq_s
                                  + 16 * 1000 * pm.kv_read_s_per_token)
    # prefill alone still reads the weights once; large prefills are compute-bound
    assert pm.step_time(1, 0, 0) == pytest.approx(pm.step_overhead_s + pm.weight_read_s)
    assert pm.step_time(4096, 0, 0) == pytest.approx(pm.step_overhead_s + pm.prefill_time(4096))


def test_fixed_step_cost_does_not_shrink_with_tp_and_communication_grows() -> None:
    gpu = get_gpu("h100")
    costs = {}
    for tp in (2, 4, 8):
        pm = build_config("llama-3.1-70b", "h100", tensor_parallel_size=tp,
                          weight_dtype="fp8", max_model_len=8192).perf
        costs[tp] = pm
        layers = pm.model.layers
        fixed = pm.engine.step_ms * 1e-3 + layers * gpu.layer_us * 1e-6
        fixed += 2 * layers * gpu.allreduce_us * 1e-6
        assert pm.comm_s_per_token > 0
        assert pm.step_overhead_s == pytest.approx(fixed)
    # TPOT = a + b / tp: the constant part stays
    t = {tp: pm.step_time(0, 1, 1000) for tp, pm in costs.items()}
    assert t[8] > costs[8].step_overhead_s > 0.004
    assert t[2] / t[8] < 2.5  # weights alone would give 4


def test_request_latency_has_a_fixed_and_a_per_token_part() -> None:
    pm = build_config("qwen2.5-14b", "h100").perf
    e = pm.engine
    assert pm.request_latency_s(0) == pytest.approx(e.request_ms * 1e-3)
    assert pm.request_latency_s(1000) - pm.request_latency_s(0) == pytest.approx(
        1000 * e.request_us_per_token * 1e-6)


def test_jitter_is_seeded_small_and_mean_one() -> None:
    xs = [jitter_factor(3, i, 0.05) for i in range(20_000)]
    assert xs == [jitter_factor(3, i, 0.05) for i in range(20_000)]
    assert sum(xs) / len(xs) == pytest.approx(1.0, abs=0.002)
    sd = (sum((x - 1) ** 2 for x in xs) / len(xs)) ** 0.5
    assert sd == pytest.approx(0.05, rel=0.05)
    assert min(xs) >= 0.85 and max(xs) <= 1.15
    assert jitter_factor(3, 5, 0.0) == 1.0 and jitter_factor(4, 5, 0.05) != xs[5]


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
    engine = Engine(build_config("qwen2.5-14b", "a100-80g", jitter_cv=0.0))
    prompt = list(range(100, 4100))
    cold = _ttft(engine, prompt)
    warm = _ttft(engine, prompt)
    assert cold == pytest.approx(engine.perf.step_time(4000, 0, 0))
    assert cold == pytest.approx(engine.perf.step_overhead_s + engine.perf.prefill_time(4000))
    assert warm < cold / 20
    assert engine.counters.cached_prompt_tokens == 4000 - 16  # the last block is recomputed


def test_fp8_kv_doubles_the_capacity_but_decodes_at_the_16_bit_read_time() -> None:
    m, g = get_model("llama-3.1-70b"), get_gpu("h200")
    bf16 = PerfModel(m, g, tp=1, weight_dtype="fp8")
    fp8 = PerfModel(m, g, tp=1, weight_dtype="fp8", kv_cache_dtype="fp8")
    assert fp8.kv_capacity_tokens == pytest.approx(2 * bf16.kv_capacity_tokens, abs=2)
    assert fp8.kv_read_s_per_token == pytest.approx(bf16.kv_read_s_per_token)
    # the calibration data's saturated H200 TP 1 rows (bench/fidelity.py) need it: 32 clients
    # of 8K + 1K hold ~295K tokens
    assert bf16.kv_capacity_tokens < 32 * 9216 < fp8.kv_capacity_tokens
