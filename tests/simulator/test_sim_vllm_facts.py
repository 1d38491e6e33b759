"""The simulator answers what real vLLM answers (`tests/vllm_facts.py`, recorded from vLLM 0.32;
tests/engine/test_engine_vllm.py checks the record against the real engine)."""

from __future__ import annotations

from pathlib import Path

import httpx

from bench.engine.model import lora_dir, tokenizer_dir
from simulator import Fleet
from simulator.lora import LoraConfig
from tests.vllm_facts import FACTS, MAX_MODEL_LEN, MODEL, ask, lora_facts, token_id_problems


async def test_the_simulator_answers_as_vllm(tmp_path: Path) -> None:
    tok = tokenizer_dir(tmp_path / "tok")
    missing = str(tmp_path / "none")
    facts = (*FACTS, *lora_facts(str(lora_dir(tmp_path / "adapter")), missing))
    lora = LoraConfig(max_loras=2, runtime_updating=True, missing=(missing,))
    async with (
        Fleet(n=1, model="qwen2.5-7b", speedup=1000.0, served_model_name=MODEL, tokenizer=tok,
              max_model_len=MAX_MODEL_LEN, block_size=32, lora=lora) as fleet,
        httpx.AsyncClient(timeout=60) as http,
    ):
        problems = {f.name: await ask(http, fleet.urls[0], f) for f in facts}
    assert {name: p for name, p in problems.items() if p} == {}


async def test_the_simulator_answers_token_ids_as_vllm() -> None:
    async with (
        Fleet(n=1, model="qwen2.5-7b", speedup=1000.0, served_model_name=MODEL,
              max_model_len=MAX_MODEL_LEN, block_size=32) as fleet,
        httpx.AsyncClient(timeout=60) as http,
    ):
        assert await token_id_problems(http, fleet.urls[0]) == []
