"""The stream relay's fast lane (gateway.http_protocol.BodyWriter + UpstreamResponse.pipe) against
its plain-ASGI path, and the stream taps' one-loop path against their general one.

Under the gateway's own server protocol a streamed chunk goes from the upstream's callback straight
to the client's socket; under plain uvicorn every chunk is an ASGI message. Both must give the
client the same bytes for every framing a replica sends, and a client that stops reading must stop
the gateway reading the replica (backpressure), in the fast lane too.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from bench.harness import stop_all
from gateway import create_app, parse_config
from gateway.api.streams import StreamTap
from gateway.api.token_tap import IdsTap, Ledger
from gateway.transport.protocol import BodyWriter, GuardedHttpToolsProtocol
from tests.gateway.fake_replica import Upstream
from tests.support import poll_until, start_server

CHAT = [{"role": "user", "content": "hello"}]


@contextlib.asynccontextmanager
async def two_gateways(app_upstream: Any) -> AsyncIterator[tuple[str, str]]:
    """One upstream behind two gateways: (plain uvicorn's URL, the guarded protocol's URL)."""
    up = await start_server(app_upstream)
    cfg = {
        "pools": {
            "chat": {
                "replicas": [up.url],
                "policy": "round_robin",
                "timeouts": {"connect_s": 1, "first_byte_s": 5, "idle_s": 2, "total_s": 30},
            }
        }
    }
    plain = await start_server(create_app(parse_config(cfg)), lifespan="on")
    fast = await start_server(
        create_app(parse_config(cfg)), lifespan="on", http=GuardedHttpToolsProtocol
    )
    try:
        yield plain.url, fast.url
    finally:
        await stop_all([fast, plain, up])


MODES = ["ok", "crlf", "bare_cr", "split", "garbage_utf8", "garbage_json", "die_mid_event",
         "die_midstream"]  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("usage", [False, True])
async def test_fast_lane_gives_the_bytes_the_asgi_path_gives(mode: str, usage: bool) -> None:
    up = Upstream("a", mode=mode, chunks=24)
    body: dict[str, Any] = {"model": "test-model", "messages": CHAT, "stream": True}
    if usage:
        body["stream_options"] = {"include_usage": True}
    async with two_gateways(up) as (plain, fast), httpx.AsyncClient(timeout=10) as h:
        a = await h.post(plain + "/v1/chat/completions", json=body)
        b = await h.post(fast + "/v1/chat/completions", json=body)
    assert a.status_code == b.status_code == 200
    assert b.content == a.content
    if mode in ("ok", "split"):
        assert b.content.endswith(b"data: [DONE]\n\n")
    if mode == "split":  # the usage the gateway asked for is stripped unless the client asked
        assert (b'"usage"' in b.content) is usage
    if mode in ("garbage_json", "die_midstream"):
        assert b'"error"' in b.content and b"[DONE]" not in b.content


class Firehose:
    """An upstream that streams valid events as fast as its client takes them, counting bytes."""

    def __init__(self) -> None:
        self.sent = 0
        self.event = (
            b'data: {"choices":[{"index":0,"delta":{"content":"' + b"x" * 4000 + b'"}}]}\n\n'
        )

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (msg := await receive())["type"] != "lifespan.shutdown":
                await send({"type": msg["type"] + ".complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] != "/v1/chat/completions":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        while (await receive()).get("more_body"):
            pass
        hdrs = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": hdrs})
        with contextlib.suppress(Exception):
            for _ in range(100_000):  # 400 MB if nothing held it back
                await send({"type": "http.response.body", "body": self.event, "more_body": True})
                self.sent += len(self.event)
                await asyncio.sleep(0)


async def test_a_client_that_stops_reading_stops_the_relay_in_the_fast_lane() -> None:
    hose = Firehose()
    async with two_gateways(hose) as (_, fast):
        port = int(fast.rsplit(":", 1)[1])
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
        s.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(s, ("127.0.0.1", port))
        req = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
        await loop.sock_sendall(
            s,
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(req), req),
        )
        got = await loop.sock_recv(s, 4096)
        assert got.startswith(b"HTTP/1.1 200")
        await poll_until(lambda: hose.sent > 0)
        await asyncio.sleep(1.0)  # the client reads nothing more: the buffers fill, then it stops
        held = hose.sent
        await asyncio.sleep(1.0)
        # the socket buffers and the gateway's high-water marks, not the 400 MB stream
        assert hose.sent - held < 1024 * 1024, "the gateway kept reading for a stalled client"
        assert hose.sent < 32 * 1024 * 1024
        s.close()


class _General(StreamTap):  # declines the one-loop path: every read takes the general one
    __slots__ = ()

    def _took(self, chunk: bytes, datas: list[bytes]) -> bool:
        return False


class _GeneralIds(IdsTap):
    __slots__ = ()

    def _took(self, chunk: bytes, datas: list[bytes]) -> bool:
        return False


EVENTS = [
    b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n',
    b'data: {"choices":[],"usage":{"completion_tokens":3}}\n\n',
    b"data: [DONE]\n\n",
    b"data: [1]\n\n",
    b"data: not json\n\n",
    b'data: {"usage":null,"choices":[{}]}\n\n',
    b'data: {"a":1},{"b":2}\n\n',
    b"data: \n\n",
    b"\n",
    b'data: {"x": "\xff"}\n\n',
    b": comment\n\n",
    b'data: {"usage":{"x":1},"choices":[{}]}\n\n',
    b'data: {"error":{"message":"boom"}}\n\n',
    b'data: {"id":"c1","created":1,"model":"m","prompt_token_ids":[1,2],"choices":[{"index":0,'
    b'"delta":{"role":"assistant","content":""},"token_ids":[]}]}\n\n',
    b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"b"},"token_ids":[7]}]}\n\n',
    b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"c"},"token_ids":[8,9],'
    b'"finish_reason":"stop"}]}\n\n',
]
_LEDGER = ("prompt_ids", "ids", "text", "chunks", "ids_lost", "finish", "template", "role_sent",
           "unresumable", "usage")  # fmt: skip


@pytest.mark.parametrize("ids", [False, True], ids=["StreamTap", "IdsTap"])
def test_one_loop_tap_path_agrees_with_the_general_one(ids: bool) -> None:
    rng = random.Random(7)
    fast_reads = 0
    for _ in range(4000):
        pool = EVENTS[:3] if rng.random() < 0.5 else EVENTS
        if ids and rng.random() < 0.5:
            pool = [*EVENTS[:3], *EVENTS[-3:]]
        stream = b"".join(rng.choice(pool) for _ in range(rng.randint(1, 6)))
        cuts = sorted(rng.sample(range(1, len(stream)), min(rng.randint(0, 2), len(stream) - 1)))
        reads = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
        for strip in (True, False):
            fast: StreamTap
            general: StreamTap
            if ids:
                fast = IdsTap(strip, Ledger(True, False, True), strip_ids=strip)
                general = _GeneralIds(strip, Ledger(True, False, True), strip_ids=strip)
            else:
                fast, general = StreamTap(strip), _General(strip)
            out_f = b"".join(fast.feed(r) for r in reads)
            out_g = b"".join(general.feed(r) for r in reads)
            assert out_f == out_g, reads
            assert (fast.usage, fast.events, fast.done, fast.broken) == (
                general.usage, general.events, general.done, general.broken,
            ), reads  # fmt: skip
            if isinstance(fast, IdsTap) and isinstance(general, IdsTap):
                a, b = fast.ledger.settle(), general.ledger.settle()
                assert [getattr(a, k) for k in _LEDGER] == [getattr(b, k) for k in _LEDGER], reads
            fast_reads += sum(1 for r in reads if fast._lf_events(r) is not None)
    assert fast_reads > 300  # the one-loop path did run


# --- whole answers: head and body in one write (BodyWriter.whole) ------------------------------
def _comparable(res: httpx.Response) -> tuple[int, list[tuple[str, str]], bytes]:
    """Status, headers and body, but for the clock: the `date` header and the engine's `created`
    second (two answers may straddle a second)."""
    headers = sorted((k, v) for k, v in res.headers.items() if k != "date")
    return res.status_code, headers, _CREATED.sub(b'"created":0', res.content)


_CREATED = re.compile(rb'"created":\s*[0-9]+')


@pytest.mark.parametrize("mode", ["ok", "error_500", "sglang_error", "big"])
async def test_a_whole_answer_in_one_write_is_what_the_asgi_path_sends(mode: str) -> None:
    up = Upstream("a", mode=mode, chunks=24)
    body = {"model": "test-model", "messages": CHAT}
    async with two_gateways(up) as (plain, fast), httpx.AsyncClient(timeout=10) as h:
        for _ in range(3):  # kept alive between answers on both
            rid = {"x-request-id": "req-1"}
            a = await h.post(plain + "/v1/chat/completions", json=body, headers=rid)
            b = await h.post(fast + "/v1/chat/completions", json=body, headers=rid)
            assert _comparable(b) == _comparable(a)
    assert a.status_code == {"ok": 200, "error_500": 500, "sglang_error": 400, "big": 200}[mode]


async def test_a_whole_answer_goes_out_in_one_write_and_keeps_the_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a raw socket: each answer is complete (content-length framed), written by
    `BodyWriter.whole`, and the connection serves the next request; one that asked to close
    gets `connection: close` and EOF."""
    wrote: list[bool] = []
    whole = BodyWriter.whole

    def counted(self: BodyWriter, *args: Any) -> bool:
        wrote.append(whole(self, *args))
        return wrote[-1]

    monkeypatch.setattr(BodyWriter, "whole", counted)
    async with two_gateways(Upstream("a", chunks=4)) as (_, fast):
        host, port = fast.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        req = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
        try:
            for close in (False, False, True):
                extra = b"connection: close\r\n" if close else b""
                writer.write(
                    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                    b"application/json\r\n%bcontent-length: %d\r\n\r\n%b" % (extra, len(req), req)
                )
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                assert head.startswith(b"HTTP/1.1 200 OK\r\n")
                lines = head.lower().split(b"\r\n")
                length = next(int(v.split(b":")[1]) for v in lines if v.startswith(b"content-length:"))
                answer = await asyncio.wait_for(reader.readexactly(length), 5)
                assert b"w3" in answer
                assert (b"connection: close" in lines) is close
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed after the last
            assert wrote == [True, True, True]
        finally:
            writer.close()


