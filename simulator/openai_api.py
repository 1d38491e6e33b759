"""The OpenAI wire format as vLLM speaks it: request parsing, response chunks, error bodies.

Pure functions and dataclasses; no I/O, no engine.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from simulator.tokenizer import Tokenizer

MAX_TOKEN_ID = 2**31 - 1


@runtime_checkable
class _Renders(Protocol):
    def render_chat(self, messages: Any, add_generation_prompt: bool = True,
                    tools: Any = None) -> str: ...

    def encode(self, text: str) -> list[int]: ...


class ApiError(Exception):
    """An error the client sees as vLLM's `{"error": {message, type, param, code}}`."""

    TYPES = {400: "BadRequestError", 403: "PermissionDeniedError", 404: "NotFoundError",
             500: "InternalServerError", 503: "ServiceUnavailableError"}

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


def invalid(loc: str, kind: str, msg: str, value: Any) -> ApiError:
    """vLLM's answer to a body its request model cannot validate (FastAPI's validation error, as
    vLLM renders it: type `Bad Request`, the field's location as `param`)."""
    detail = {"type": kind, "loc": loc, "msg": msg, "input": str(value)}
    return ApiError(400, f"1 validation error:\n  {detail}", loc, kind="Bad Request")


def not_found_model(model: str, served: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist. Valid aliases: {served}.", "model")


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
    return_token_ids: bool = False  # vLLM's: the prompt's ids in the first chunk, each chunk's new ids
    greedy: bool = False  # temperature 0: the output is a function of the context alone
    continue_final: bool = False  # continue_final_message: the last (assistant) message goes on
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request_id


# pydantic's lax mode, as vLLM's request models validate scalars: an integer field takes an int,
# an integral float or a numeric string; a boolean takes true/false, 0/1 and their usual words
_TRUE = frozenset({"true", "1", "yes", "on", "t", "y"})
_FALSE = frozenset({"false", "0", "no", "off", "f", "n"})


def _lax_int(body: Mapping[str, Any], key: str) -> int | None:
    v = body.get(key)
    if v is None or (isinstance(v, int) and not isinstance(v, bool)):
        return v
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            pass
        raise invalid(f"body.{key}", "int_parsing",
                      "Input should be a valid integer, unable to parse string as an integer", v)
    raise invalid(f"body.{key}", "int_type", "Input should be a valid integer", v)


def _lax_float(body: Mapping[str, Any], key: str) -> None:
    v = body.get(key)
    if v is None or (isinstance(v, int | float) and not isinstance(v, bool)):
        return
    if isinstance(v, str):
        try:
            float(v)
            return
        except ValueError:
            raise invalid(f"body.{key}", "float_parsing",
                          "Input should be a valid number, unable to parse string as a number",
                          v) from None
    raise invalid(f"body.{key}", "float_type", "Input should be a valid number", v)


def _lax_bool(body: Mapping[str, Any], key: str) -> bool:
    v = body.get(key, False)
    if isinstance(v, bool) or v is None:
        return bool(v)
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.lower() in _TRUE | _FALSE:
        return v.lower() in _TRUE
    raise invalid(f"body.{key}", "bool_parsing",
                  "Input should be a valid boolean, unable to interpret input", v)


def _max_tokens(body: Mapping[str, Any], key: str, max_model_len: int | None) -> int | None:
    v = _lax_int(body, key)
    if v is None:
        return None
    if v < 1:
        raise bad(f"{key} must be at least 1, got {v}. (parameter={key}, value={v})", key)
    if max_model_len is not None and v > max_model_len:
        raise bad(f"{key}={v} cannot be greater than max_model_len={max_model_len}. Please "
                  f"request fewer output tokens. (parameter={key}, value={v})", key)
    return v


def _token_list(v: Any, vocab: int | None) -> list[int] | None:
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool)
                                         for t in v):
        for t in v:
            if t < 0 or t > MAX_TOKEN_ID or (vocab is not None and t >= vocab):
                raise bad(f"Token id {t} is out of vocabulary")
        return list(v)
    return None


def _prompts(v: Any, tok: Tokenizer) -> list[list[int]]:
    """vLLM's accepted prompt shapes: str, list[str], list[int], list[list[int]]."""
    vocab = getattr(tok, "vocab_size", None)
    if v is None or v == "":
        raise bad("Either prompt or prompt_embeds must be provided and non-empty. "
                  "(parameter=prompt)", "prompt")
    if v == []:
        raise bad("You must pass at least one prompt")
    if isinstance(v, str):
        return [tok.encode(v)]
    single = _token_list(v, vocab)
    if single is not None:
        return [single]
    if isinstance(v, list):
        out = []
        for i, item in enumerate(v):
            ids = tok.encode(item) if isinstance(item, str) else _token_list(item, vocab)
            if ids is None:
                raise invalid(f"body.prompt.{i}", "list_type", "Input should be a valid list",
                              item)
            out.append(ids)
        return out
    raise invalid("body.prompt", "list_type", "Input should be a valid list", v)


