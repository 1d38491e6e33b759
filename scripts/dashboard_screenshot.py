"""Regenerate docs/img/dashboard.png: the status page of a gateway in front of simulated replicas.

    .venv/bin/python scripts/dashboard_screenshot.py [out.png] [--seconds 150]

Starts a simulator fleet (four chat replicas, one long-context replica), a gateway in front of it,
drives a few hundred chat requests with shared prefixes at a varying rate, kills one replica part
way so its circuit opens, then screenshots /dashboard with headless Chromium while load continues.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway import create_app, parse_config  # noqa: E402
from simulator import Fleet  # noqa: E402
from tests.support import chromium, serving  # noqa: E402

KEY = "demo-admin-key"


async def drive(url: str, model: str, seconds: float, stop: asyncio.Event) -> int:
    rng = random.Random(7)
    systems = [
        f"You are assistant #{i}. " + "Follow the house style guide. " * (20 + 15 * i)
        for i in range(6)
    ]
    documents = ["Quarterly report section. " * 700, "Contract clause text. " * 800]
    sent = 0
    tasks: set[asyncio.Task[None]] = set()
    async with httpx.AsyncClient(timeout=60) as client:

        async def one(i: int) -> None:
            if rng.random() < 0.08:
                content = rng.choice(documents) + f"Summarise part {i}."
                messages = [{"role": "user", "content": content}]
            else:
                messages = [
                    {"role": "system", "content": rng.choice(systems)},
                    {"role": "user", "content": f"Question {i}: " + "why? " * rng.randint(5, 80)},
                ]
            body = {
                "model": model,
                "messages": messages,
                "stream": True,
                "max_tokens": rng.randint(16, 160),
            }
            try:
                async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
                    await resp.aread()
            except httpx.HTTPError:
                pass

        start = time.monotonic()
        while not stop.is_set():
            t = time.monotonic() - start
            rate = 3.5 + 2.5 * math.sin(t / 20) if t < seconds else 3.0
            await asyncio.sleep(rng.expovariate(rate))
            task = asyncio.create_task(one(sent))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            sent += 1
        await asyncio.gather(*tasks)
    return sent


async def main(out: Path, seconds: float) -> None:
    async with (
        Fleet(n=4, speedup=1.0, seed=1) as chat_fleet,
        Fleet(n=1, speedup=1.0, seed=9) as long_fleet,
    ):
        model = chat_fleet.replicas[0].model_name
        chat = [{"url": u, "name": f"chat-{i}"} for i, u in enumerate(chat_fleet.urls)]
        cfg = {
            "server": {"admin_key": KEY},
            "pools": {
                "chat": {"replicas": chat, "policy": "prefix_aware", "scrape": {"interval_s": 0.5}},
                "long_context": {
                    "replicas": [{"url": long_fleet.urls[0], "name": "long-0"}],
                    "policy": "least_loaded",
                    "scrape": {"interval_s": 0.5},
                },
            },
            "routes": [
                {"match": {"min_prompt_tokens": 3000}, "pool": "long_context"},
                {"match": {}, "pool": "chat"},
            ],
        }
        app = create_app(parse_config(cfg))
        async with serving(app, lifespan="on") as gw:
            stop = asyncio.Event()
            load = asyncio.create_task(drive(gw.url, model, seconds, stop))
            await asyncio.sleep(seconds * 0.7)
            await chat_fleet.stop(3)  # a replica dies: its circuit opens
            await asyncio.sleep(seconds * 0.3)
            with tempfile.TemporaryDirectory() as profile:
                await chromium(f"{gw.url}/dashboard#key={KEY}", f"--screenshot={out}",
                               "--hide-scrollbars", profile=Path(profile), window="1400,1250",
                               budget_ms=3000)  # fmt: skip
            stop.set()
            print(f"{await load} requests; screenshot in {out}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", type=Path, default=ROOT / "docs/img/dashboard.png")
    ap.add_argument("--seconds", type=float, default=150.0)
    args = ap.parse_args()
    asyncio.run(main(args.out.resolve(), args.seconds))