@pytest.mark.parametrize("mode", ["ok", "split", "die_midstream"])
async def test_a_streams_head_and_end_go_out_without_asgi_messages(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`BodyWriter.begin` writes a stream's head with its first event, `BodyWriter.end` its last
    chunk (the error event of a broken stream) with the terminator; the client gets the headers
    and bytes the ASGI path gives, and the kept-alive connection serves the next request."""
    calls: dict[str, list[bool]] = {"begin": [], "end": []}

    def counting(name: str) -> Any:
        real = getattr(BodyWriter, name)

        def counted(self: BodyWriter, *args: Any) -> bool:
            calls[name].append(real(self, *args))
            return calls[name][-1]

        return counted

    for name in calls:
        monkeypatch.setattr(BodyWriter, name, counting(name))
    body = {"model": "test-model", "messages": CHAT, "stream": True}
    async with two_gateways(Upstream("a", mode=mode, chunks=6)) as (plain, fast):
        async with httpx.AsyncClient(timeout=10) as h:
            for _ in range(2):
                rid = {"x-request-id": "req-1"}
                a = await h.post(plain + "/v1/chat/completions", json=body, headers=rid)
                b = await h.post(fast + "/v1/chat/completions", json=body, headers=rid)
                assert _comparable(b) == _comparable(a)
                assert b.headers["transfer-encoding"] == "chunked"
    # only the guarded protocol has a writer
    assert calls == {"begin": [True, True], "end": [True, True]}
