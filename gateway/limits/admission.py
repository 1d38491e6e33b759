"""Admission: per pool, a wait for capacity ordered by class, tenant fair share, then arrival.

One head at a time is woken and routes inside its `slot()` block; too long a wait is shed.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from types import TracebackType

from gateway.errors import Shed
from gateway.limits.tenants import PriorityClassConfig

Clock = Callable[[], float]

_GO = "go"
_SHED = "shed"
_RETRY_AFTER_MAX_S = 30.0


@dataclass(eq=False, slots=True)
class _Waiter:
    tenant: str
    klass: str
    tag: float  # virtual finish tag within the class
    seq: int  # arrival order, breaks tag ties
    since: float
    deadline: float
    has_capacity: Callable[[], bool]
    queued: bool = True
    wake: asyncio.Future[str] | None = None


@dataclass(slots=True)
class _ClassQueue:
    config: PriorityClassConfig
    heap: list[tuple[float, int, _Waiter]] = field(default_factory=list)  # lazy deletion
    fifo: deque[_Waiter] = field(default_factory=deque)  # arrival order, for expiry; lazy too
    live: int = 0
    vtime: float = 0.0  # finish tag of the last waiter let in
    last_tag: dict[str, float] = field(default_factory=dict)  # per tenant, while it has waiters
    tenant_live: dict[str, int] = field(default_factory=dict)

    def push(self, w: _Waiter) -> None:
        heapq.heappush(self.heap, (w.tag, w.seq, w))
        self.fifo.append(w)
        self.live += 1
        self.tenant_live[w.tenant] = self.tenant_live.get(w.tenant, 0) + 1

    def remove(self, w: _Waiter) -> None:
        w.queued = False
        self.live -= 1
        n = self.tenant_live[w.tenant] - 1
        if n:
            self.tenant_live[w.tenant] = n
        else:  # an idle tenant keeps no credit and no debt
            del self.tenant_live[w.tenant]
            self.last_tag.pop(w.tenant, None)
        if len(self.heap) > 64 and len(self.heap) > 2 * self.live:
            self.heap = [e for e in self.heap if e[2].queued]
            heapq.heapify(self.heap)
            self.fifo = deque(x for x in self.fifo if x.queued)

    def head(self) -> _Waiter | None:
        while self.heap and not self.heap[0][2].queued:
            heapq.heappop(self.heap)
        return self.heap[0][2] if self.heap else None

    def oldest(self) -> _Waiter | None:
        while self.fifo and not self.fifo[0].queued:
            self.fifo.popleft()
        return self.fifo[0] if self.fifo else None


@dataclass(slots=True)
class _PoolQueue:
    classes: list[tuple[str, _ClassQueue]]  # by rank
    turn: _Waiter | None = None  # the woken head, until it has dispatched or stepped back

    def queued(self) -> int:
        return sum(cq.live for _, cq in self.classes)

    def head(self) -> _Waiter | None:
        for _, cq in self.classes:
            w = cq.head()
            if w is not None:
                return w
        return None


@dataclass(frozen=True, slots=True)
class QueueStats:
    queued: int
    oldest_wait_s: float


@dataclass(frozen=True, slots=True)
class AdmissionStats:
    queues: dict[str, dict[str, QueueStats]]  # pool -> class -> now
    admitted: dict[tuple[str, str, str], int]  # (pool, class, tenant) -> total
    shed: dict[tuple[str, str, str, str], int]  # (pool, class, tenant, reason) -> total


class Slot:
    """One request's `async with` on `Admission.slot`: enters at once, without a generator, when
    nothing waits in the pool and it has capacity (the usual case); else waits in the queue."""

    __slots__ = ("_adm", "_pool", "_tenant", "_weight", "_priority", "_has_capacity", "_pq",
                 "_queued")  # fmt: skip

    def __init__(
        self, adm: Admission, pool: str, tenant: str, weight: float, priority: str,
        has_capacity: Callable[[], bool],
    ) -> None:  # fmt: skip
        self._adm = adm
        self._pool = pool
        self._tenant = tenant
        self._weight = weight
        self._priority = priority
        self._has_capacity = has_capacity
        self._pq: _PoolQueue | None = None
        self._queued: AbstractAsyncContextManager[float] | None = None

    async def __aenter__(self) -> float:
        adm, pool, priority = self._adm, self._pool, self._priority
        if priority not in adm._classes:
            raise ValueError(f"unknown priority class {priority!r}")
        if not self._weight > 0:
            raise ValueError("weight must be > 0")
        pq = adm._pool(pool)
        if pq.queued() == 0 and pq.turn is None and self._has_capacity():
            adm._count_admitted(pool, priority, self._tenant)
            self._pq = pq
            return 0.0
        self._queued = adm._queued(pool, pq, self._tenant, self._weight, priority, self._has_capacity)
        return await self._queued.__aenter__()

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        if self._queued is not None:
            return await self._queued.__aexit__(et, e, tb)
        if self._pq is not None:
            self._adm._pump(self._pool, self._pq)
        return None


class Admission:
    """Priority queues per pool in front of replica capacity.

    `slot()` enters at once when nothing waits in the pool and `has_capacity()`; otherwise it waits
    its turn. Nothing here counts replica slots: the caller releases them when a request finishes
    and calls `notify(pool)` then, and whenever capacity may have grown (health change).
    `has_capacity` must be cheap, synchronous and must not raise.
    """

    def __init__(
        self,
        classes: Mapping[str, PriorityClassConfig],
        shed_status: int = 429,
        clock: Clock = time.monotonic,
    ) -> None:
        if not classes:
            raise ValueError("at least one priority class is required")
        self._classes = dict(sorted(classes.items(), key=lambda kv: kv[1].rank))
        self._shed_status = shed_status
        self._clock = clock
        self._pools: dict[str, _PoolQueue] = {}
        self._seq = itertools.count()
        self._admitted: dict[tuple[str, str, str], int] = {}
        self._shed: dict[tuple[str, str, str, str], int] = {}

    def _pool(self, name: str) -> _PoolQueue:
        pq = self._pools.get(name)
        if pq is None:
            pq = _PoolQueue([(n, _ClassQueue(c)) for n, c in self._classes.items()])
            self._pools[name] = pq
        return pq

    def slot(
        self,
        pool: str,
        tenant: str,
        weight: float,
        priority: str,
        has_capacity: Callable[[], bool],
    ) -> Slot:
        """`async with` it: waits for this request's turn and gives the seconds waited; the
        block routes and dispatches."""
        return Slot(self, pool, tenant, weight, priority, has_capacity)

    @asynccontextmanager
    async def _queued(
        self,
        pool: str,
        pq: _PoolQueue,
        tenant: str,
        weight: float,
        priority: str,
        has_capacity: Callable[[], bool],
    ) -> AsyncIterator[float]:
        """The wait in the queue (`Slot`'s when it cannot enter at once)."""
        cq = next(c for n, c in pq.classes if n == priority)
        cfg = cq.config
        if cq.live >= cfg.max_queue_len:
            self._count_shed(pool, priority, tenant, "queue_full")
            raise Shed(
                f"The '{priority}' queue of pool '{pool}' is full ({cq.live} waiting); retry later",
                status=self._shed_status,
                retry_after=_retry_after(cfg),
            )
        now = self._clock()
        tag = max(cq.vtime, cq.last_tag.get(tenant, 0.0)) + 1.0 / weight
        cq.last_tag[tenant] = tag
        w = _Waiter(
            tenant, priority, tag, next(self._seq), now, now + cfg.max_queue_wait_s, has_capacity
        )
        w.wake = asyncio.get_running_loop().create_future()
        cq.push(w)
        self._pump(pool, pq)  # the newcomer may be head while capacity waits unclaimed
        await self._wait(pool, pq, cq, w)
        waited = self._clock() - w.since
        self._count_admitted(pool, priority, tenant)
        try:
            yield waited
        finally:
            pq.turn = None
            self._pump(pool, pq)

    async def _wait(self, pool: str, pq: _PoolQueue, cq: _ClassQueue, w: _Waiter) -> None:
        """Return once `w` is the woken head with capacity (then out of the queue, holding the turn)."""
        loop = asyncio.get_running_loop()
        while True:
            assert w.wake is not None
            timer = None
            if not w.wake.done():
                left = max(0.0, w.deadline - self._clock())
                timer = loop.call_later(left, self._expire, pool, pq, cq, w)
            try:
                outcome = await w.wake
            except asyncio.CancelledError:
                self._drop(pool, pq, cq, w)
                raise
            finally:
                if timer is not None:
                    timer.cancel()
            if outcome == _SHED:
                raise self._timed_out(pool, w)
            if w.has_capacity():
                cq.remove(w)
                cq.vtime = max(cq.vtime, w.tag)
                return  # keeps pq.turn until the caller's block is done
            # no capacity after all: back to waiting in the same place; the next notify() wakes it
            pq.turn = None
            w.wake = loop.create_future()
            if self._clock() >= w.deadline:
                self._drop(pool, pq, cq, w)
                raise self._timed_out(pool, w)

    def _drop(self, pool: str, pq: _PoolQueue, cq: _ClassQueue, w: _Waiter) -> None:
        """Take a waiter out (cancelled or expired) and pass the wake-up on if it held the turn."""
        if w.queued:
            cq.remove(w)
        if pq.turn is w:
            pq.turn = None
        self._pump(pool, pq)

    def _expire(self, pool: str, pq: _PoolQueue, cq: _ClassQueue, w: _Waiter) -> None:
        if w.queued and w.wake is not None and not w.wake.done():
            cq.remove(w)
            w.wake.set_result(_SHED)
            self._pump(pool, pq)

    def _timed_out(self, pool: str, w: _Waiter) -> Shed:
        cfg = self._classes[w.klass]
        self._count_shed(pool, w.klass, w.tenant, "timeout")
        waited = self._clock() - w.since
        return Shed(
            f"Request shed after waiting {waited:.1f} s in the '{w.klass}' queue of pool "
            f"'{pool}' (limit {cfg.max_queue_wait_s:g} s); retry later",
            status=self._shed_status,
            retry_after=_retry_after(cfg),
        )

    def notify(self, pool: str) -> None:
        """A replica slot of `pool` freed, or its capacity may have changed: wake the head."""
        pq = self._pools.get(pool)
        if pq is not None:
            self._pump(pool, pq)

    def _pump(self, pool: str, pq: _PoolQueue) -> None:
        if pq.turn is not None:
            return
        self._expire_overdue(pq)
        while True:
            head = pq.head()
            if head is None or head.wake is None or not head.wake.done():
                break
            # its task was cancelled (client gone) and has not run its own cleanup yet
            next(cq for n, cq in pq.classes if n == head.klass).remove(head)
        if head is None or not head.has_capacity():
            return
        assert head.wake is not None
        pq.turn = head
        head.wake.set_result(_GO)

    def _expire_overdue(self, pq: _PoolQueue) -> None:
        """Shed waiters past their deadline by the injected clock (timers cover real time)."""
        now = self._clock()
        for _, cq in pq.classes:
            while (w := cq.oldest()) is not None and w.deadline <= now:
                cq.remove(w)
                if w.wake is not None and not w.wake.done():
                    w.wake.set_result(_SHED)

    def _count_admitted(self, pool: str, klass: str, tenant: str) -> None:
        k = (pool, klass, tenant)
        self._admitted[k] = self._admitted.get(k, 0) + 1

    def _count_shed(self, pool: str, klass: str, tenant: str, reason: str) -> None:
        k = (pool, klass, tenant, reason)
        self._shed[k] = self._shed.get(k, 0) + 1

    def stats(self) -> AdmissionStats:
        now = self._clock()
        queues: dict[str, dict[str, QueueStats]] = {}
        for name, pq in self._pools.items():
            per: dict[str, QueueStats] = {}
            for klass, cq in pq.classes:
                oldest = cq.oldest()
                per[klass] = QueueStats(cq.live, now - oldest.since if oldest else 0.0)
            queues[name] = per
        return AdmissionStats(queues, dict(self._admitted), dict(self._shed))


def _retry_after(cfg: PriorityClassConfig) -> float:
    return min(max(1.0, cfg.max_queue_wait_s), _RETRY_AFTER_MAX_S)


def shed_all(admission: Admission) -> int:
    """Shed every waiter of a retired Admission (its classes were reconfigured); returns how many."""
    n = 0
    for pool, pq in admission._pools.items():  # noqa: SLF001 - same module family, retiring it whole
        for _, cq in pq.classes:
            while (w := cq.oldest()) is not None:
                cq.remove(w)
                if w.wake is not None and not w.wake.done():
                    w.wake.set_result(_SHED)
                    n += 1
        admission.notify(pool)
    return n
