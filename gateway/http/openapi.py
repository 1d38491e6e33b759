"""The OpenAPI 3.0 document of the gateway's public endpoints, served at `GET /openapi.json`.

It states what the gateway itself checks (`gateway/api/openai.py` for chat and completions;
`gateway/api/bodies.py` and `gateway/api/multipart.py` for the other endpoint kinds of
`gateway/api/kinds.py`), not all of the OpenAI API: any other field passes through to the replica
untouched. `passthrough:` paths depend on the config and are not listed. Admin and debug routes
are left out on purpose. Fuzzers (schemathesis, `tests/chaos/test_fuzz_openapi.py`) run against
this document.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gateway.api.openai import MAX_DEPTH, MAX_TOKEN_ID, MAX_TOKENS_CAP
from gateway.version import gateway_version

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
    made the response (gateway/pipeline/by_id.py) and relayed as it answers."""

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


_REF = "#/components/schemas/"
_ERROR_STATUSES = {
    "400": "Malformed body, wrong types or missing fields (`param` names the field).",
    "401": "Missing or unknown API key.",
    "403": "The tenant may not use the requested priority class.",
    "404": "No route matches the model (`/v1/models/{model_id}`: no replica serves it; "
    "`/v1/responses/{response_id}`: no gateway knows the response, or its replica no longer "
    "holds it).",
    "413": "The body is larger than `server.max_body_bytes`.",
    "429": "Rate limited or shed by admission control (`Retry-After`).",
    "502": "The replicas failed.",
    "503": "No replica is available (`Retry-After`).",
    "504": "The replicas timed out.",
}


def _headers(classes: list[str]) -> list[dict[str, Any]]:
    return [
        {
            "name": "x-priority",
            "in": "header",
            "required": False,
            "description": "Priority class (the tenant must be allowed it). A string `priority` "
            "in the body also names a class when this header is absent; an integer one is vLLM's "
            "own field and passes through.",
            "schema": {"type": "string", "enum": [*classes, ""]},  # empty: the default
        },
        *_PLAIN_HEADERS,
    ]


_PLAIN_HEADERS: list[dict[str, Any]] = [
    {
        "name": "x-session-id",
        "in": "header",
        "required": False,
        "description": "Session stickiness key (else the body's `user`).",
        "schema": {"type": "string"},
    },
    {
        "name": "x-request-id",
        "in": "header",
        "required": False,
        "description": "Echoed back and sent upstream (first 128 characters).",
        "schema": {"type": "string"},
    },
]


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF + name}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _errors(*statuses: str) -> dict[str, Any]:
    return {
        s: {"description": _ERROR_STATUSES[s], "content": _json(_ref("Error"))} for s in statuses
    }


_PROXY_ERRORS = ("400", "401", "403", "404", "413", "429", "502", "503", "504")
# by response id: the replica's own 4xx (400: cancelling a finished response), the gateway's 404
_BY_ID_ERRORS = ("400", "401", "404", "413", "429", "502", "503", "504")


def _sampling_fields() -> dict[str, Any]:
    tokens = {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS_CAP, "nullable": True}
    number = {"type": "number", "nullable": True}
    return {
        "model": {"type": "string", "minLength": 1},
        "stream": {"type": "boolean", "nullable": True},
        "stream_options": {
            "type": "object",
            "nullable": True,
            "properties": {"include_usage": {"type": "boolean"}},
        },
        "max_tokens": tokens,
        "max_completion_tokens": tokens,
        "n": {"type": "integer", "minimum": 1, "maximum": 128, "nullable": True},
        "temperature": number,
        "top_p": number,
        "presence_penalty": number,
        "frequency_penalty": number,
        "user": {"type": "string", "nullable": True},
    }


