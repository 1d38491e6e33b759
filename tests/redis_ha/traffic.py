"""Chat traffic through a real gateway for the HA tests: prefix groups (a long shared system prompt
each, a fresh question per request), every status kept, and the gateway's predicted prefix-hit
counters read from /metrics."""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

KEY = "sk-ha-tenant-5f1c0a77"
TIGHT = "sk-ha-tight-9d02e4b1"
TENANTS = [
    {"name": "t", "api_keys": [KEY], "limits": {"requests_per_minute": 1_000_000}},
    {"name": "tight", "api_keys": [TIGHT], "limits": {"requests_per_minute": 3}},
]


# Every request must be answered well within this (the rig's upstream total_s is 30 s): a
# request that hangs shows as an error naming it, not as the test's own timeout.
_ANSWER_WITHIN = aiohttp.ClientTimeout(total=20)


def system_prompt(group: int) -> str:
    """About 2 KB (32 blocks of 64 bytes), different from the first block on."""
    return f"[group {group:03d}] You answer questions about topic {group}. " + (
        f"Context line {group} repeats to make a long shared prefix. " * 36
    )


def body(group: int, question: int) -> dict[str, Any]:
    return {
        "model": "test-model",
        "messages": [
            {"role": "system", "content": system_prompt(group)},
            {"role": "user", "content": f"question {question}?"},
        ],
    }


_SERIES = re.compile(rb"^(gateway_predicted_hit_blocks_total|gateway_prompt_blocks_total)\{[^}]*\} (\S+)$", re.M)  # fmt: skip


async def hit_totals(h: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """(predicted hit blocks, prompt blocks) so far, over every pool."""
    async with h.get(url + "/metrics") as res:
        text = await res.read()
    totals = {b"gateway_predicted_hit_blocks_total": 0.0, b"gateway_prompt_blocks_total": 0.0}
    for name, value in _SERIES.findall(text):
        totals[name] += float(value)
    return totals[b"gateway_predicted_hit_blocks_total"], totals[b"gateway_prompt_blocks_total"]


async def limited(h: aiohttp.ClientSession, url: str, key: str, n: int) -> list[int]:
    """Statuses of `n` sequential requests with tenant key `key`."""
    out = []
    for i in range(n):
        headers = {"authorization": f"Bearer {key}"}
        async with h.post(
            url + "/v1/chat/completions", json=body(999, i), headers=headers, timeout=_ANSWER_WITHIN
        ) as r:
            await r.read()
            out.append(r.status)
    return out


@dataclass
class Traffic:
    """`concurrency` clients cycling over `groups` prefix groups until stopped."""

    h: aiohttp.ClientSession
    url: str
    groups: int = 8
    concurrency: int = 2
    pace_s: float = 0.0  # pause between one client's requests
    statuses: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _counter: itertools.count[int] = field(default_factory=itertools.count)

    def start(self) -> Traffic:
        self._tasks = [asyncio.create_task(self._client()) for _ in range(self.concurrency)]
        return self

    async def _client(self) -> None:
        headers = {"authorization": f"Bearer {KEY}"}
        while not self._stop.is_set():
            n = next(self._counter)
            try:
                async with self.h.post(
                    self.url + "/v1/chat/completions", json=body(n % self.groups, n),
                    headers={**headers, "x-request-id": f"ha-{n}"}, timeout=_ANSWER_WITHIN,
                ) as res:  # fmt: skip
                    text = await res.text()
                    self.statuses.append(res.status)
                    self.times.append(time.monotonic())
                    if res.status != 200:
                        self.errors.append(f"{res.status}: {text[:200]}")
            except (aiohttp.ClientError, TimeoutError) as exc:  # a hang fails here, named
                self.statuses.append(-1)
                self.errors.append(f"request ha-{n}: {exc!r}")
            if self.pace_s:
                await asyncio.sleep(self.pace_s)

    async def wait_for(self, count: int, timeout_s: float = 20) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.statuses) < count:
            assert time.monotonic() < deadline, f"{len(self.statuses)} of {count} requests"
            assert all(not t.done() for t in self._tasks), "a traffic client stopped"
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
