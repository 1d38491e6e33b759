"""Many deadlines of one fixed delay on one loop timer.

The server's connections and requests each wait on deadlines of a fixed length: a kept-alive
connection's idle timeout, the request-header deadline, the disconnect watch that starts
`endpoint.WATCH_AFTER_S` into a request. A loop timer per deadline costs 2-4 us to make and
cancel under uvloop, and a request made three. Deadlines of one delay expire in the order they
were armed, so a `FixedDelay` keeps them in an insertion-ordered dict: arming is a dict store,
disarming a pop, and one loop timer, at the oldest deadline (no sooner than `tick_s` after the
last firing), fires everything due. A deadline fires up to `tick_s` late, and a steady stream of
short-lived deadlines costs at most `1 / tick_s` loop timers a second, however many requests.

`shared(loop, delay_s, tick_s)` is the loop's queue of that delay, for everything on that loop.
Deadlines of varying length (an upstream response's header, idle and total timeouts) wait on the
upstream client's slotted wheel instead (`gateway/transport/client.py` `_Timers`).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable, Hashable
from weakref import WeakKeyDictionary

log = logging.getLogger("gateway")

Callback = Callable[[], object]
EARLY_S = 1e-3  # loop timers may fire up to this much early: what is due this soon fires now


class _Firing:
    def cancel(self) -> None:
        pass


_FIRING: asyncio.TimerHandle = _Firing()  # type: ignore[assignment]


class FixedDelay:
    __slots__ = ("loop", "delay_s", "tick_s", "due", "_timer")

    def __init__(self, loop: asyncio.AbstractEventLoop, delay_s: float, tick_s: float) -> None:
        self.loop = loop
        self.delay_s = delay_s
        self.tick_s = tick_s
        self.due: dict[Hashable, tuple[float, Callback]] = {}  # oldest first
        self._timer: asyncio.TimerHandle | None = None

    def arm(self, key: Hashable, callback: Callback) -> None:
        """Call `callback` `delay_s` from now (up to `tick_s` later) unless `disarm(key)` comes
        first; arming an armed `key` again restarts its delay."""
        due = self.due
        if key in due:
            del due[key]  # to the end: the dict stays in deadline order
        at = self.loop.time() + self.delay_s
        due[key] = (at, callback)
        if self._timer is None:
            # in a context of its own: the request that armed the first deadline would else be
            # kept alive by every timer after it (its context vars: its BodyWriter, its trace)
            self._timer = self.loop.call_at(at, self._fire, context=contextvars.Context())

    def disarm(self, key: Hashable) -> None:
        """`key`'s callback is not called (nothing when it is not armed). The loop timer stays:
        it fires into what is due then, or nothing."""
        self.due.pop(key, None)

    def _fire(self) -> None:
        self._timer = _FIRING  # a callback's `arm` makes no timer: this sets the next one
        due = self.due
        now = self.loop.time()
        while due:
            key = next(iter(due))
            at, callback = due[key]
            if at > now + EARLY_S:
                self._timer = self.loop.call_at(
                    max(at, now + self.tick_s), self._fire, context=contextvars.Context()
                )
                return
            del due[key]
            try:
                callback()  # it may arm or disarm others: the loop looks again each time
            except Exception:
                log.exception("a deadline's callback failed")
        self._timer = None

    def close(self) -> None:
        """Drop every deadline and the loop timer."""
        self.due.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


_SHARED: WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[float, float], FixedDelay]] = (
    WeakKeyDictionary()
)


def shared(loop: asyncio.AbstractEventLoop, delay_s: float, tick_s: float) -> FixedDelay:
    """The queue of `delay_s` deadlines that everything on `loop` shares."""
    queues = _SHARED.get(loop)
    if queues is None:
        queues = _SHARED[loop] = {}
    queue = queues.get((delay_s, tick_s))
    if queue is None:
        queue = queues[delay_s, tick_s] = FixedDelay(loop, delay_s, tick_s)
    return queue
