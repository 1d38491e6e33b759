"""`python -m simulator`, run as an operator would; the package's public surface."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import httpx
import pytest

import simulator

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
