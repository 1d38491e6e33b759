"""Parse and check the bodies of the endpoint kinds beyond chat and completions (vLLM's OpenAI
server: embeddings, pooling, classify, score, rerank, tokenize, detokenize, responses; multipart
audio in `gateway/api/multipart.py`); pure, no I/O.

Only what the gateway relies on is checked (the `model`, the fields it routes or counts by, their
types: a wrong type is a 400 naming the field in `param`); every other field passes through to the
replica untouched. `model` may be left out, as vLLM allows: the request then goes to the default
pool (`pipeline.default_pool`) and the engine serves its own model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.api.openai import (
    MAX_TOKENS_CAP,
    ParsedRequest,
    check_messages,
    check_prompt,
    common_fields,
    load_object,
    model_field,
    optional_int,
    stream_fields,
)
from gateway.errors import BadRequest

Check = Callable[[dict[str, Any]], None]


def parse_json(kind: str, raw: bytes, check: Check, *, streams: bool = False) -> ParsedRequest:
    """A JSON body of `kind`: the shared fields, then the kind's own `check`."""
    body = load_object(raw)
    model = model_field(body, required=False)
    check(body)
    stream = stream_fields(body)[0] if streams else False
    return ParsedRequest(kind, raw, body, model, stream, user=common_fields(body))


def parse_responses(raw: bytes) -> ParsedRequest:
    """`/v1/responses`: `input` (a string or an array of items), `instructions`,
    `previous_response_id`, `max_output_tokens`, `stream`. Its usage always comes in the answer
    (the `response.completed` event when streamed), so nothing is asked for on the client's behalf."""
    req = parse_json("responses", raw, check_responses, streams=True)
    req.include_usage = True
    req.max_tokens = optional_int(req.body, "max_output_tokens", 1, MAX_TOKENS_CAP)
    return req


def _bad(message: str, param: str) -> BadRequest:
    return BadRequest(message, param=param)


def _optional_str(body: dict[str, Any], key: str) -> None:
    v = body.get(key)
    if v is not None and not isinstance(v, str):
        raise _bad(f"'{key}' must be a string", key)


def _texts(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and bool(v) and all(isinstance(s, str) for s in v))


def check_input_or_messages(body: dict[str, Any]) -> None:
    """Embeddings, pooling, classify: `input` as a completion prompt, or chat `messages`."""
    if "messages" in body and "input" not in body:
        check_messages(body["messages"])
        return
    if "input" not in body:
        raise _bad("'input' is required", "input")
    try:
        check_prompt(body["input"])
    except BadRequest:
        raise _bad(
            "'input' must be a string, an array of strings, an array of token ids, "
            "or an array of token-id arrays (non-empty)",
            "input",
        ) from None


def check_embeddings(body: dict[str, Any]) -> None:
    check_input_or_messages(body)
    optional_int(body, "dimensions", 1, 1 << 20)
    fmt = body.get("encoding_format")
    if fmt is not None and fmt not in ("float", "base64"):
        raise _bad("'encoding_format' must be 'float' or 'base64'", "encoding_format")


def check_rerank(body: dict[str, Any]) -> None:
    """`query` and `documents` (strings, or vLLM's multimodal objects); `top_n`."""
    query = body.get("query")
    if not isinstance(query, str | dict):
        raise _bad("'query' is required and must be a string", "query")
    docs = body.get("documents")
    if isinstance(docs, list):
        for i, d in enumerate(docs):
            if not isinstance(d, str | dict):
                raise _bad(f"'documents[{i}]' must be a string or an object", f"documents[{i}]")
    elif not isinstance(docs, dict):
        raise _bad("'documents' is required and must be an array", "documents")
    optional_int(body, "top_n", 0, 1 << 31)


def check_score(body: dict[str, Any]) -> None:
    """`text_1` and `text_2`: a string or an array of strings each (or vLLM's multimodal object)."""
    for key in ("text_1", "text_2"):
        v = body.get(key)
        if not (_texts(v) or isinstance(v, dict)):
            raise _bad(f"'{key}' is required and must be a string or an array of strings", key)


def check_tokenize(body: dict[str, Any]) -> None:
    """`prompt` (a string), else chat `messages`."""
    if "prompt" not in body and "messages" in body:
        check_messages(body["messages"])
    elif not isinstance(body.get("prompt"), str):
        raise _bad("'prompt' (a string) or 'messages' is required", "prompt")


def check_detokenize(body: dict[str, Any]) -> None:
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise _bad("'tokens' is required and must be an array of token ids", "tokens")
    try:
        if tokens:
            check_prompt(tokens)
    except BadRequest:
        raise _bad("'tokens' must be an array of token ids", "tokens") from None


def check_responses(body: dict[str, Any]) -> None:
    v = body.get("input")
    if isinstance(v, list):
        for i, item in enumerate(v):
            if not isinstance(item, dict):
                raise _bad(f"'input[{i}]' must be an object", f"input[{i}]")
            content = item.get("content")
            if content is not None and not isinstance(content, str | list):
                raise _bad(
                    f"'input[{i}].content' must be a string or an array of parts",
                    f"input[{i}].content",
                )
    elif not isinstance(v, str):
        raise _bad("'input' is required and must be a string or an array of items", "input")
    _optional_str(body, "instructions")
    _optional_str(body, "previous_response_id")
