"""Drives an Engine in wall-clock time: a simulated second lasts 1/speedup wall seconds.

Steps run back to back on simulated time; the runner sleeps until each step's end is due, so
tokens reach clients at the simulated step times. When the CPU cannot keep up it stops
sleeping and catches up, and simulated time stays consistent (arrivals are never stamped
later than the step that admits them).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from collections.abc import Sequence as Seq

from simulator.engine import Engine, StepResult
from simulator.sequence import Sequence


class EngineRunner:
    """The asyncio task that steps one engine; `submit` and `abort` are its only inputs."""

    def __init__(self, engine: Engine, *, speedup: float = 1.0,
                 on_step: Callable[[StepResult], None] | None = None) -> None:
        if speedup <= 0:
            raise ValueError("speedup must be > 0")
        self.engine = engine
        self.speedup = speedup
        self.on_step = on_step
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._anchor = 0.0
        self._wake_at: float | None = None  # latest arrival while the engine idled

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._anchor = loop.time()
        self._task = loop.create_task(self._run(), name="simulator-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def sim_now(self) -> float:
        """Simulated seconds since the runner started."""
        return (asyncio.get_running_loop().time() - self._anchor) * self.speedup

    def submit(self, request_id: str, prompt: Seq[int], *, max_tokens: int | None,
               priority: int = 0, cache_salt: str | None = None,
               sink: Callable[[Sequence], None] | None = None, tag: int = 0,
               greedy: bool = False) -> Sequence:
        engine = self.engine
        step = engine.in_flight
        if step is not None:
            arrival = min(self.sim_now(), step.end_s)
        else:
            arrival = max(engine.now_s, self.sim_now())
            self._wake_at = arrival  # the step that wakes the engine starts at the last one
        seq = engine.add_request(request_id, prompt, arrival_s=arrival, max_tokens=max_tokens,
                                 priority=priority, cache_salt=cache_salt, greedy=greedy)
        seq.sink = sink
        seq.tag = tag
        self._wake.set()
        return seq

    def abort(self, seq: Sequence) -> None:
        self.engine.abort(seq.id)

    async def _run(self) -> None:
        engine = self.engine
        loop = asyncio.get_running_loop()
        while True:
            if not engine.has_work:
                self._wake.clear()
                await self._wake.wait()
                continue
            start = engine.now_s
            if self._wake_at is not None:
                start = max(start, self._wake_at)
                self._wake_at = None
            step = engine.begin_step(start)
            if step is None:  # nothing runnable (cannot happen with a valid config)
                self._wake.clear()
                await self._wake.wait()
                continue
            delay = self._anchor + step.end_s / self.speedup - loop.time()
            await asyncio.sleep(max(0.0, delay))
            result = engine.end_step()
            if self.on_step is not None:
                self.on_step(result)
            for seq in result.emitted:
                if seq.sink is not None:
                    seq.sink(seq)
