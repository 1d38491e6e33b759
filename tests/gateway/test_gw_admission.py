"""Admission queue: class order, fair share between tenants, head-of-line capacity, shedding,
cancellation; pure asyncio with a short real time or an injected clock."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from gateway.errors import NoReplicaAvailable, Shed
from gateway.limits.admission import Admission, QueueStats
from gateway.limits.tenants import PriorityClassConfig, default_classes

POOL = "chat"


class Capacity:
    """Replica slots of one pool as the pipeline would count them."""

    def __init__(self, adm: Admission, free: int = 0) -> None:
        self.adm = adm
        self.free = free

    def __call__(self) -> bool:
        return self.free > 0

    def add(self, n: int = 1) -> None:
        self.free += n
        self.adm.notify(POOL)


class Clock:
    def __init__(self) -> None:
        self.t = 50.0

    def __call__(self) -> float:
        return self.t


async def settle(rounds: int = 20) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


def classes(**over: PriorityClassConfig) -> dict[str, PriorityClassConfig]:
    return {**default_classes(), **over}


def client(
    adm: Admission,
    cap: Callable[[], bool],
    order: list[str],
    label: str,
    tenant: str = "t",
    priority: str = "interactive",
    weight: float = 1.0,
    hold: Capacity | None = None,
) -> asyncio.Task[float]:
    """A request: waits its turn, then 'dispatches' (takes a slot) inside the block."""

    async def run() -> float:
        async with adm.slot(POOL, tenant, weight, priority, cap) as waited:
            order.append(label)
            if hold is not None:
                hold.free -= 1
        return waited

    return asyncio.create_task(run())


async def test_fast_path_when_nothing_waits() -> None:
    adm = Admission(default_classes())
    cap = Capacity(adm, free=1)
    async with adm.slot(POOL, "t", 1.0, "interactive", cap) as waited:
        assert waited == 0.0
    st = adm.stats()
    assert st.admitted == {(POOL, "interactive", "t"): 1} and st.shed == {}


async def test_fifo_within_a_class() -> None:
    adm = Admission(default_classes())
    cap = Capacity(adm)
    order: list[str] = []
    tasks = [client(adm, cap, order, f"r{i}", hold=cap) for i in range(5)]
    await settle()
    assert adm.stats().queues[POOL]["interactive"].queued == 5
    cap.add(5)
    await asyncio.gather(*tasks)
    assert order == [f"r{i}" for i in range(5)]


async def test_interactive_overtakes_batch() -> None:
    adm = Admission(default_classes())
    cap = Capacity(adm)
    order: list[str] = []
    tasks = [client(adm, cap, order, f"b{i}", priority="batch", hold=cap) for i in range(3)]
    await settle()
    tasks += [client(adm, cap, order, f"i{i}", hold=cap) for i in range(3)]
    await settle()
    cap.add(6)
    await asyncio.gather(*tasks)
    assert order == ["i0", "i1", "i2", "b0", "b1", "b2"]


async def test_interactive_bounded_while_batch_saturates() -> None:
    """200 batch requests keep both slots busy (each held 20 ms). An interactive request that
    arrives meanwhile never queues behind that backlog: no more batch requests are admitted
    between its arrival and its own admission than there are slots (one already woken for each
    freed slot may go first), and it waits less than the oldest batch request has waited. One
    tenant sends both, so its turn comes from its class, not from fair share between tenants."""
    adm = Admission(default_classes())
    loop = asyncio.get_running_loop()
    cap = Capacity(adm, free=2)
    hold_s = 0.02
    admitted: list[str] = []

    def busy(label: str, priority: str) -> asyncio.Task[tuple[float, list[str]]]:
        async def run() -> tuple[float, list[str]]:
            arrived = len(admitted)
            async with adm.slot(POOL, "t", 1.0, priority, cap) as waited:
                ahead = admitted[arrived:]  # admitted between this one's arrival and its own
                admitted.append(label)
                cap.free -= 1
                loop.call_later(hold_s, cap.add)  # the request finishes, its slot frees
            return waited, ahead

        return asyncio.create_task(run())

    batch = [busy("bulk", "batch") for _ in range(200)]
    await asyncio.sleep(0.05)
    interactive = []
    for _ in range(8):
        interactive.append(busy("chat", "interactive"))
        await asyncio.sleep(0.03)
    got = await asyncio.gather(*interactive)
    assert all(ahead.count("bulk") <= 2 for _, ahead in got), [a for _, a in got]
    st = adm.stats().queues[POOL]["batch"]
    assert st.queued > 100  # batch keeps waiting meanwhile...
    assert st.oldest_wait_s > max(w for w, _ in got)  # ...longer than any interactive one
    for t in batch:
        t.cancel()
    await asyncio.gather(*batch, return_exceptions=True)
    assert adm.stats().queues[POOL]["batch"] == QueueStats(0, 0.0)


async def test_fair_share_between_tenants_of_one_class() -> None:
    adm = Admission(default_classes())
    cap = Capacity(adm)
    order: list[str] = []
    tasks = [client(adm, cap, order, "A", tenant="A", hold=cap) for _ in range(100)]
    await settle()
    tasks += [client(adm, cap, order, "B", tenant="B", hold=cap) for _ in range(10)]
    await settle()
    cap.add(110)
    await asyncio.gather(*tasks)
    last_b = max(i for i, who in enumerate(order) if who == "B")
    assert last_b < 21, order[:30]


async def test_weights_are_respected() -> None:
    adm = Admission(default_classes())
    cap = Capacity(adm)
    order: list[str] = []
    tasks = [client(adm, cap, order, "A", tenant="A", weight=3, hold=cap) for _ in range(60)]
    tasks += [client(adm, cap, order, "B", tenant="B", weight=1, hold=cap) for _ in range(60)]
    await settle()
    cap.add(40)
    await settle(200)
    assert len(order) == 40
    assert abs(order.count("A") - 30) <= 1
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_idle_tenant_gets_no_banked_credit() -> None:
    adm = Admission(default_classes())
    cap = Capacity(adm)
    order: list[str] = []
    tasks = [client(adm, cap, order, "A", tenant="A", hold=cap) for _ in range(30)]
    await settle()
    cap.add(20)
    await settle(100)  # A alone for 20 grants; B was idle, it banks nothing
    tasks += [client(adm, cap, order, "B", tenant="B", hold=cap) for _ in range(10)]
    await settle()
    cap.add(10)
    await settle(100)
    assert order[20:30].count("B") == 5  # alternates from here on, no B burst
    cap.add(10)
    await asyncio.gather(*tasks)


async def test_queue_full_is_shed_at_once() -> None:
    cls = classes(interactive=PriorityClassConfig(rank=0, max_queue_wait_s=5, max_queue_len=2))
    adm = Admission(cls, shed_status=503)
    cap = Capacity(adm)
    tasks = [client(adm, cap, [], "x", hold=cap) for _ in range(2)]
    await settle()
    with pytest.raises(Shed) as info:
        async with adm.slot(POOL, "t", 1.0, "interactive", cap):
            pytest.fail("entered a full queue")
    exc = info.value
    assert exc.status == 503 and exc.retry_after is not None and exc.retry_after >= 1
    assert "'interactive' queue of pool 'chat' is full" in exc.message
    assert adm.stats().shed == {(POOL, "interactive", "t", "queue_full"): 1}
    cap.add(2)
    await asyncio.gather(*tasks)


async def test_zero_queue_len_never_queues() -> None:
    cls = classes(batch=PriorityClassConfig(rank=1, max_queue_wait_s=5, max_queue_len=0))
    adm = Admission(cls)
    with pytest.raises(Shed):
        async with adm.slot(POOL, "t", 1.0, "batch", lambda: False):
            pass


async def test_max_wait_is_shed_with_retry_after() -> None:
    cls = classes(interactive=PriorityClassConfig(rank=0, max_queue_wait_s=0.1, max_queue_len=9))
    adm = Admission(cls)
    cap = Capacity(adm)
    with pytest.raises(Shed) as info:
        async with adm.slot(POOL, "t", 1.0, "interactive", cap):
            pytest.fail("entered without capacity")
    exc = info.value
    assert exc.status == 429 and exc.code == "overloaded"
    assert exc.headers()["retry-after"] == "1"
    assert (
        "after waiting 0.1 s in the 'interactive' queue of pool 'chat' (limit 0.1 s)" in exc.message
    )
    assert adm.stats().shed == {(POOL, "interactive", "t", "timeout"): 1}
    assert adm.stats().queues[POOL]["interactive"].queued == 0


async def test_max_wait_by_injected_clock_and_stats() -> None:
    clock = Clock()
    adm = Admission(default_classes(), clock=clock)
    cap = Capacity(adm)
    batch = client(adm, cap, [], "b", priority="batch")
    await settle()
    clock.t += 1.5
    inter = client(adm, cap, [], "i")
    await settle()
    st = adm.stats().queues[POOL]
    assert st["batch"] == QueueStats(1, 1.5) and st["interactive"] == QueueStats(1, 0.0)
    clock.t += 2.0  # past interactive's 2 s, far from batch's 120 s
    adm.notify(POOL)
    with pytest.raises(Shed, match="'interactive' queue"):
        await inter
    assert not batch.done()
    clock.t += 200
    adm.notify(POOL)
    with pytest.raises(Shed, match="'batch' queue"):
        await batch


async def test_cancelled_waiter_is_removed_and_next_proceeds() -> None:
    adm = Admission(default_classes())
    cap = Capacity(adm)
    order: list[str] = []
    tasks = []
    for name in ("1", "2", "3"):
        tasks.append(client(adm, cap, order, name, hold=cap))
        await settle()
    first, second, third = tasks
    second.cancel()
    await settle()
    assert adm.stats().queues[POOL]["interactive"].queued == 2
    cap.add(1)
    await first
    cap.add(1)
    await third
    assert order == ["1", "3"] and second.cancelled()
    assert adm.stats().queues[POOL]["interactive"].queued == 0


async def test_cancelled_woken_head_passes_the_wake_on() -> None:
    adm = Admission(default_classes())
    cap = Capacity(adm)
    order: list[str] = []
    a = client(adm, cap, order, "a", hold=cap)
    await settle()
    b = client(adm, cap, order, "b", hold=cap)
    await settle()
    cap.add(1)  # wakes a ...
    a.cancel()  # ... which leaves before it ran
    await settle()
    assert b.done() and order == ["b"]  # b got the slot in those few turns, waiting no timer
    with pytest.raises(asyncio.CancelledError):
        await a


async def test_head_without_capacity_holds_everyone() -> None:
    adm = Admission(default_classes())
    head_ok = False
    order: list[str] = []
    head = client(adm, lambda: head_ok, order, "head")
    await settle()
    behind = client(adm, lambda: True, order, "batch", priority="batch")
    await settle()
    adm.notify(POOL)
    await settle()
    # a newcomer with capacity does not slip past either
    late = client(adm, lambda: True, order, "late")
    await settle()
    assert order == [] and not head.done() and not behind.done() and not late.done()
    head_ok = True
    adm.notify(POOL)
    await asyncio.gather(head, behind, late)
    assert order == ["head", "late", "batch"]


async def test_woken_head_without_capacity_keeps_its_place() -> None:
    adm = Admission(default_classes())
    cap = Capacity(adm)
    order: list[str] = []
    first = client(adm, cap, order, "first", hold=cap)
    await settle()
    cap.add(1)  # wakes first ...
    cap.free = 0  # ... but the slot is gone before it runs
    await settle()
    assert not first.done() and order == []
    second = client(adm, cap, order, "second", hold=cap)
    await settle()
    cap.add(2)
    await asyncio.gather(first, second)
    assert order == ["first", "second"]


async def test_one_head_at_a_time_sees_a_fresh_picture() -> None:
    adm = Admission(default_classes())
    cap = Capacity(adm)
    order: list[str] = []
    tasks = [client(adm, cap, order, str(i), hold=cap) for i in range(5)]
    await settle()
    cap.free = 2  # two slots freed at once; one notify
    adm.notify(POOL)
    await settle(100)
    assert order == ["0", "1"] and cap.free == 0  # the third saw no capacity and waits
    cap.add(3)
    await asyncio.gather(*tasks)


async def test_next_head_waits_until_the_block_has_dispatched() -> None:
    adm = Admission(default_classes())
    cap = Capacity(adm)
    taken: list[int] = []

    async def routed() -> None:
        async with adm.slot(POOL, "t", 1.0, "interactive", cap):
            await asyncio.sleep(0.01)  # routing awaits the index; capacity is not yet taken
            adm.notify(POOL)  # e.g. a health change meanwhile: still one head at a time
            await asyncio.sleep(0.01)
            cap.free -= 1
            taken.append(cap.free)

    tasks = [asyncio.create_task(routed()) for _ in range(4)]
    await settle()
    cap.add(1)
    await asyncio.sleep(0.1)
    assert taken == [0]
    cap.add(3)
    await asyncio.gather(*tasks)
    assert min(taken) >= 0 and len(taken) == 4


async def test_error_inside_the_block_passes_the_turn() -> None:
    adm = Admission(default_classes())
    cap = Capacity(adm)
    order: list[str] = []

    async def failing() -> None:
        async with adm.slot(POOL, "t", 1.0, "interactive", cap):
            raise NoReplicaAvailable("no replica")

    f = asyncio.create_task(failing())
    await settle()
    ok = client(adm, cap, order, "ok", hold=cap)
    await settle()
    cap.add(1)
    with pytest.raises(NoReplicaAvailable):
        await f
    await ok
    assert order == ["ok"]


async def test_bad_arguments() -> None:
    adm = Admission(default_classes())
    with pytest.raises(ValueError, match="unknown priority class 'gold'"):
        async with adm.slot(POOL, "t", 1.0, "gold", lambda: True):
            pass
    with pytest.raises(ValueError, match="weight"):
        async with adm.slot(POOL, "t", 0, "batch", lambda: True):
            pass


async def test_many_waiters_cancelled_at_once_do_not_break_the_queue() -> None:
    """Regression: cancelling queued tasks finishes their wake futures before their own cleanup
    runs; a notify() in between must skip them, not assert, and wake the next live waiter."""
    adm = Admission(classes())
    free = False
    served: list[int] = []

    async def request(i: int) -> None:
        async with adm.slot("p", "t", 1.0, "interactive", lambda: free):
            served.append(i)

    tasks = [asyncio.create_task(request(i)) for i in range(20)]
    await asyncio.sleep(0)  # all of them queue
    for t in tasks[:15]:
        t.cancel()  # clients gone at once
    free = True
    adm.notify("p")  # before the cancelled tasks have run their cleanup
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results[:15])
    assert results[15:] == [None] * 5 and served == [15, 16, 17, 18, 19]