def _schemas(classes: list[str]) -> dict[str, Any]:
    token_id = {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}
    part = {
        "type": "object",
        "required": ["type"],
        "properties": {"type": {"type": "string"}},
    }
    return {
        "Error": {
            "type": "object",
            "required": ["error"],
            "properties": {
                "error": {
                    "type": "object",
                    "required": ["message", "type", "param", "code"],
                    "properties": {
                        "message": {"type": "string"},
                        "type": {"type": "string"},
                        "param": {"type": "string", "nullable": True},
                        "code": {
                            "nullable": True,
                            "oneOf": [{"type": "string"}, {"type": "integer"}],
                        },
                    },
                }
            },
        },
        "Message": {
            "type": "object",
            "required": ["role"],
            "properties": {
                "role": {
                    "type": "string",
                    "enum": ["system", "developer", "user", "assistant", "tool", "function"],
                },
                "content": {
                    "nullable": True,
                    "oneOf": [{"type": "string"}, {"type": "array", "items": part}],
                },
            },
        },
        "ChatCompletionRequest": {
            "type": "object",
            "required": ["model", "messages"],
            "description": f"Other fields pass through. Nesting deeper than {MAX_DEPTH} is refused.",
            "properties": {
                **_sampling_fields(),
                "messages": {"type": "array", "minItems": 1, "items": _ref("Message")},
            },
        },
        "CompletionRequest": {
            "type": "object",
            "required": ["model", "prompt"],
            "description": f"Other fields pass through. Nesting deeper than {MAX_DEPTH} is refused.",
            "properties": {
                **_sampling_fields(),
                "prompt": {
                    "oneOf": [
                        {"type": "string"},
                        {"type": "array", "minItems": 1, "items": {"type": "string"}},
                        {"type": "array", "minItems": 1, "items": token_id},
                        {
                            "type": "array",
                            "minItems": 1,
                            "items": {"type": "array", "minItems": 1, "items": token_id},
                        },
                    ]
                },
            },
        },
        **request_schemas(),
        "Answer": {"type": "object", "description": "The replica's answer, relayed unchanged."},
        "Completion": {
            "type": "object",
            "required": ["choices"],
            "description": "The replica's answer, relayed unchanged.",
            "properties": {
                "id": {"type": "string"},
                "object": {"type": "string"},
                "model": {"type": "string"},
                "choices": {"type": "array"},
                "usage": {"type": "object"},
            },
        },
        "StreamEvent": {
            "type": "object",
            "description": "One server-sent event: `data:` holds a chunk as JSON, "
            '`[DONE]` at the end, or `{"error": ...}` when the stream broke.',
            "required": ["data"],
            "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
        },
        "Model": {
            "type": "object",
            "required": ["id"],
            "description": "The card the first replica serving the model reports.",
            "properties": {
                "id": {"type": "string"},
                "object": {"type": "string"},
                "created": {"type": "integer"},
                "owned_by": {"type": "string"},
            },
        },
        "ModelList": {
            "type": "object",
            "required": ["object", "data"],
            "properties": {
                "object": {"type": "string", "enum": ["list"]},
                "data": {"type": "array", "items": _ref("Model")},
            },
        },
        "Version": {
            "type": "object",
            "required": ["version"],
            "properties": {"version": {"type": "string"}},
        },
        "Ready": {
            "type": "object",
            "required": ["status", "available_replicas", "fleet", "index"],
            "properties": {
                "status": {"type": "string", "enum": ["ready", "not_ready"]},
                "available_replicas": {
                    "type": "object",
                    "additionalProperties": {"type": "integer", "minimum": 0},
                },
                "fleet": {
                    "type": "object",
                    "description": "Other gateways whose load this one counts, and whether the "
                    "shared load answers (off: not configured). Never a 503 by itself.",
                    "required": ["peers", "shared_load"],
                    "properties": {
                        "peers": {"type": "integer", "minimum": 0},
                        "shared_load": {"type": "string", "enum": ["ok", "down", "off"]},
                    },
                },
                "index": {
                    "type": "string",
                    "enum": ["ok", "down", "memory"],
                    "description": "The shared (Redis) index reachable or not; memory: per process.",
                },
            },
        },
    }


