"""`http_protocol.body_buffered`: the endpoint arms no body deadline when the whole body is already
in (the usual request: headers and body in one read), and keeps it for a body still on its way."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.http.endpoint import read_body
from gateway.transport.protocol import GuardedHttpToolsProtocol, body_buffered
from tests.support import start_server


class Probe:
    """An app that notes whether the body was buffered when it started, then reads it."""

    def __init__(self) -> None:
        self.seen: list[tuple[bool, bytes]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        buffered = body_buffered(receive)
        body = await read_body(scope, receive, 1 << 20, timeout_s=5.0)
        self.seen.append((buffered, body))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"ok"})


async def exchange(port: int, parts: list[bytes], gap_s: float) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for i, part in enumerate(parts):
        if i:
            await asyncio.sleep(gap_s)
        writer.write(part)
        await writer.drain()
    answer = await reader.readuntil(b"ok")
    writer.close()
    return answer


async def test_a_body_in_with_its_headers_is_buffered_and_one_still_coming_is_not() -> None:
    probe = Probe()
    served = await start_server(probe, http=GuardedHttpToolsProtocol)
    port = int(served.url.rsplit(":", 1)[1])
    body = b'{"model": "m"}'
    head = b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body)
    try:
        assert b"200" in await exchange(port, [head + body], 0)
        assert b"200" in await exchange(port, [head, body[:5], body[5:]], 0.2)
    finally:
        await served.stop()
    assert probe.seen == [(True, body), (False, body)]
    assert body_buffered(object()) is False  # another server's receive: the deadline is armed
