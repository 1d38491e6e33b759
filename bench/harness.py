"""Starting things on loopback for the tests and the benches: a free port, an ASGI app served in
the running event loop, P/D fleets in process, child processes stopped.

Also the two chores every fake replica has (the lifespan protocol, reading a request body).
`simulator.fleet` has the in-process fleet and `simulated_fleet`, the fleet in a subprocess;
`gateway.demo.stream_chat` is the streaming client the demo and the admission bench time first
tokens with. Nothing here imports the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import uvicorn

from simulator.replica import Server, serve

if TYPE_CHECKING:
    from simulator.pd import Protocol as PdProtocol

    Lifespan = Literal["auto", "on", "off"]

Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]


def free_port() -> int:
    """A loopback port nobody listens on right now (for a process that binds it later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- servers -------------------------------------------------------------------------------------
def server_config(
    app: Any,
    port: int = 0,
    lifespan: Lifespan = "auto",
    *,
    host: str = "127.0.0.1",
    http: str | type[asyncio.Protocol] = "httptools",
    graceful_s: float | None = 2,
    loop: str = "none",
) -> uvicorn.Config:
    """uvicorn's settings for a harness server: no logging config, no access log, a graceful
    shutdown of `graceful_s`; `loop="none"` runs it in the caller's event loop."""
    return uvicorn.Config(
        app, host=host, port=port, lifespan=lifespan, log_config=None, access_log=False,
        loop=loop, http=http, timeout_graceful_shutdown=graceful_s,  # type: ignore[arg-type]
    )  # fmt: skip


class Served:
    """A server `start_server` started: its uvicorn server, the task serving, its port and URL."""

    def __init__(self, server: Server, task: asyncio.Task[None], port: int) -> None:
        self.server = server
        self.task = task
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        self.server.exit()
        await self.task


async def start_server(
    app: Any,
    port: int = 0,
    lifespan: Lifespan = "auto",
    *,
    http: str | type[asyncio.Protocol] = "httptools",
    graceful_s: float | None = 2,
    startup_s: float = 15.0,
) -> Served:
    """Serve `app` on 127.0.0.1:`port` (0: ephemeral) in the running loop, once it listens.

    Signals stay with whoever owns the process; `http` is uvicorn's implementation (a name, or a
    protocol class such as the gateway's own)."""
    config = server_config(app, port, lifespan, http=http, graceful_s=graceful_s)
    server, task = await serve(config, startup_s)
    return Served(server, task, int(server.servers[0].sockets[0].getsockname()[1]))


async def stop_all(served: Iterable[Served]) -> None:
    """Stop the servers together: uvicorn's shutdown waits 0.1 s whatever it has to do."""
    await asyncio.gather(*(s.stop() for s in served))


@contextlib.asynccontextmanager
async def serving(
    app: Any, port: int = 0, lifespan: Lifespan = "auto", **options: Any
) -> AsyncIterator[Served]:
    """`start_server` as a context: stopped on the way out."""
    served = await start_server(app, port, lifespan, **options)
    try:
        yield served
    finally:
        await served.stop()


# --- fleets and processes ------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def pd_fleets(n_prefill: int = 1, n_decode: int = 1,
                    protocol: PdProtocol = "vllm-nixl", *, speedup: float = 200.0,
                    **kw: Any) -> AsyncIterator[tuple[Any, Any]]:
    """In-process P/D replicas (simulator/pd.py): (prefill Fleet, decode Fleet). `kw`: Fleet
    options, plus PdOptions fields (kv_link_gbps, lease_s, load_failure_policy, ...)."""
    from dataclasses import fields

    from simulator.fleet import Fleet
    from simulator.pd import PdOptions

    names = {f.name for f in fields(PdOptions)}
    pd_kw = {k: kw.pop(k) for k in list(kw) if k in names}
    async with Fleet(n_prefill, speedup=speedup, pd=PdOptions("prefill", protocol, **pd_kw),
                     **kw) as p, \
            Fleet(n_decode, speedup=speedup, pd=PdOptions("decode", protocol, **pd_kw),
                  **kw) as d:
        yield p, d


def stop_processes(procs: Iterable[subprocess.Popen[bytes]], timeout_s: float = 10.0) -> None:
    """SIGTERM them all, then wait for each; one still running after `timeout_s` is killed."""
    procs = list(procs)
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# --- fake replicas -------------------------------------------------------------------------------
async def lifespan_done(scope: Mapping[str, Any], receive: Receive, send: Send) -> bool:
    """For a fake replica's ASGI callable: answer a lifespan scope (start and stop at once) and
    return True, so the caller returns; False for any other scope."""
    if scope["type"] != "lifespan":
        return False
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return True


async def read_body(receive: Receive) -> bytes:
    """The whole request body, however many messages it comes in."""
    body: bytes = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            return body