def parse_request(body: Any, tok: Tokenizer, *, chat: bool,
                  max_model_len: int | None = None) -> EngineRequest:
    """A chat or completions body checked as vLLM 0.32 checks it (the same status, type, param
    and message for the cases `tests/vllm_facts.py` records from the real engine)."""
    if not isinstance(body, dict):
        raise invalid("body", "model_attributes_type", "Input should be a valid dictionary", body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("body.model", "string_type", "Input should be a valid string", model)
    for key in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        _lax_float(body, key)
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise invalid("body.messages", "list_type", "Input should be a valid list", messages)
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise invalid(f"body.messages.{i}", "missing", "Field required", m)
        if not messages:
            raise bad("Cannot apply chat template to an empty conversation. Provide at least "
                      "one message.")
        add_gen = body.get("add_generation_prompt", True) is not False
        continue_final = _lax_bool(body, "continue_final_message")
        if continue_final and add_gen:
            raise bad("Cannot set both `continue_final_message` and `add_generation_prompt` to "
                      "True.")
        tools = body.get("tools")
        try:
            if continue_final and isinstance(tok, _Renders):  # the last message left open
                text = tok.render_chat(messages, False, tools if isinstance(tools, list) else None)
                prompts = [tok.encode(text.removesuffix("\n").removesuffix("<|im_end|>"))]
            else:
                prompts = [tok.encode_chat(messages, add_gen,
                                           tools if isinstance(tools, list) else None)]
        except ValueError as exc:
            raise bad(str(exc), "messages") from None
        max_tokens = _max_tokens(body, "max_completion_tokens", max_model_len)
        if max_tokens is None:
            max_tokens = _max_tokens(body, "max_tokens", max_model_len)
    else:
        prompts = _prompts(body.get("prompt"), tok)
        max_tokens = _max_tokens(body, "max_tokens", max_model_len)
    if any(not p for p in prompts):
        raise bad("Either prompt or prompt_embeds must be provided and non-empty. "
                  "(parameter=prompt)", "prompt")
    n = _lax_int(body, "n")
    if n is not None and n < 1:
        raise bad(f"n must be at least 1, got {n}.")
    if n is not None and n != 1:
        raise bad("the simulator supports n=1 only", "n")  # vLLM serves n > 1
    stream = _lax_bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not stream:
        raise bad("Stream options can only be defined when `stream=True`. "
                  "(parameter=stream_options)", "stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise invalid("body.stream_options", "model_type",
                      "Input should be a valid dictionary or instance of StreamOptions", opts)
    priority = _lax_int(body, "priority") or 0
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad("Parameter 'cache_salt' must be a non-empty string if provided. "
                  "(parameter=cache_salt)", "cache_salt")
    temperature = body.get("temperature")
    return EngineRequest(chat=chat, model=model, prompts=prompts, max_tokens=max_tokens,
                         stream=stream, include_usage=bool((opts or {}).get("include_usage")),
                         priority=priority, cache_salt=salt,
                         return_token_ids=_lax_bool(body, "return_token_ids"),
                         greedy=temperature is not None and float(temperature) == 0.0,
                         continue_final=chat and continue_final)


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion, "prompt_tokens_details": {"cached_tokens": cached}}


def stream_chunk(req: EngineRequest, model: str, index: int, text: str | None,
                 finish_reason: str | None, *, role: bool = False,
                 token_ids: list[int] | None = None,
                 prompt_ids: list[int] | None = None) -> dict[str, Any]:
    """One SSE chunk for one choice; a chat chunk's first delta carries the role. With
    `return_token_ids`, as vLLM 0.32: `token_ids` (the chunk's new ids) in the choice, and the
    prompt's ids (`prompt_ids`, given on the first chunk) at the top of a chat chunk, in the
    choice of a completions chunk."""
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
    out: dict[str, Any] = {"id": req.response_id, "object": obj, "created": req.created,
                           "model": model, "choices": [choice]}
    if req.return_token_ids:
        if req.chat:
            if role:
                out["prompt_token_ids"] = prompt_ids
            else:
                choice["token_ids"] = token_ids
        else:
            if prompt_ids is not None:
                choice["prompt_token_ids"] = prompt_ids
            choice["token_ids"] = token_ids
    return out


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
