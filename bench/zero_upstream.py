"""A zero-latency OpenAI-shaped upstream for overhead benchmarks: raw asyncio + httptools, pre-built bytes.

Answers chat/completions (JSON, or an SSE stream of N chunks written one write each, optionally paced),
GET /health, /metrics (vLLM gauges), /v1/models and POST /v1/traces (an OTLP/HTTP sink); one process,
one event loop, several listening ports (each port looks like one replica to the gateway). Ports come in
two groups: unpaced (every chunk written at once) and paced (`--chunk-delay-ms` before each chunk).

    python -m bench.zero_upstream --ports 3 --paced-ports 3 --chunks 64 --chunk-delay-ms 2

Prints `{"ports": [...], "paced_ports": [...]}` on stdout once listening. Keep-alive HTTP/1.1, no
pipelining.

Replica faults, for soaks: a streamed request whose body carries `"user":"fault:NAME"` (compact
JSON, as orjson writes it) gets a broken stream instead (unpaced ports): `crlf` (a whole, valid
stream framed with CRLF line ends), `badutf8` (two events, then one that is not UTF-8), `nonjson`
(two events, then `data: not json`), `die` (two events, then half an event and the connection
closed).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time

import httptools
import orjson

MODEL = "bench-model"


def _chunked(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _sse(obj: dict[str, object] | str) -> bytes:
    data = obj.encode() if isinstance(obj, str) else orjson.dumps(obj)
    return _chunked(b"data: " + data + b"\n\n")


class Responses:
    """Every byte the upstream ever writes, built once."""

    def __init__(self, chunks: int) -> None:
        created = int(time.time())
        rid = "chatcmpl-bench0000000000000000000000"
        text = " ".join(["token"] * chunks)
        body = orjson.dumps(
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": MODEL,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": None,
                        "finish_reason": "stop",
                    }
                ],
                "usage": {
                    "prompt_tokens": 512,
                    "completion_tokens": chunks,
                    "total_tokens": 512 + chunks,
                },
            }
        )
        self.json = _head(200, b"application/json", len(body)) + body

        def delta(i: int) -> dict[str, object]:
            d: dict[str, object] = {"content": " token"}
            if i == 0:
                d = {"role": "assistant", "content": "token"}
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": MODEL,
                "choices": [
                    {
                        "index": 0,
                        "delta": d,
                        "logprobs": None,
                        "finish_reason": "stop" if i == chunks - 1 else None,
                    }
                ],
            }

        self.sse_head = (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        self.sse_chunks = [_sse(delta(i)) for i in range(chunks)]
        usage = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": MODEL,
            "choices": [],
            "usage": {
                "prompt_tokens": 512,
                "completion_tokens": chunks,
                "total_tokens": 512 + chunks,
            },
        }
        self.sse_usage = _sse(usage)
        self.sse_done = _sse("[DONE]") + b"0\r\n\r\n"

        # replica faults (see the module doc): each a whole response, built once
        def crlf(obj: dict[str, object] | str) -> bytes:
            data = obj.encode() if isinstance(obj, str) else orjson.dumps(obj)
            return _chunked(b"data: " + data + b"\r\n\r\n")

        good = b"".join(self.sse_chunks[:2])
        self.faults = {
            b"crlf": self.sse_head
            + b"".join(crlf(delta(i)) for i in range(chunks))
            + crlf("[DONE]")
            + b"0\r\n\r\n",
            b"badutf8": self.sse_head
            + good
            + _chunked(b'data: {"choices":[{"delta":{"content":"\xff\xfe"}}]}\n\n')
            + self.sse_done,
            b"nonjson": self.sse_head + good + _chunked(b"data: not json\n\n") + self.sse_done,
            # the connection is closed after this: mid-event, mid-chunk
            b"die": self.sse_head + good + b"40\r\n" + b'data: {"id":"chatcmpl-',
        }
        models = orjson.dumps(
            {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]}
        )
        self.models = _head(200, b"application/json", len(models)) + models
        self.health = _head(200, b"application/json", 0)
        self.otlp_ok = _head(200, b"application/x-protobuf", 0)
        self.not_found = _head(404, b"application/json", 2) + b"{}"


def _head(status: int, ctype: bytes, length: int) -> bytes:
    reason = b"OK" if status == 200 else b"Not Found"
    return b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (
        status,
        reason,
        ctype,
        length,
    )


class Upstream:
    """Shared state: the responses, the pacing, the live counts /metrics reports."""

    def __init__(self, chunks: int) -> None:
        self.r = Responses(chunks)
        self.running = 0
        self.requests = 0
        self.otlp_bytes = 0

    def metrics(self) -> bytes:
        text = (
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="{MODEL}",engine="0"}} {self.running}.0\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="{MODEL}",engine="0"}} 0.0\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{model_name="{MODEL}",engine="0"}} 0.1\n'
        ).encode()
        return _head(200, b"text/plain; version=0.0.4", len(text)) + text


class Conn(asyncio.Protocol):
    __slots__ = ("up", "delay", "t", "parser", "url", "body", "closed")

    def __init__(self, up: Upstream, chunk_delay_s: float) -> None:
        self.up = up
        self.delay = chunk_delay_s
        self.url = b""
        self.body: list[bytes] = []
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t: asyncio.Transport = transport  # type: ignore[assignment]
        self.parser = httptools.HttpRequestParser(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.t.close()

    # httptools callbacks
    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        url, self.url = self.url, b""
        body = b"".join(self.body)
        self.body.clear()
        method = self.parser.get_method()
        up, r, t = self.up, self.up.r, self.t
        if method == b"POST" and url.endswith(b"/completions"):
            up.requests += 1
            if b'"stream":true' in body or b'"stream": true' in body:
                f = body.find(b'"user":"fault:')
                if f >= 0:
                    name = body[f + 14 : body.find(b'"', f + 14)]
                    fault = r.faults.get(name)
                    if fault is not None:
                        t.write(fault)
                        if name == b"die":
                            t.close()
                            return
                        if not self.parser.should_keep_alive():
                            t.close()
                        return
                usage = b'"include_usage":true' in body or b'"include_usage": true' in body
                self._stream(usage)
            else:
                t.write(r.json)
        elif method == b"GET" and url == b"/health":
            t.write(r.health)
        elif method == b"GET" and url == b"/metrics":
            t.write(up.metrics())
        elif method == b"GET" and url == b"/v1/models":
            t.write(r.models)
        elif method == b"POST" and url == b"/v1/traces":
            up.otlp_bytes += len(body)
            t.write(r.otlp_ok)
        else:
            t.write(r.not_found)
        if not self.parser.should_keep_alive():
            t.close()

    def _stream(self, usage: bool) -> None:
        up, r, t = self.up, self.up.r, self.t
        if self.delay <= 0:
            t.write(r.sse_head)
            for c in r.sse_chunks:
                t.write(c)  # one write per chunk, as an engine emits tokens
            if usage:
                t.write(r.sse_usage)
            t.write(r.sse_done)
            return
        up.running += 1
        t.write(r.sse_head)
        loop = asyncio.get_running_loop()
        chunks = r.sse_chunks
        delay = self.delay

        def step(i: int) -> None:
            if self.closed:
                up.running -= 1
                return
            if i < len(chunks):
                t.write(chunks[i])
                loop.call_later(delay, step, i + 1)
                return
            if usage:
                t.write(r.sse_usage)
            t.write(r.sse_done)
            up.running -= 1

        loop.call_later(delay, step, 0)


async def serve(n_ports: int, n_paced: int, chunks: int, chunk_delay_s: float, host: str) -> None:
    up = Upstream(chunks)
    loop = asyncio.get_running_loop()
    servers = [
        await loop.create_server(lambda d=d: Conn(up, d), host, 0, backlog=1024)
        for d in [0.0] * n_ports + [chunk_delay_s] * n_paced
    ]
    ports = [s.sockets[0].getsockname()[1] for s in servers]
    print(
        orjson.dumps({"ports": ports[:n_ports], "paced_ports": ports[n_ports:]}).decode(),
        flush=True,
    )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for s in servers:
        s.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="zero_upstream", description=__doc__.splitlines()[0])
    p.add_argument("--ports", type=int, default=1, help="unpaced listening ports (replicas)")
    p.add_argument("--paced-ports", type=int, default=0, help="paced listening ports (replicas)")
    p.add_argument("--chunks", type=int, default=64, help="SSE content chunks per stream")
    p.add_argument("--chunk-delay-ms", type=float, default=0.0, help="gap before each chunk")
    p.add_argument("--host", default="127.0.0.1")
    args = p.parse_args(argv)
    try:
        import uvloop
    except ImportError:  # plain asyncio still works, just slower
        runner = asyncio.run
    else:
        runner = uvloop.run
    runner(serve(args.ports, args.paced_ports, args.chunks, args.chunk_delay_ms / 1000, args.host))
    return 0


if __name__ == "__main__":
    sys.exit(main())
