"""Real vLLM (CPU build) for the engine tests: two replicas of a tiny model made here, started
once for the package (`bench.engine.fleet`), stopped by process group at its end; a test that
needs both replicas alive revives one an earlier test killed (`Engine.revive`).

Without an engine interpreter (`scripts/ensure-engine`) the tests skip, unless
KVGW_REQUIRE_ENGINE=1 (CI sets it): then they fail, so a CI run can never pass without them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench.engine.fleet import EngineFleet, engine_python, missing
from bench.engine.model import make_model_dir, tokenizer_dir
from bench.harness import Served, serving
from gateway import create_app, parse_config
from tests.vllm_facts import MAX_MODEL_LEN, MODEL

KV_BLOCKS = 384  # 12,288 tokens a replica: a few 3K-token prompts evict the oldest


@dataclass
class Engine:
    fleet: EngineFleet
    model_dir: Path  # ChatML (a Qwen2)
    llama_dir: Path  # the same tokenizer with a Llama-3-style template (checked by /tokenize)

    @property
    def urls(self) -> list[str]:
        return self.fleet.urls

    def revive(self) -> None:
        """Start again any replica an earlier test killed."""
        for i, m in enumerate(self.fleet.members):
            if not m.alive():
                self.fleet.restart(i)


# one fleet for the package's modules (each start is ~60-90 s on 2 cores); stopped when the
# package ends, so the rest of the suite runs without it
@pytest.fixture(scope="package")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    why = missing()
    if why is not None:
        if os.environ.get("KVGW_REQUIRE_ENGINE") == "1":
            pytest.fail(f"KVGW_REQUIRE_ENGINE=1 but {why}")
        pytest.skip(why)
    root = tmp_path_factory.mktemp("engine")
    with ThreadPoolExecutor(2) as pool:  # two transformers start-ups side by side
        made = [pool.submit(make_model_dir, root / name, template, engine_python=engine_python())
                for name, template in (("tiny", "chatml"), ("tiny-llama", "llama3"))]  # fmt: skip
        model, llama = (m.result() for m in made)
    fleet = EngineFleet(model, replicas=2, model=MODEL, max_model_len=MAX_MODEL_LEN,
                        kv_blocks=KV_BLOCKS, log_dir=root / "logs")  # fmt: skip
    fleet.start()
    try:
        yield Engine(fleet, model, llama)
    finally:
        fleet.stop()


@pytest.fixture(scope="session")
def plain_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model's tokenizer as `tokenizers` trained it, before transformers loaded it."""
    return tokenizer_dir(tmp_path_factory.mktemp("plain-tokenizer"))


@contextlib.asynccontextmanager
async def gateway(config: dict[str, Any], **app: Any) -> AsyncIterator[tuple[Served, Any]]:
    """The gateway app on loopback, lifespan on; yields (served, app)."""
    application = create_app(parse_config(config), **app)
    async with serving(application, lifespan="on") as served:
        yield served, application
