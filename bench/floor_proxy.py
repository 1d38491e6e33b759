"""The floor of a Python proxy on uvloop: what bench.overhead's `floor@*` rows measure.

A pass-through that does nothing a gateway must do (no parsing of the body, no routing, no
limits, metrics or index): each POST goes on, round robin, to the next upstream over the
gateway's own upstream client (`gateway/transport/client.py`), and the answer comes back, streamed
bodies chunk by chunk. Two server layers in front of it, one per row:

- `uvicorn`: a bare ASGI app under uvicorn with httptools and uvloop, configured as `gateway
  serve` runs it (the gateway's protocol, no proxy headers, no access log) and answering as
  the gateway does (a whole answer in one write, `BodyWriter.whole`; stream chunks straight to
  the socket when the client takes them, `BodyWriter.write`);
- `raw`: an asyncio protocol that parses requests with httptools itself (keeping each header,
  lowercased, as uvicorn does and any server must) and writes each answer's bytes straight to
  the socket (streamed bodies from the upstream connection's
  callback, as the gateway's fast lane does), no ASGI at all.

So `floor@uvicorn` minus `floor@raw` is what the ASGI server layer costs a request, and
`floor@raw` is the least CPU per request any proxy written in Python on this event loop and
client can spend: the bound below which no Python gateway goes, to hold against a compiled
router's figure. GET answers 200 (what bench.overhead's readiness poll needs).

`--route POLICY` (the `floor@routed` row) puts the gateway's own routing unit in front of the
uvicorn layer's forward and nothing else: each body is parsed and its prompt rendered by the
gateway's chat kind, then `Router` hashes it, matches it in the memory index, has POLICY choose
among the upstreams and counts the dispatch (in-flight load and the chain in the index), and the
outcome is fed back when the answer is out, as the pipeline does; no limits, admission, metrics,
traces, failover or records. So `floor@routed` minus `floor@uvicorn` is what the routing unit
costs in place, and `floor@routed` the least a Python gateway that routes by prefix can spend.

    python -m bench.floor_proxy --server raw --port 8100 --upstream http://127.0.0.1:9001 ...
    python -m bench.floor_proxy --server uvicorn --route prefix_aware --port 8100 --upstream ...
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httptools

from bench.overhead import gateway_config, policy_variant
from gateway.api.kinds import PATHS
from gateway.config import parse_config
from gateway.http.app import settle_garbage_collector
from gateway.routing.router import RouteInput
from gateway.runtime.gateway import Gateway
from gateway.runtime.snapshot import pick_pool
from gateway.transport.client import HttpClient
from gateway.transport.protocol import GuardedHttpToolsProtocol, body_writer

MAX_ANSWER_BYTES = 64 << 20
JSON = [(b"content-type", b"application/json")]


class Upstreams:
    """Round robin over the upstream origins, on one keep-alive client."""

    def __init__(self, origins: list[str]) -> None:
        self.client = HttpClient(connect_timeout_s=5.0)
        self._next: Iterator[str] = itertools.cycle(origins)

    async def forward(self, path: bytes, body: bytes) -> tuple[Any, Callable[[], Awaitable[None]]]:
        """The upstream's response, and what to call once the answer is out."""
        resp = await self.client.request(
            next(self._next), b"POST", path, JSON, body, first_byte_timeout_s=30.0
        )
        return resp, _nothing

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


async def _nothing() -> None:
    return None


class RoutedUpstreams(Upstreams):
    """The gateway's routing unit picks the upstream (module docstring): a `Gateway` built from
    bench.overhead's config for `policy` over `origins`, started for its replica state and index."""

    def __init__(self, origins: list[str], policy: str) -> None:
        super().__init__(origins)
        ports = [int(o.rsplit(":", 1)[1]) for o in origins]
        cfg = gateway_config(0, ports, [], policy_variant(policy))
        del cfg["pools"]["paced"]  # one floor process per pool: its upstreams are the only pool
        cfg["routes"] = [r for r in cfg["routes"] if r["pool"] != "paced"]
        self.gateway = Gateway(parse_config(cfg))

    async def start(self) -> None:
        await self.gateway.start()
        settle_garbage_collector()  # as `gateway serve` does once started

    async def stop(self) -> None:
        await self.gateway.stop()

    async def forward(self, path: bytes, body: bytes) -> tuple[Any, Callable[[], Awaitable[None]]]:
        kind = PATHS[path.decode()]
        snap = self.gateway.current
        router = snap.router
        req = kind.parse(body, None)
        prompt = router.prompt(req, kind.prompt)
        pool = pick_pool(snap, req, prompt.tokens)
        routing = await router.route(req, pool, prompt, RouteInput("floor"))
        decision = router.choose(pool, routing)
        assert decision.replica is not None, decision.explain()
        sent = await router.dispatch(pool, routing, decision.replica)
        try:
            resp = await self.client.request(
                sent.replica.url, b"POST", path, JSON, body, first_byte_timeout_s=30.0
            )
        except BaseException:
            await sent.failed("floor")
            sent.done()
            raise
        sent.prefilled()

        async def done() -> None:
            await sent.finished(True, True, None)
            sent.done()

        return resp, done


