"""The OpenAI wire format as vLLM speaks it: request parsing, response chunks, error bodies.

Pure functions and dataclasses; no I/O, no engine.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from simulator.tokenizer import Tokenizer

MAX_TOKEN_ID = 2**31 - 1


class ApiError(Exception):
    """An error the client sees as vLLM's `{"error": {message, type, param, code}}`."""

    TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
             503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind  # the error's `type`; None: the status's (TYPES)

    def body(self) -> dict[str, Any]:
        kind = self.kind or self.TYPES.get(self.status, "Error")
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.status}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


@dataclass(slots=True)
class EngineRequest:
    """A chat or completions request, reduced to what the engine needs and how to frame the
    answer (stream, usage, ids)."""

    chat: bool
    model: str | None
    prompts: list[list[int]]
    max_tokens: int | None
    stream: bool = False
    include_usage: bool = False
    priority: int = 0
    cache_salt: str | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request_id


def _opt_int(body: Mapping[str, Any], key: str, lo: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise bad(f"{key} must be an integer >= {lo}", key)
    return v


def _token_list(v: Any) -> list[int] | None:
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool)
                                         for t in v):
        if any(t < 0 or t > MAX_TOKEN_ID for t in v):
            raise bad(f"token ids must be in [0, {MAX_TOKEN_ID}]", "prompt")
        return list(v)
    return None


def _prompts(v: Any, tok: Tokenizer) -> list[list[int]]:
    """vLLM's accepted prompt shapes: str, list[str], list[int], list[list[int]]."""
    if isinstance(v, str):
        return [tok.encode(v)]
    single = _token_list(v)
    if single is not None:
        return [single]
    if isinstance(v, list) and v:
        out = []
        for item in v:
            ids = tok.encode(item) if isinstance(item, str) else _token_list(item)
            if ids is None:
                break
            out.append(ids)
        else:
            return out
    raise bad("prompt must be a string, a list of strings, a list of token ids or a list of "
              "lists of token ids", "prompt")


def parse_request(body: Any, tok: Tokenizer, *, chat: bool) -> EngineRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model must be a string", "model")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or \
                not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise bad("messages must be a non-empty list of objects with a role", "messages")
        add_gen = body.get("add_generation_prompt", True) is not False
        try:
            prompts = [tok.encode_chat(messages, add_gen)]
        except ValueError as exc:
            raise bad(str(exc), "messages") from None
        max_tokens = _opt_int(body, "max_completion_tokens", 1)
        if max_tokens is None:
            max_tokens = _opt_int(body, "max_tokens", 1)
    else:
        if "prompt" not in body:
            raise bad("prompt is required", "prompt")
        prompts = _prompts(body["prompt"], tok)
        max_tokens = _opt_int(body, "max_tokens", 1)
    if any(not p for p in prompts):
        raise bad("the prompt is empty", "prompt")
    n = _opt_int(body, "n", 1)
    if n is not None and n != 1:
        raise bad("the simulator supports n=1 only", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream must be a boolean", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise bad("stream_options must be an object", "stream_options")
    priority = body.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise bad("priority must be an integer", "priority")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad("cache_salt must be a non-empty string", "cache_salt")
    return EngineRequest(chat=chat, model=model, prompts=prompts, max_tokens=max_tokens,
                         stream=stream, include_usage=bool(opts.get("include_usage")),
                         priority=priority, cache_salt=salt)


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion, "prompt_tokens_details": {"cached_tokens": cached}}


def stream_chunk(req: EngineRequest, model: str, index: int, text: str | None,
                 finish_reason: str | None, *, role: bool = False) -> dict[str, Any]:
    """One SSE chunk for one choice; a chat chunk's first delta carries the role."""
    if req.chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": text}
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None,
                                  "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "text_completion"
    if finish_reason is not None:
        choice["stop_reason"] = None
    return {"id": req.response_id, "object": obj, "created": req.created, "model": model,
            "choices": [choice]}


def usage_chunk(req: EngineRequest, model: str, use: dict[str, Any]) -> dict[str, Any]:
    obj = "chat.completion.chunk" if req.chat else "text_completion"
    return {"id": req.response_id, "object": obj, "created": req.created, "model": model,
            "choices": [], "usage": use}


def full_response(req: EngineRequest, model: str, texts: list[str], reasons: list[str],
                  use: dict[str, Any]) -> dict[str, Any]:
    choices: list[dict[str, Any]] = []
    for i, (text, reason) in enumerate(zip(texts, reasons, strict=True)):
        if req.chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": text},
                            "logprobs": None, "finish_reason": reason, "stop_reason": None})
        else:
            choices.append({"index": i, "text": text, "logprobs": None,
                            "finish_reason": reason, "stop_reason": None})
    return {"id": req.response_id, "object": "chat.completion" if req.chat else "text_completion",
            "created": req.created, "model": model, "choices": choices, "usage": use}
