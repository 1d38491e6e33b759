"""The OpenAPI operations and request schemas of the endpoint kinds beyond chat and completions
(`gateway/kinds.py`), for `gateway/openapi.py`: what the gateway checks in each body
(`gateway/bodies.py`, `gateway/multipart.py`); every other field passes through."""

from __future__ import annotations

from typing import Any

from gateway.api.openai import MAX_TOKEN_ID, MAX_TOKENS_CAP

_REF = "#/components/schemas/"
TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}
MODEL = {"type": "string", "minLength": 1, "description": "Optional: the default pool serves a "
         "request without one (the first route that takes any model, else the first pool)."}
PROMPT = {
    "oneOf": [
        {"type": "string"},
        {"type": "array", "minItems": 1, "items": {"type": "string"}},
        {"type": "array", "minItems": 1, "items": TOKEN_ID},
        {"type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1, "items": TOKEN_ID}},
    ]
}
TEXTS = {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "string"}},
                   {"type": "object"}]}  # fmt: skip


def _body(required: list[str], props: dict[str, Any], note: str) -> dict[str, Any]:
    return {"type": "object", "required": required, "description": note + " Other fields pass "
            "through.", "properties": {"model": MODEL, **props}}  # fmt: skip


def request_schemas() -> dict[str, Any]:
    def nullable_int(lo: int, hi: int) -> dict[str, Any]:
        return {"type": "integer", "minimum": lo, "maximum": hi, "nullable": True}

    pooled = "`input` as a completion prompt (the first is hashed for prefix routing); or chat " \
        "`messages` instead of `input`."  # fmt: skip
    return {
        "EmbeddingRequest": _body(["input"], {
            "input": PROMPT, "dimensions": nullable_int(1, 1 << 20),
            "encoding_format": {"type": "string", "enum": ["float", "base64"], "nullable": True},
        }, pooled),  # fmt: skip
        "PoolingRequest": _body(["input"], {"input": PROMPT}, pooled),
        "ScoreRequest": _body(["text_1", "text_2"], {"text_1": TEXTS, "text_2": TEXTS},
                              "Each `text_1` scored against `text_2` (`text_1` is hashed)."),
        "RerankRequest": _body(["query", "documents"], {
            "query": {"oneOf": [{"type": "string"}, {"type": "object"}]},
            "documents": {"oneOf": [
                {"type": "array", "items": {"oneOf": [{"type": "string"}, {"type": "object"}]}},
                {"type": "object"}]},
            "top_n": nullable_int(0, 1 << 31),
        }, "Documents ranked against `query` (hashed)."),  # fmt: skip
        "TokenizeRequest": _body(["prompt"], {"prompt": {"type": "string"}},
                                 "`prompt`, or chat `messages` instead. Routed by load."),
        "DetokenizeRequest": _body(["tokens"], {"tokens": {"type": "array", "items": TOKEN_ID}},
                                   "Routed by load."),
        "ResponsesRequest": _body(["input"], {
            "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
                "type": "object", "properties": {"content": {"nullable": True, "oneOf": [
                    {"type": "string"}, {"type": "array", "items": {"type": "object"}}]}}}}]},
            "instructions": {"type": "string", "nullable": True},
            "previous_response_id": {"type": "string", "nullable": True},
            "max_output_tokens": nullable_int(1, MAX_TOKENS_CAP),
            "stream": {"type": "boolean", "nullable": True},
            "temperature": {"type": "number", "nullable": True},
            "top_p": {"type": "number", "nullable": True},
        }, "`instructions` and `input` are hashed as chat messages; a request naming a "
           "`previous_response_id` goes to the replica that made that response."),  # fmt: skip
        "AudioRequest": {
            "type": "object", "required": ["file"],
            "description": "A multipart form, forwarded unchanged (boundary kept); the gateway "
            "reads `model` and `stream`. Routed by load.",
            "properties": {
                "file": {"type": "string", "format": "binary"},
                "model": {"type": "string", "minLength": 1, "maxLength": 256},
                "stream": {"type": "string", "enum": ["true", "false"]},
            },
        },  # fmt: skip
    }


