"""`python -m bench.resume`: streams that survive a replica killed and one drained (issue 41).

Three real vLLM CPU replicas (`bench.engine`) of the tiny model behind a gateway app in this
process (tokens mode, prefix-aware). 50 concurrent greedy chat streams (`ignore_eos`, a fixed
`max_tokens`; 5 shared documents, 10 questions each) run twice: once undisturbed (the reference,
which also warms the prefix caches), then again while one replica is killed (SIGKILL) and
another drained through the admin API once the streams are under way. Every answer of the second
run is checked against the first, id for id (the gateway relays the ids the client asks for) and
text for text; its length must be its `max_tokens` and its usage must count each token once.
The kill comes once every stream has its first token (a failure before it is a plain failover).

Printed: the share of streams that finished whole and exact; the resumes by trigger and outcome
(`gateway_stream_resumes_total`); the resume gap p50/p99 (the client's wait between the last
token before the failure and the first after it: the request log's `resume_gap_s`); and the
extra prefill a resume costs against starting over: the tokens the
continuations' engines computed (their prompt less what was cached) over what a restart would
compute (each resumed answer's prompt and the tokens it had already sent, generated again).

    .venv/bin/python -m bench.resume                 # starts 3 replicas (~2 min), ~3 min in all
    .venv/bin/python -m bench.resume --sim           # the same against simulated replicas
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.access_log import access_lines
from bench.harness import serving
from gateway import create_app, parse_config

MODEL = "tiny"
KEY = "bench-admin"


@dataclass
class Stream:
    prompt: int
    text: str = ""
    ids: list[int] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    errors: list[Any] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # monotonic time of each token chunk

    def widest_gap(self) -> float:
        return max((b - a for a, b in zip(self.times, self.times[1:], strict=False)), default=0.0)


def prompts(n: int) -> list[list[dict[str, str]]]:
    from simulator.workloads import text

    docs = [text(f"resume-doc-{d}", 120) for d in range(5)]
    return [[{"role": "system", "content": docs[i % 5]},
             {"role": "user", "content": f"Question {i}: {text(f'q-{i}', 4)}"}]
            for i in range(n)]  # fmt: skip


class Started:
    """Set once `n` streams have their first tokens."""

    def __init__(self, n: int) -> None:
        self.left, self.event = n, asyncio.Event()

    def one(self) -> None:
        self.left -= 1
        if self.left <= 0:
            self.event.set()


async def one(http: httpx.AsyncClient, url: str, i: int, messages: Any, n: int,
              started: Started | None = None) -> Stream:  # fmt: skip
    s = Stream(i)
    body = {"model": MODEL, "messages": messages, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    buf = b""
    texts: list[str] = []
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        async for chunk in r.aiter_bytes():
            buf += chunk
            *blocks, buf = buf.split(b"\n\n")
            for block in blocks:
                if not block.startswith(b"data: ") or block == b"data: [DONE]":
                    continue
                e = orjson.loads(block[6:])
                if "error" in e:
                    s.errors.append(e["error"])
                    continue
                s.usage = e.get("usage") or s.usage
                for c in e["choices"]:
                    got = c.get("token_ids") or []
                    if got:
                        s.ids.extend(got)
                        s.times.append(time.monotonic())
                    texts.append(c["delta"].get("content") or "")
            if started is not None and s.ids:
                started.one()
                started = None
    s.text = "".join(texts)
    return s


def metric(text: str, name: str, *keys: str) -> dict[tuple[str, ...], float]:
    """A family's samples summed by the labels `keys`."""
    out: dict[tuple[str, ...], float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line[: line.index("}")]))
            k = tuple(labels.get(key, "") for key in keys)
            out[k] = out.get(k, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def run(urls: list[str], kill: Any, args: argparse.Namespace, tokenizer: str | None) -> int:
    reps = [{"url": u, "name": f"r{i}"} for i, u in enumerate(urls)]
    chunking: dict[str, Any] = ({"mode": "tokens", "tokenizer": tokenizer, "block_size": 32}
                                if tokenizer else {"mode": "bytes"})  # fmt: skip
    cfg = {"server": {"admin_key": KEY}, "index": {"chunking": chunking},
           "pools": {"chat": {"replicas": reps, "policy": "prefix_aware",
                              "scrape": {"interval_s": 0.2},
                              "health": {"interval_s": 0.5, "timeout_s": 1.0},
                              "timeouts": {"connect_s": 2, "first_byte_s": 120, "idle_s": 30,
                                           "total_s": 600}}}}  # fmt: skip
    msgs = prompts(args.streams)
    app = create_app(parse_config(cfg))
    async with serving(app, lifespan="on") as gw, httpx.AsyncClient(timeout=600) as http:
        t0 = time.monotonic()
        ref = await asyncio.gather(*(one(http, gw.url, i, m, args.max_tokens)
                                     for i, m in enumerate(msgs)))  # fmt: skip
        ref_s = time.monotonic() - t0
        bad_ref = [s.prompt for s in ref if s.errors or len(s.ids) != args.max_tokens]
        started = Started(len(msgs))
        t0 = time.monotonic()
        with access_lines() as log:
            tasks = [asyncio.ensure_future(one(http, gw.url, i, m, args.max_tokens, started))
                     for i, m in enumerate(msgs)]  # fmt: skip
            await started.event.wait()  # every stream under way: a failure now is mid-stream
            await asyncio.sleep(args.delay_s)
            snap = app.gateway.current
            live = {r.name: len(r.streams) for r in snap.replicas()}
            victim, drained = sorted(live, key=lambda n: -live[n])[:2]  # the busiest two
            kill(int(victim[1:]))
            t_kill = time.monotonic()
            await asyncio.sleep(args.delay_s)
            res = await http.post(gw.url + f"/admin/replicas/{drained}/drain",
                                  headers={"authorization": f"Bearer {KEY}"})  # fmt: skip
            t_drain = time.monotonic()
            got = await asyncio.gather(*tasks)
            run_s = time.monotonic() - t0
            metrics = (await http.get(gw.url + "/metrics")).text
    resumes = metric(metrics, "gateway_stream_resumes_total", "trigger", "outcome")
    tokens = {k[0]: v for k, v in metric(metrics, "gateway_stream_resume_tokens_total", "kind").items()}
    whole = [s for s in got if not s.errors and len(s.ids) == args.max_tokens
             and (s.usage or {}).get("completion_tokens") == args.max_tokens]  # fmt: skip
    exact = [s for s in whole if s.ids == ref[s.prompt].ids and s.text == ref[s.prompt].text]
    resumed_n = int(sum(v for k, v in resumes.items() if k[1] in ("resumed", "inexact")))
    gaps = [float(line["resume_gap_s"]) for line in log if line.get("resume_gap_s") is not None]
    normal = [s.widest_gap() for s in ref]
    prompt_tokens = statistics.mean((s.usage or {}).get("prompt_tokens", 0) for s in ref)
    relayed = tokens.get("relayed", 0.0)
    restart = resumed_n * prompt_tokens + relayed
    prefilled = tokens.get("prefilled", 0.0)
    print(f"Resume under failures ({args.replicas} {'simulated' if args.sim else 'real vLLM'} "
          f"replicas, {args.streams} concurrent greedy streams of {args.max_tokens} tokens, "
          f"prompts ~{prompt_tokens:.0f} tokens)")  # fmt: skip
    print(f"reference run: {ref_s:.1f} s, {len(ref) - len(bad_ref)}/{len(ref)} whole")
    print(f"run with {victim} killed at +{t_kill - t0:.1f} s and {drained} drained at "
          f"+{t_drain - t0:.1f} s ({res.json().get('handed_over')} streams handed over): "
          f"{run_s:.1f} s")  # fmt: skip
    print(f"streams whole: {len(whole)}/{len(got)} ({len(whole) / len(got):.0%}); exact (ids "
          f"and text equal to the reference): {len(exact)}/{len(got)}; client errors: "
          f"{sum(bool(s.errors) for s in got)}")  # fmt: skip
    diverged = [next((j for j, (a, b) in enumerate(zip(s.ids, ref[s.prompt].ids, strict=False)) if a != b),
                     min(len(s.ids), len(ref[s.prompt].ids)))
                for s in got if s not in exact]  # fmt: skip
    if diverged:
        print(f"not exact: first differing token at {sorted(diverged)} (batching changes a "
              "bf16 CPU engine's greedy argmax too: compare with the undisturbed runs)")
    print("resumes (trigger, outcome): " + ", ".join(
        f"{k[0]}/{k[1]}={v:.0f}" for k, v in sorted(resumes.items()) if v))  # fmt: skip
    print(f"resume gap ({len(gaps)} resumed streams; the last token before the failure to the "
          f"first after, request log): p50 {pct(gaps, 0.5) * 1000:.0f} ms, p99 "
          f"{pct(gaps, 0.99) * 1000:.0f} ms; widest gap of an undisturbed stream: p50 "
          f"{pct(normal, 0.5) * 1000:.0f} ms, p99 {pct(normal, 0.99) * 1000:.0f} ms")  # fmt: skip
    print(f"extra prefill: resumes computed {prefilled:.0f} prompt tokens (cached "
          f"{tokens.get('cached', 0):.0f}, relayed {relayed:.0f}); a restart of each would "
          f"compute {restart:.0f} (its prompt and the tokens sent again): resume/restart = "
          f"{prefilled / restart if restart else float('nan'):.3f}")  # fmt: skip
    return 0 if len(exact) == len(got) and not bad_ref else 1


async def amain(args: argparse.Namespace) -> int:
    os.environ.setdefault("OTEL_TRACES_EXPORTER", "none")
    if args.sim:
        from simulator import Fleet

        async with Fleet(n=args.replicas, speedup=args.speedup, served_model_name=MODEL) as fleet:

            def kill(i: int) -> None:
                asyncio.ensure_future(fleet.stop(i))  # connections reset, port closed

            return await run(fleet.urls, kill, args, None)
    from bench.engine.fleet import EngineFleet, engine_python
    from bench.engine.model import make_model_dir

    with tempfile.TemporaryDirectory(prefix="kvgw-resume-") as tmp:
        model = make_model_dir(Path(tmp) / MODEL, "chatml", engine_python=engine_python())
        with EngineFleet(model, replicas=args.replicas, model=MODEL, log_dir=Path(tmp)) as fleet:
            return await run(fleet.urls, fleet.kill, args, str(model))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.resume", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--streams", type=int, default=50)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--delay-s", type=float, default=0.5,
                    help="after the streams are under way: before the kill, then the drain")
    ap.add_argument("--sim", action="store_true", help="simulated replicas instead of vLLM")
    ap.add_argument("--speedup", type=float, default=2.0, help="--sim: simulated time speedup")
    return asyncio.run(amain(ap.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
