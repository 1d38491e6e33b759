"""The comparison's workloads, as vLLM's benchmark client takes them (`bench.engine.client`).

- `trace-prefill`, `trace-decode`: the public Mooncake trace (`../shared/traces`) in record
  order, one user message of text per record, each 512-token hash block one fixed text chunk
  of `TRACE_BLOCK_TOKENS` pieces (equal ids, equal text: `bench.shapes.trace`); answers of at
  most 16 tokens (the record's own length, capped), or of 256 tokens each.
- `prefix_repetition`: vLLM's own dataset (`--dataset-name prefix_repetition`): 16 shared
  prefixes of 1,024 tokens (together more than one replica's KV space), 64-token suffixes,
  16-token answers.
- `multi_turn`: growing chats (`bench.shapes.multi_turn`: a shared system message, the whole
  history resent each turn), each turn written out as one text message (`role: content` lines),
  in arrival order; 32-token answers.

Each is run at `load` times the fleet's measured capacity for it (`bench.engine_routing`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.engine.client import dataset_args
from bench.shapes import multi_turn, trace

TRACE_BLOCK_TOKENS = 12  # pieces a 512-token hash block becomes: records of ~100-1,000 tokens
ROWS = 600  # rows written; a run takes the first n


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    describe: str
    build: Callable[[Path, int, int], list[str]]  # (dir, requests, seed) -> the client's args
    multiple: int = 1  # the dataset makes a multiple of this many requests


def _write(rows: list[dict[str, object]], path: Path) -> list[str]:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return dataset_args(path)


def _trace(out_tokens: int | None) -> Callable[[Path, int, int], list[str]]:
    def build(tmp: Path, n: int, seed: int) -> list[str]:
        rows: list[dict[str, object]] = []
        for r in trace(max(n, 2), 1.0, seed, block_tokens=TRACE_BLOCK_TOKENS, max_output=16):
            got = r.body["max_tokens"] if out_tokens is None else out_tokens
            rows.append({"prompt": r.body["messages"][0]["content"], "output_tokens": got})
        return _write(rows[:n], tmp / f"trace-{out_tokens}-{n}.jsonl")

    return build


def _multi_turn(tmp: Path, n: int, seed: int) -> list[str]:
    rows: list[dict[str, object]] = []
    for r in multi_turn(n, 1.0, seed, turns=4, systems=2, system_tokens=300,
                        user_tokens=(20, 60), reply_tokens=40):  # fmt: skip
        lines = [f"{m['role']}: {m['content']}" for m in r.body["messages"]]
        rows.append({"prompt": "\n".join(lines), "output_tokens": 32})
    return _write(rows[:n], tmp / f"multi-turn-{n}.jsonl")


def _prefix_repetition(tmp: Path, n: int, seed: int) -> list[str]:
    return ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "1024",
            "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", "16",
            "--prefix-repetition-output-len", "16"]  # fmt: skip


WORKLOADS = {
    w.name: w
    for w in (
        Workload("trace-prefill", "the public trace as text, answers <= 16 tokens", _trace(None)),
        Workload("trace-decode", "the public trace as text, answers of 256 tokens", _trace(256)),
        Workload("prefix_repetition", "vLLM's prefix_repetition: 16 x 1,024-token prefixes",
                 _prefix_repetition, multiple=16),
        Workload("multi_turn", "growing chats, 4 turns, 2 system prompts", _multi_turn),
    )
}