# path -> (summary, request schema, operationId, streams)
OPERATIONS: dict[str, tuple[str, str, str, bool]] = {
    "/v1/responses": ("Responses API, routed like chat", "ResponsesRequest", "responses", True),
    "/v1/embeddings": ("Embeddings", "EmbeddingRequest", "embeddings", False),
    "/pooling": ("Pooling (vLLM)", "PoolingRequest", "pooling", False),
    "/classify": ("Classification (vLLM)", "PoolingRequest", "classify", False),
    "/v1/score": ("Scores of text pairs (vLLM)", "ScoreRequest", "score_v1", False),
    "/score": ("Scores of text pairs (vLLM)", "ScoreRequest", "score", False),
    "/v1/rerank": ("Rerank (vLLM, Jina-style)", "RerankRequest", "rerank_v1", False),
    "/rerank": ("Rerank (vLLM)", "RerankRequest", "rerank", False),
    "/v2/rerank": ("Rerank (vLLM, Cohere-style)", "RerankRequest", "rerank_v2", False),
    "/tokenize": ("Tokenize with the model's tokenizer", "TokenizeRequest", "tokenize", False),
    "/detokenize": ("Token ids back to text", "DetokenizeRequest", "detokenize", False),
    "/v1/audio/transcriptions": ("Transcribe audio", "AudioRequest", "transcriptions", True),
    "/v1/audio/translations": ("Translate audio", "AudioRequest", "translations", True),
}


def kind_paths(
    headers: list[dict[str, Any]], errors: dict[str, Any], answer: dict[str, Any]
) -> dict[str, Any]:
    """The operations of OPERATIONS with the proxy paths' `headers`, `errors` and answer schema."""
    out: dict[str, Any] = {}
    for path, (summary, request, op_id, streams) in OPERATIONS.items():
        media = "multipart/form-data" if request == "AudioRequest" else "application/json"
        content: dict[str, Any] = {"application/json": {"schema": answer}}
        if request == "AudioRequest":
            content["text/plain"] = {"schema": {"type": "string"}}  # response_format: text
        if streams:
            content["text/event-stream"] = {"schema": {"$ref": _REF + "StreamEvent"}}
        out[path] = {"post": {
            "operationId": op_id, "summary": summary, "parameters": headers,
            "requestBody": {"required": True, "content": {media: {"schema": {"$ref": _REF + request}}}},
            "responses": {"200": {"description": "The replica's answer, relayed unchanged.",
                                  "content": content}, **errors},
        }}  # fmt: skip
    return out


_RESPONSE_ID = {
    "name": "response_id", "in": "path", "required": True,
    "description": "A response's id, as `/v1/responses` answered it (`resp_...`).",
    "schema": {"type": "string", "minLength": 1, "maxLength": 256, "pattern": "^[^/]+$"},
}  # fmt: skip


def response_id_paths(errors: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    """`GET`/`DELETE /v1/responses/{response_id}`, `POST .../cancel`: sent to the replica that
    made the response (gateway/response_ids.py) and relayed as it answers."""

    def op(op_id: str, summary: str) -> dict[str, Any]:
        return {
            "operationId": op_id, "summary": summary, "parameters": [_RESPONSE_ID],
            "responses": {"200": {"description": "The replica's answer, relayed unchanged.",
                                  "content": {"application/json": {"schema": answer}}}, **errors},
        }  # fmt: skip

    return {
        "/v1/responses/{response_id}": {
            "get": op("response_retrieve", "A stored response, from the replica that made it"),
            "delete": op("response_delete", "Delete a stored response on the replica that made it"),
        },
        "/v1/responses/{response_id}/cancel": {
            "post": op("response_cancel", "Cancel a response on the replica that made it"),
        },
    }
