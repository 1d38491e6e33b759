"""One error tree for everything a client can see, and one mapping to (status, OpenAI body, headers).

    GatewayError                      500 server_error            internal_error
    ├── BadRequest                    400 invalid_request_error   (per error: invalid_json, ...)
    ├── Unauthorized                  401 authentication_error    invalid_api_key
    ├── Forbidden                     403 permission_error
    ├── NotFound                      404 not_found_error         (model_not_found, unknown_url)
    ├── MethodNotAllowed              405 invalid_request_error   method_not_allowed
    ├── RequestTimeout                408 invalid_request_error   request_timeout
    ├── PayloadTooLarge               413 invalid_request_error   request_too_large
    ├── HeadersTooLarge               431 invalid_request_error   request_header_fields_too_large
    ├── ConfigRejected                422 invalid_request_error   invalid_config (admin reload)
    ├── RateLimited                   429 rate_limit_error        rate_limit_exceeded (Retry-After)
    │   └── RequestExceedsLimit       429 rate_limit_error        request_exceeds_limit (none)
    ├── Shed                          429 rate_limit_error | 503 service_unavailable_error  overloaded
    ├── ServerBusy                    503 service_unavailable_error  server_busy (Retry-After)
    └── UpstreamError                 502 server_error            bad_gateway
        ├── NoReplicaAvailable        503 service_unavailable_error  no_replica_available (Retry-After)
        └── UpstreamTimeout           504 timeout_error           upstream_timeout

`ERROR_TYPES` is the whole vocabulary (OpenAI's `type` strings): a replica's error gets the type
of its status (`type_for_status`) and a string code (`code_for_status` unless it sent one), so a
client sees one vocabulary whoever answered. Handlers raise these; `error_payload` (and
`error_body`, `sse_error_event` on it) is the only place that turns one into a body.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

# the `type` of every error body a client gets, gateway's or replica's (docs/operations.md, Errors)
ERROR_TYPES = (
    "invalid_request_error",  # 400 and any other 4xx not below
    "authentication_error",  # 401
    "permission_error",  # 403
    "not_found_error",  # 404
    "rate_limit_error",  # 429
    "server_error",  # 500, 502 and any other 5xx not below
    "service_unavailable_error",  # 503
    "timeout_error",  # 504 (and a stream that stalled mid-way)
)
_TYPE_OF_STATUS = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}
_CODE_OF_STATUS = {
    400: "bad_request",
    401: "invalid_api_key",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    409: "conflict",
    413: "request_too_large",
    422: "unprocessable_entity",
    431: "request_header_fields_too_large",
    429: "rate_limit_exceeded",
    500: "internal_error",
    501: "not_implemented",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "upstream_timeout",
}


def type_for_status(status: int) -> str:
    """The OpenAI error type of an HTTP error status."""
    t = _TYPE_OF_STATUS.get(status)
    if t is not None:
        return t
    return "server_error" if status >= 500 else "invalid_request_error"


def code_for_status(status: int) -> str:
    """A string code for an error status that came without one (`http_<status>` for the rare)."""
    return _CODE_OF_STATUS.get(status) or f"http_{status}"


class GatewayError(Exception):
    status = 500
    type = "server_error"
    code: str | None = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.retry_after = retry_after
        self.extra_headers = dict(headers or {})

    def headers(self) -> dict[str, str]:
        h = dict(self.extra_headers)
        if self.retry_after is not None:
            h["retry-after"] = str(max(1, int(self.retry_after + 0.999)))
        return h


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "bad_request"


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(GatewayError):
    status = 403
    type = "permission_error"
    code = "permission_denied"


class NotFound(GatewayError):
    status = 404
    type = "not_found_error"
    code = "not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class RequestTimeout(GatewayError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class HeadersTooLarge(GatewayError):
    """The request line and headers passed the server's caps (gateway/transport/protocol.py)."""

    status = 431
    type = "invalid_request_error"
    code = "request_header_fields_too_large"


class ConfigRejected(GatewayError):
    """A reload that changed nothing: the file is invalid, or valid but could not be applied."""

    status = 422
    type = "invalid_request_error"
    code = "invalid_config"


class RateLimited(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class RequestExceedsLimit(RateLimited):
    """One request asks for more than a bucket can ever hold (max_tokens above tokens_per_minute)."""

    code = "request_exceeds_limit"


class Shed(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "overloaded"

    def __init__(self, message: str, *, status: int = 429, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.status = status
        self.type = type_for_status(status)


class ServerBusy(GatewayError):
    """The gateway itself is full (request slots, or bytes of request bodies held), not a pool."""

    status = 503
    type = "service_unavailable_error"
    code = "server_busy"


class UpstreamError(GatewayError):
    status = 502
    type = "server_error"
    code = "bad_gateway"


class NoReplicaAvailable(UpstreamError):
    status = 503
    type = "service_unavailable_error"
    code = "no_replica_available"


class UpstreamTimeout(UpstreamError):
    status = 504
    type = "timeout_error"
    code = "upstream_timeout"


def error_payload(exc: GatewayError) -> dict[str, Any]:
    return {
        "error": {
            "message": exc.message,
            "type": exc.type,
            "param": exc.param,
            "code": exc.code,
        }
    }


def error_body(exc: GatewayError) -> bytes:
    return orjson.dumps(error_payload(exc))


def sse_error_event(exc: GatewayError) -> bytes:
    """The event that ends a stream which broke after bytes reached the client."""
    return b"data: " + error_body(exc) + b"\n\n"