def _head(status: int, ctype: bytes, length: int | None) -> bytes:
    framing = b"transfer-encoding: chunked" if length is None else b"content-length: %d" % length
    return b"HTTP/1.1 %d OK\r\ncontent-type: %b\r\n%b\r\n\r\n" % (status, ctype, framing)


def _content_type(resp: Any) -> bytes:
    return next((v for k, v in resp.headers if k == b"content-type"), b"application/json")


# --- raw: an asyncio protocol, no ASGI ----------------------------------------------------------
class RawServer(asyncio.Protocol):
    """One client connection: requests one at a time (no pipelining), keep-alive."""

    def __init__(self, ups: Upstreams) -> None:
        self.ups = ups
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []  # kept, as any server must (its key, length)
        self.parts: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        self.parts.append(body)

    def on_message_complete(self) -> None:
        url, body = self.url, b"".join(self.parts)
        self.url, self.parts, self.headers = b"", [], []
        assert self.transport is not None
        if self.parser.get_method() != b"POST":
            self.transport.write(_head(200, b"text/plain", 2) + b"ok")
            return
        asyncio.get_running_loop().create_task(self.answer(self.transport, url, body))

    async def answer(self, t: asyncio.Transport, path: bytes, body: bytes) -> None:
        try:
            await self._answer(t, path, body)
        except Exception:  # no error answers in the floor: the client sees the connection close
            t.close()

    async def _answer(self, t: asyncio.Transport, path: bytes, body: bytes) -> None:
        resp, done = await self.ups.forward(path, body)
        ctype = _content_type(resp)
        if not ctype.startswith(b"text/event-stream"):
            data = await resp.read_all(MAX_ANSWER_BYTES)
            t.write(_head(resp.status, ctype, len(data)) + data)
            await done()
            return
        t.write(_head(resp.status, ctype, None))

        def sink(chunk: bytes) -> bool:
            t.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
            return True

        await resp.pipe(sink)
        t.write(b"0\r\n\r\n")
        await done()


# --- uvicorn: a bare ASGI app ---------------------------------------------------------------------
def asgi_app(ups: Upstreams) -> Callable[..., Any]:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":  # the routed floor starts and stops its gateway
            await receive()  # lifespan.startup
            await ups.start()
            await send({"type": "lifespan.startup.complete"})
            await receive()  # lifespan.shutdown
            await ups.stop()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        if scope["method"] != "POST":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        parts, more = [], True
        while more:
            msg = await receive()
            parts.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        resp, done = await ups.forward(scope["raw_path"], b"".join(parts))
        try:
            await _relay(resp, send)
        finally:
            await done()

    return app


async def _relay(resp: Any, send: Any) -> None:
    ctype = _content_type(resp)
    writer = body_writer()  # the gateway's own lanes: one write per answer, chunks direct
    if not ctype.startswith(b"text/event-stream"):
        data = await resp.read_all(MAX_ANSWER_BYTES)
        if writer is not None and writer.whole(resp.status, [(b"content-type", ctype)], data):
            return
        headers = [(b"content-type", ctype), (b"content-length", b"%d" % len(data))]
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        await send({"type": "http.response.body", "body": data})
        return
    await send({"type": "http.response.start", "status": resp.status,
                "headers": [(b"content-type", ctype)]})  # fmt: skip
    while chunk := await resp.read_chunk():
        if writer is None or not writer.write(chunk):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench.floor_proxy", description=__doc__.splitlines()[0])
    p.add_argument("--server", choices=["raw", "uvicorn"], required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", nargs="+", required=True, help="http://host:port origins")
    p.add_argument("--route", metavar="POLICY", help="uvicorn only: the gateway's routing unit "
                   "with this policy picks the upstream (the floor@routed row)")  # fmt: skip
    args = p.parse_args(argv)
    import uvloop

    if args.server == "uvicorn":
        import uvicorn

        routed = args.route is not None
        ups = RoutedUpstreams(args.upstream, args.route) if routed else Upstreams(args.upstream)
        config = uvicorn.Config(
            asgi_app(ups), host="127.0.0.1", port=args.port, loop="uvloop",
            http=GuardedHttpToolsProtocol, lifespan="on" if routed else "off",
            log_config=None, access_log=False, proxy_headers=False,
        )  # fmt: skip
        uvicorn.Server(config).run()
        return

    async def serve() -> None:
        ups = Upstreams(args.upstream)
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: RawServer(ups), "127.0.0.1", args.port)
        async with server:
            await server.serve_forever()

    uvloop.run(serve())


if __name__ == "__main__":
    main()
