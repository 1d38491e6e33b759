"""`gateway/transport/delays.py`: deadlines of one fixed delay on one loop timer, and what the server's
connections wait on with it (the keep-alive timeout, served by a real uvicorn over real sockets)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars

import uvicorn

from gateway.transport import delays
from gateway.transport.protocol import GuardedHttpToolsProtocol


def pending_timers(loop: asyncio.AbstractEventLoop) -> int:
    return sum(not h.cancelled() for h in loop._scheduled)  # type: ignore[attr-defined]


async def test_deadlines_fire_in_order_once_their_delay_passed_unless_disarmed() -> None:
    loop = asyncio.get_running_loop()
    q = delays.FixedDelay(loop, 0.1, 0.01)
    fired: list[tuple[str, float]] = []
    t0 = loop.time()

    def note(name: str) -> None:
        fired.append((name, loop.time() - t0))

    q.arm("a", lambda: note("a"))
    q.arm("b", lambda: note("b"))
    q.arm("gone", lambda: note("gone"))
    await asyncio.sleep(0.05)
    q.arm("a", lambda: note("a again"))  # armed again: its delay restarts, behind the others
    q.arm("c", lambda: note("c"))
    q.disarm("gone")
    q.disarm("never armed")
    await asyncio.sleep(0.3)
    assert [name for name, _ in fired] == ["b", "a again", "c"]
    at = dict(fired)
    assert at["b"] >= 0.1 - delays.EARLY_S
    assert at["a again"] >= 0.15 - delays.EARLY_S
    assert not q.due and q._timer is None  # nothing left: no loop timer either


async def test_a_callback_may_arm_and_disarm_and_one_that_raises_stops_no_other() -> None:
    loop = asyncio.get_running_loop()
    q = delays.FixedDelay(loop, 0.05, 0.01)
    fired: list[str] = []

    def first() -> None:
        fired.append("first")
        q.disarm("second")
        q.arm("later", lambda: fired.append("later"))
        raise RuntimeError("a broken callback")

    q.arm("first", first)
    q.arm("second", lambda: fired.append("second"))
    q.arm("third", lambda: fired.append("third"))
    await asyncio.sleep(0.2)
    assert fired == ["first", "third", "later"]


async def test_a_stream_of_short_lived_deadlines_holds_one_loop_timer() -> None:
    loop = asyncio.get_running_loop()
    before = pending_timers(loop)
    q = delays.FixedDelay(loop, 5.0, 0.25)
    for i in range(2000):  # a request's deadline, armed and disarmed as it ends
        q.arm(i, lambda: None)
        if i >= 10:
            q.disarm(i - 10)
    assert pending_timers(loop) - before == 1
    assert len(q.due) == 10
    q.close()
    assert pending_timers(loop) == before and not q.due


async def test_shared_is_one_queue_per_loop_and_delay() -> None:
    loop = asyncio.get_running_loop()
    assert delays.shared(loop, 1.0, 0.1) is delays.shared(loop, 1.0, 0.1)
    assert delays.shared(loop, 1.0, 0.1) is not delays.shared(loop, 2.0, 0.1)


async def test_an_idle_kept_alive_connection_is_closed_and_a_busy_one_kept() -> None:
    """uvicorn's keep-alive timeout, on the connections' shared queue instead of a timer each:
    a connection idle past it is closed; one whose requests come sooner, or whose request takes
    longer than it, stays open."""

    async def app(scope: dict[str, object], receive: object, send: object) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/slow":  # longer than the keep-alive timeout, which it must not cut
            await asyncio.sleep(0.8)
        await send({"type": "http.response.start", "status": 200,  # type: ignore[operator]
                    "headers": [(b"content-length", b"2")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"ok"})  # type: ignore[operator]

    server = uvicorn.Server(uvicorn.Config(
        app, host="127.0.0.1", port=0, http=GuardedHttpToolsProtocol, lifespan="off",
        log_config=None, access_log=False, timeout_keep_alive=0.5,
    ))  # fmt: skip
    task = asyncio.create_task(server.serve())
    while not server.started:  # noqa: ASYNC110 - uvicorn offers no event
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    request = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
    try:
        busy = await asyncio.open_connection("127.0.0.1", port)
        idle = await asyncio.open_connection("127.0.0.1", port)
        for conn in (busy, idle):
            conn[1].write(request)
            assert (await conn[0].readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        for _ in range(6):  # 1.2 s of requests 0.2 s apart: never idle for 0.5 s
            await asyncio.sleep(0.2)
            busy[1].write(request)
            assert (await busy[0].readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        assert await asyncio.wait_for(idle[0].read(), 2.0) == b""  # closed by the server
        busy[1].write(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
        assert (await busy[0].readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        busy[1].write(request + request)  # pipelined: both answered, the second after the first
        assert (await busy[0].readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        assert (await busy[0].readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        for _, writer in (busy, idle):
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
    finally:
        server.should_exit = True
        await task


async def test_callbacks_run_in_no_arming_requests_context() -> None:
    """The one timer is made by whichever request armed first: were it made in that request's
    context, every later timer (made as the earlier fires) would keep that request alive."""
    var: contextvars.ContextVar[str] = contextvars.ContextVar("request", default="none")
    loop = asyncio.get_running_loop()
    q = delays.FixedDelay(loop, 0.02, 0.01)
    seen: list[str] = []

    def first() -> None:
        seen.append(var.get())
        q.arm("again", lambda: seen.append(var.get()))  # its timer made as the first fires

    async def request() -> None:
        var.set("first request")
        q.arm("first", first)

    await asyncio.create_task(request())
    await asyncio.sleep(0.15)
    assert seen == ["none", "none"]
