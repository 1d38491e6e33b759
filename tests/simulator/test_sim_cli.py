"""`python -m simulator` and `python -m simulator.report`, run as an operator would."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import httpx
import pytest

import simulator
from simulator import report
from simulator.profiles import load_gpus, load_models

ROOT = Path(__file__).resolve().parents[2]


async def test_cli_serves_replicas_until_sigterm() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "simulator", "--replicas", "2", "--port", "0",
        "--model", "llama-2-13b", "--gpu", "h100", "--speedup", "1000",
        "--max-num-seqs", "8", "--no-enable-prefix-caching", "--output-len", "fixed:3",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env, cwd=ROOT)
    try:
        assert proc.stdout is not None
        lines = [(await asyncio.wait_for(proc.stdout.readline(), 30)).decode() for _ in range(2)]
        urls = [line.split()[2] for line in lines]
        assert all(line.startswith(f"replica {i} http://127.0.0.1:") for i, line in
                   enumerate(lines))
        assert "model=llama-2-13b gpu=h100 tp=1" in lines[0]
        async with httpx.AsyncClient(timeout=10) as http:
            for url in urls:
                r = await http.post(url + "/v1/completions", json={"prompt": "hello"})
                assert r.json()["usage"]["completion_tokens"] == 3
                assert (await http.get(url + "/sim/stats")).json()["prefix_hit_tokens"] == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()


async def test_cli_rejects_a_bad_configuration() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "simulator", "--model", "gpt-9",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env, cwd=ROOT)
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2 and b"unknown model 'gpt-9'" in err


def test_capacity_table_lists_every_model_and_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert report.main(["--table", "capacity"]) == 0
    out = capsys.readouterr().out
    # the engine's rule: 79.2 GiB x 0.9 - 26 GB weights - activation peak - 1 GiB non-torch
    assert "| llama-2-13b | a100-80g | 1 | 26.0 | 819,200 | 48.6 |" in out
    assert "| qwen2.5-14b | a100-80g | 1 |" in out and "| llama-3.1-70b | h200 | 2 |" in out
    assert "| deepseek-v3 | h200 | 8 |" in out and "| deepseek-v3 | a100-80g | > 8 |" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) - 1 == len(load_models()) * len(load_gpus())


async def test_prefix_cache_cuts_ttft_in_the_report_workload() -> None:
    rows = await report.cache_rows("qwen2.5-14b", "a100-80g", [1.0], 120, seed=0)
    on, off = rows
    assert on["cache"] == "on" and off["cache"] == "off"
    assert float(on["hit_ratio"]) > 0.85 and float(off["hit_ratio"]) == 0.0
    # both pay the request latency outside the engine (about 60 ms for 2,100 tokens)
    assert float(on["ttft_p50"]) < float(off["ttft_p50"]) / 3
    assert "| 1 | on |" in report.cache_table(rows)


def test_public_surface() -> None:
    assert set(simulator.__all__) == {
        "ByteTokenizer", "ClosedLoop", "Cluster", "Engine", "EngineConfig", "Fault", "Fleet", "GpuProfile",
        "ModelProfile", "OutputLengths", "PerfModel", "Replica", "ReplicaLoad", "RequestRecord",
        "Router", "RunResult", "SimRequest", "Tokenizer", "TokenizerJson", "build_config",
        "chat_requests", "get_gpu", "get_model", "run"}
    for name in simulator.__all__:
        assert getattr(simulator, name) is not None


def test_bad_overrides_and_profiles_are_named() -> None:
    with pytest.raises(ValueError, match="unknown engine option"):
        simulator.build_config(max_num_sequences=4)
    with pytest.raises(ValueError, match="unknown gpu 'tpu'"):
        simulator.build_config(gpu="tpu")
    with pytest.raises(ValueError, match="bad output length spec"):
        simulator.OutputLengths.parse("normal:3")
