"""A small scriptable OpenAI-speaking upstream for gateway tests (a handler, not a mock).

Modes: ok (a non-streamed answer has `n` choices of `chunks` words, no more than `max_tokens`,
all counted in its usage, as vLLM counts them), error_503, error_500, die_midstream (abort the socket after some chunks), stall
(send some chunks then hang), slow (sleep before answering), sglang_error (flat error body).

Framing modes (SSE as some replicas really send it, or break it), all with a final usage chunk when
the request asks for one: crlf (events end in CRLF CRLF), bare_cr (CR CR), split (each event cut
into pieces sent apart), garbage_utf8 / garbage_json (a non-UTF-8 / non-JSON event after two good
ones, then the rest), die_mid_event / stall_mid_event (half an event, then abort / hang),
echo_request_id (an ordinary answer that echoes the request's x-request-id header, as vLLM does).

drip: a stream of `chunks` events `chunk_delay_s` apart that notices the gateway hanging up
(counted in `cancelled`). big: a non-streamed answer whose content is `chunks` bytes, sent (with a
Content-Length) in two halves `chunk_delay_s` apart.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from bench.harness import lifespan_done, read_body


@dataclass
class Upstream:
    name: str
    mode: str = "ok"
    chunks: int = 8
    chunk_delay_s: float = 0.0
    delay_s: float = 0.0
    model: str = "test-model"
    calls: int = 0
    bodies: list[bytes] = field(default_factory=list)
    headers: list[dict[bytes, bytes]] = field(default_factory=list)
    cancelled: int = 0
    completed: int = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if await lifespan_done(scope, receive, send):
            return
        path = scope["path"]
        if path == "/health":
            await _json(send, 200 if self.mode != "unhealthy" else 503, {"status": "ok"})
            return
        if path == "/metrics":
            await _text(
                send,
                200,
                f'vllm:num_requests_running{{engine="0"}} {self.calls - self.completed}\n',
            )
            return
        if path == "/v1/models":
            await _json(
                send, 200, {"object": "list", "data": [{"id": self.model, "object": "model"}]}
            )
            return
        body = await read_body(receive)
        self.calls += 1
        self.bodies.append(body)
        self.headers.append(dict(scope["headers"]))
        req = orjson.loads(body)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.mode == "error_503":
            await _json(
                send,
                503,
                {
                    "error": {
                        "message": "overloaded",
                        "type": "ServiceUnavailableError",
                        "param": None,
                        "code": 503,
                    }
                },
            )
            return
        if self.mode == "error_500":
            await _json(
                send,
                500,
                {
                    "error": {
                        "message": "boom at 10.0.0.7",
                        "type": "InternalServerError",
                        "param": None,
                        "code": 500,
                    }
                },
            )
            return
        if self.mode == "sglang_error":
            await _json(
                send,
                400,
                {
                    "object": "error",
                    "message": "bad thing",
                    "type": "BadRequest",
                    "param": None,
                    "code": 400,
                },
            )
            return
        kind = "chat" if path.endswith("chat/completions") else "text"
        if self.mode in FRAMING_MODES:
            await self._framed(req, kind, receive, send)
            return
        if self.mode == "drip":
            await self._drip(req, receive, send)
            return
        if self.mode == "big":
            await self._big(req, send)
            return
        if not req.get("stream"):
            # `n` choices of `chunks` words each (no more than max_tokens), all in the usage
            words = min(self.chunks, req.get("max_tokens") or self.chunks)
            text = " ".join(f"w{i}" for i in range(words))
            n = req.get("n") or 1
            choices: list[dict[str, Any]] = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
                if kind == "chat"
                else {"index": i, "text": text, "finish_reason": "stop"}
                for i in range(n)
            ]
            await _json(
                send,
                200,
                {
                    "id": "cmpl-1",
                    "object": "chat.completion" if kind == "chat" else "text_completion",
                    "created": int(time.time()),
                    "model": req["model"],
                    "choices": choices,
                    "usage": {
                        "prompt_tokens": 5,
                        "completion_tokens": n * words,
                        "total_tokens": 5 + n * words,
                    },
                    "served_by": self.name,
                },
            )
            self.completed += 1
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        try:
            for i in range(self.chunks):
                if self.mode == "die_midstream" and i == 2:
                    raise _Abort
                if self.mode == "stall" and i == 2:
                    # hang until the gateway hangs up: uvicorn reports that as http.disconnect
                    if (await receive())["type"] == "http.disconnect":
                        self.cancelled += 1
                        return
                delta = {"content": f"w{i} "} if i else {"role": "assistant", "content": "w0 "}
                chunk = {
                    "id": "chatcmpl-1",
                    "object": "chat.completion.chunk",
                    "created": 0,
                    "model": req["model"],
                    "choices": [{"index": 0, "delta": delta, "finish_reason": None}]
                    if kind == "chat"
                    else [{"index": 0, "text": f"w{i} ", "finish_reason": None}],
                }
                await send(
                    {
                        "type": "http.response.body",
                        "body": b"data: " + orjson.dumps(chunk) + b"\n\n",
                        "more_body": True,
                    }
                )
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
            await send(
                {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}
            )
            self.completed += 1
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        except _Abort:
            # raising after the response started makes uvicorn drop the connection without the
            # chunked terminator: the client sees a body that ends early
            raise RuntimeError("die mid-stream") from None

    async def _drip(self, req: dict[str, Any], receive: Any, send: Any) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        for i in range(self.chunks):
            data = b"data: " + orjson.dumps(_chunk(req, "chat", i)) + b"\n\n"
            await send({"type": "http.response.body", "body": data, "more_body": True})
            try:
                msg = await asyncio.wait_for(receive(), self.chunk_delay_s)
            except TimeoutError:
                continue
            if msg["type"] == "http.disconnect":
                self.cancelled += 1
                return
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        self.completed += 1

    async def _big(self, req: dict[str, Any], send: Any) -> None:
        head = b'{"id":"cmpl-big","object":"chat.completion","model":"' + req["model"].encode()
        head += b'","choices":[{"index":0,"message":{"role":"assistant","content":"'
        tail = b'"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":1}}'
        body = head + b"x" * self.chunks + tail
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        half = len(body) // 2
        await send({"type": "http.response.body", "body": body[:half], "more_body": True})
        await asyncio.sleep(self.chunk_delay_s)
        await send({"type": "http.response.body", "body": body[half:], "more_body": False})
        self.completed += 1

    async def _framed(self, req: dict[str, Any], kind: str, receive: Any, send: Any) -> None:
        mode = self.mode
        rid = self.headers[-1].get(b"x-request-id", b"")
        extra = [(b"x-request-id", rid)] if mode == "echo_request_id" else []
        if not req.get("stream"):
            body = orjson.dumps(
                {
                    "id": "cmpl-1",
                    "object": "chat.completion" if kind == "chat" else "text_completion",
                    "created": 0,
                    "model": req["model"],
                    "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": "w0"}}
                        if kind == "chat"
                        else {"index": 0, "text": "w0"}
                    ],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
                }
            )
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json"), *extra],
                }
            )
            await send({"type": "http.response.body", "body": body, "more_body": False})
            self.completed += 1
            return
        sep = {"crlf": b"\r\n\r\n", "bare_cr": b"\r\r"}.get(mode, b"\n\n")
        events = [b"data: " + orjson.dumps(_chunk(req, kind, i)) + sep for i in range(self.chunks)]
        if (req.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 5, "completion_tokens": self.chunks}
            usage["total_tokens"] = 5 + self.chunks
            last = {**_chunk(req, kind, 0), "choices": [], "usage": usage}
            events.append(b"data: " + orjson.dumps(last) + sep)
        events.append(b"data: [DONE]" + sep)
        if mode == "garbage_utf8":
            events.insert(2, b'data: {"choices":[{"index":0,"delta":{"content":"\xff\xfe"}}]}\n\n')
        elif mode == "garbage_json":
            events.insert(2, b'data: {"choices": [not json\n\n')
        elif mode in ("die_mid_event", "stall_mid_event"):
            events = [*events[:2], events[2][: len(events[2]) // 2]]
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), *extra],
            }
        )

        async def body(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})
            await asyncio.sleep(self.chunk_delay_s or 0.01)  # apart, so the gateway reads apart

        try:
            for ev in events:
                if mode == "split":
                    third = max(1, len(ev) // 3)
                    for piece in (ev[:third], ev[third : 2 * third], ev[2 * third :]):
                        await body(piece)
                else:
                    await body(ev)
            if mode == "die_mid_event":
                raise _Abort
            if mode == "stall_mid_event":
                if (await receive())["type"] == "http.disconnect":
                    self.cancelled += 1
                return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            self.completed += 1
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        except _Abort:
            raise RuntimeError("die mid-event") from None


FRAMING_MODES = frozenset(
    {
        "crlf",
        "bare_cr",
        "split",
        "garbage_utf8",
        "garbage_json",
        "die_mid_event",
        "stall_mid_event",
        "echo_request_id",
    }
)


def _chunk(req: dict[str, Any], kind: str, i: int) -> dict[str, Any]:
    delta = {"content": f"w{i} "} if i else {"role": "assistant", "content": "w0 "}
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
        "created": 0,
        "model": req["model"],
        "choices": [{"index": 0, "delta": delta, "finish_reason": None}]
        if kind == "chat"
        else [{"index": 0, "text": f"w{i} ", "finish_reason": None}],
    }


class _Abort(Exception):
    pass


async def _json(send: Any, status: int, data: Any) -> None:
    body = orjson.dumps(data)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _text(send: Any, status: int, text: str) -> None:
    body = text.encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"text/plain")],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
