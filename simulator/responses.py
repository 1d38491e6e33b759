"""`/v1/responses` on the simulated engine: the request's `instructions` and `input` become chat
messages as vLLM builds them, the engine generates (prefix cache, batching, KV events as for a
chat), and the answer is a Response object, or an SSE stream of vLLM's events (`response.created`,
`response.in_progress`, `response.output_item.added`, `response.content_part.added`,
`response.output_text.delta`..., `.done`s, then `response.completed`, or `response.incomplete`
when `max_output_tokens` cut it), no `[DONE]`.

Responses are stored (bounded, per replica) so that `previous_response_id` continues one: its
conversation goes between the instructions and the new input; an id this replica does not hold is
a 404, as vLLM answers. A stored response is also served by id, as vLLM serves it:
`GET /v1/responses/{id}` (the Response object), `POST /v1/responses/{id}/cancel` (a 400 "Cannot
cancel a synchronous response." for a finished one: nothing here runs in the background), and
`DELETE /v1/responses/{id}` in OpenAI's shape (`{"id", "object": "response.deleted", "deleted":
true}`; vLLM itself has no DELETE route and answers 405). An unknown id is vLLM's 404
`Response with id '...' not found.` (`invalid_request_error`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from prefix_index.templates import responses_messages
from simulator.openai_api import ApiError, bad
from simulator.sequence import Sequence
from simulator.serving import CompletionService, json_object, unless_gone

MAX_STORED = 10_000


def input_messages(items: Any) -> list[dict[str, Any]]:
    """vLLM's construct_input_messages, less the instructions (prefix_index.templates renders
    the same conversation for the gateway); an item that is not an object is a 400."""
    if isinstance(items, list) and not all(isinstance(item, Mapping) for item in items):
        raise bad("input items must be objects", "input")
    return responses_messages(None, items)


class ResponsesService:
    """What `/v1/responses` does, on the chat service's engine, tokenizer and fault switch."""

    def __init__(self, service: CompletionService) -> None:
        self.service = service
        # response id -> (its conversation for a follow-up, the Response object)
        self.stored: OrderedDict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = OrderedDict()

    async def handle(self, request: Request) -> Response:
        svc = self.service
        body = await json_object(request)
        model = body.get("model")
        if model is not None and model != svc.model_name:
            raise ApiError(404, f"The model `{model}` does not exist.", "model")
        instructions = body.get("instructions")
        messages = [{"role": "system", "content": instructions}] if instructions else []
        prev_id = body.get("previous_response_id")
        if prev_id is not None:
            held = self.stored.get(prev_id) if isinstance(prev_id, str) else None
            if held is None:
                raise ApiError(404, f"Response with id '{prev_id}' not found.",
                               "previous_response_id")
            messages += held[0]
        if not isinstance(body.get("input"), str | list):
            raise bad("input must be a string or a list of items", "input")
        messages += input_messages(body.get("input"))
        max_tokens = body.get("max_output_tokens")
        if max_tokens is not None and (isinstance(max_tokens, bool)
                                       or not isinstance(max_tokens, int) or max_tokens < 1):
            raise bad("max_output_tokens must be an integer >= 1", "max_output_tokens")
        try:
            prompt = svc.tok.encode_chat(messages, True)
        except ValueError as exc:
            raise bad(str(exc), "input") from None
        if len(prompt) + (max_tokens or 1) > svc.max_model_len:
            raise bad(f"This model's maximum context length is {svc.max_model_len} tokens.",
                      "input")
        fault = svc.faults.take()
        if fault is not None and fault.mode in ("error_503", "error_500"):
            raise ApiError(503 if fault.mode == "error_503" else 500, f"simulated fault {fault.mode}")
        events: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()
        rid = uuid.uuid4().hex
        seq = svc.runner.submit(f"resp-{rid}", prompt, max_tokens=max_tokens,
                                cache_salt=body.get("cache_salt"),
                                sink=lambda s: events.put_nowait((s.output[-1], s.finish_reason)))
        answer = _Answer(f"resp_{rid}", svc.model_name, body, seq)
        history = [m for m in messages if m.get("role") != "system"]
        if body.get("stream") is True:
            return StreamingResponse(self._stream(answer, events, history),
                                     media_type="text/event-stream")
        try:
            await unless_gone(self._collect(answer, events), request.receive)
        finally:
            if not seq.finished:
                svc.runner.abort(seq)
        self._store(answer, history)
        return Response(orjson.dumps(answer.response()), media_type="application/json")

    async def _collect(self, answer: _Answer, events: asyncio.Queue[tuple[int, str | None]]) -> None:
        while True:
            token, reason = await events.get()
            answer.text.append(self.service.tok.decode_filler(token))
            if reason is not None:
                answer.reason = reason
                return

    def _store(self, answer: _Answer, history: list[dict[str, Any]]) -> None:
        if answer.reason is None:
            return
        talk = [*history, {"role": "assistant", "content": "".join(answer.text)}]
        self.stored[answer.id] = (talk, answer.response())
        while len(self.stored) > MAX_STORED:
            self.stored.popitem(last=False)

    def _held(self, request: Request) -> tuple[str, dict[str, Any]]:
        rid = request.path_params["response_id"]
        held = self.stored.get(rid)
        if held is None:
            raise ApiError(404, f"Response with id '{rid}' not found.", kind="invalid_request_error")
        return rid, held[1]

    async def retrieve(self, request: Request) -> Response:
        return _json(self._held(request)[1])

    async def cancel(self, request: Request) -> Response:
        self._held(request)  # nothing runs in the background: every stored one has finished
        raise ApiError(400, "Cannot cancel a synchronous response.", kind="invalid_request_error")

    async def delete(self, request: Request) -> Response:
        rid, _ = self._held(request)
        del self.stored[rid]
        return _json({"id": rid, "object": "response.deleted", "deleted": True})

    async def _stream(self, a: _Answer, events: asyncio.Queue[tuple[int, str | None]],
                      history: list[dict[str, Any]]) -> AsyncIterator[bytes]:
        seq_no = iter(range(1 << 62))

        def event(kind: str, **fields: Any) -> bytes:
            obj = {"type": kind, "sequence_number": next(seq_no), **fields}
            return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"

        item = {"id": a.msg_id, "type": "message", "role": "assistant", "status": "in_progress",
                "content": []}
        where = {"item_id": a.msg_id, "output_index": 0, "content_index": 0}
        part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": None}
        try:
            yield event("response.created", response=a.response("in_progress"))
            yield event("response.in_progress", response=a.response("in_progress"))
            yield event("response.output_item.added", output_index=0, item=item)
            yield event("response.content_part.added", **where, part=part)
            while a.reason is None:
                token, a.reason = await events.get()
                piece = self.service.tok.decode_filler(token)
                a.text.append(piece)
                yield event("response.output_text.delta", **where, delta=piece, logprobs=[])
            text = "".join(a.text)
            yield event("response.output_text.done", **where, text=text, logprobs=[])
            yield event("response.content_part.done", **where, part={**part, "text": text})
            yield event("response.output_item.done", output_index=0, item=a.message())
            final = a.response()
            yield event(f"response.{final['status']}", response=final)
            self._store(a, history)
        finally:
            if not a.seq.finished:
                self.service.runner.abort(a.seq)