def _proxy_path(summary: str, request: str, op_id: str, classes: list[str]) -> dict[str, Any]:
    return {
        "post": {
            "operationId": op_id,
            "summary": summary,
            "parameters": _headers(classes),
            "requestBody": {"required": True, "content": _json(_ref(request))},
            "responses": {
                "200": {
                    "description": "The replica's answer: JSON, or an SSE stream when "
                    '`stream` is true (a stream that breaks ends with `data: {"error": ...}`).',
                    "content": {
                        **_json(_ref("Completion")),
                        "text/event-stream": {"schema": _ref("StreamEvent")},
                    },
                },
                **_errors(*_PROXY_ERRORS),
            },
        }
    }


def openapi_document(
    priority_classes: Iterable[str] = ("interactive", "batch"), server_url: str | None = None
) -> dict[str, Any]:
    """The document as a plain dict (JSON-ready) for a gateway with these priority classes;
    `server_url` fills `servers` when given."""
    classes = sorted(priority_classes)
    doc: dict[str, Any] = {
        "openapi": "3.0.3",
        "info": {
            "title": "kvgateway",
            "version": gateway_version(),
            "description": "KV-cache-aware routing gateway speaking the OpenAI API. "
            'Errors are always `{"error": {message, type, param, code}}`.',
        },
        "paths": {
            "/v1/chat/completions": _proxy_path(
                "Chat completion, routed to a replica", "ChatCompletionRequest", "chat", classes
            ),
            "/v1/completions": _proxy_path(
                "Text completion, routed to a replica", "CompletionRequest", "completions", classes
            ),
            **kind_paths(_headers(classes), _errors(*_PROXY_ERRORS), _ref("Answer")),
            **response_id_paths(_errors(*_BY_ID_ERRORS), _ref("Answer")),
            "/v1/models": {
                "get": {
                    "operationId": "models",
                    "summary": "Models the replicas report, merged (a tenant key under `auth: "
                    "required`)",
                    "responses": {
                        "200": {"description": "The models.", "content": _json(_ref("ModelList"))},
                        **_errors("401"),
                    },
                }
            },
            "/v1/models/{model_id}": {
                "get": {
                    "operationId": "model",
                    "summary": "One model's card, as `/v1/models` lists it",
                    "parameters": [
                        {
                            "name": "model_id",
                            "in": "path",
                            "required": True,
                            "description": "The model's id; it may hold slashes "
                            "(`meta-llama/Llama-3.1-8B-Instruct`).",
                            "schema": {"type": "string"},
                        }
                    ],
                    "responses": {
                        "200": {"description": "The model.", "content": _json(_ref("Model"))},
                        **_errors("401", "404"),
                    },
                }
            },
            "/version": {
                "get": {
                    "operationId": "version",
                    "summary": "The gateway's version (as vLLM's `/version` gives the engine's)",
                    "security": [],
                    "responses": {
                        "200": {"description": "The version.", "content": _json(_ref("Version"))}
                    },
                }
            },
            "/health": {
                "get": {
                    "operationId": "health",
                    "summary": "Liveness",
                    "security": [],
                    "responses": {
                        "200": {
                            "description": "The process serves.",
                            "content": _json(
                                {"type": "object", "properties": {"status": {"type": "string"}}}
                            ),
                        }
                    },
                }
            },
            "/ready": {
                "get": {
                    "operationId": "ready",
                    "summary": "Readiness: every pool has an available replica",
                    "security": [],
                    "responses": {
                        "200": {"description": "Ready.", "content": _json(_ref("Ready"))},
                        "503": {"description": "Not ready.", "content": _json(_ref("Ready"))},
                    },
                }
            },
            "/metrics": {
                "get": {
                    "operationId": "metrics",
                    "summary": "Prometheus metrics",
                    "security": [],
                    "responses": {
                        "200": {
                            "description": "Prometheus text format.",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
        },
        "components": {
            "schemas": _schemas(classes),
            "securitySchemes": {"tenantKey": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"tenantKey": []}, {}],
    }
    if server_url:
        doc["servers"] = [{"url": server_url}]
    return doc
