"""The OpenAPI 3.0 document of the gateway's public endpoints, served at `GET /openapi.json`.

It states what the gateway itself checks (see `gateway/openai.py`; the other endpoint kinds'
operations are in `gateway/openapi_kinds.py`), not all of the OpenAI API: any other field passes
through to the replica untouched. `passthrough:` paths depend on the config and are not listed. Admin and debug routes are left out on
purpose. Fuzzers (schemathesis, `tests/chaos/test_fuzz_openapi.py`) run against this document.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gateway.api.openai import MAX_DEPTH, MAX_TOKEN_ID, MAX_TOKENS_CAP
from gateway.http.openapi_kinds import kind_paths, request_schemas, response_id_paths
from gateway.version import gateway_version

__all__ = ["openapi_document"]

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