def _json(obj: Any) -> Response:
    return Response(orjson.dumps(obj), media_type="application/json")


class _Answer:
    """One response as it is generated: its ids, text so far and how it ended."""

    def __init__(self, rid: str, model: str, body: Mapping[str, Any], seq: Sequence) -> None:
        self.id, self.model, self.body, self.seq = rid, model, body, seq
        self.msg_id = "msg_" + rid[5:]
        self.created = int(time.time())
        self.text: list[str] = []
        self.reason: str | None = None

    def message(self) -> dict[str, Any]:
        return {"id": self.msg_id, "type": "message", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "".join(self.text), "annotations": [],
                             "logprobs": None}]}

    def response(self, status: str | None = None) -> dict[str, Any]:
        seq, body = self.seq, self.body
        if status is None:
            status = "incomplete" if self.reason == "length" else "completed"
        done = status != "in_progress"
        out = len(seq.output)
        return {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model,
            "status": status, "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata"), "parallel_tool_calls": True,
            "previous_response_id": body.get("previous_response_id"), "reasoning": None,
            "service_tier": "auto", "temperature": body.get("temperature", 1.0),
            "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [],
            "top_p": body.get("top_p", 1.0), "truncation": "disabled", "user": body.get("user"),
            "output": [self.message()] if done else [],
            "usage": {
                "input_tokens": seq.prompt_len,
                "input_tokens_details": {"cached_tokens": seq.cached_tokens},
                "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": seq.prompt_len + out,
            } if done else None,
        }
