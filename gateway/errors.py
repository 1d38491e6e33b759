"""One error tree for everything a client can see, and one mapping to (status, OpenAI body, headers).

    GatewayError                      500 internal_error
    ├── BadRequest                    400 invalid_request_error
    ├── Unauthorized                  401 authentication_error
    ├── Forbidden                     403 permission_error
    ├── NotFound                      404 not_found_error (unknown model / path)
    ├── MethodNotAllowed              405 invalid_request_error
    ├── RequestTimeout                408 invalid_request_error (the body was not in by its deadline)
    ├── PayloadTooLarge               413 invalid_request_error
    ├── ConfigRejected                422 invalid_request_error   (admin reload: nothing changed)
    ├── RateLimited                   429 rate_limit_error        (Retry-After)
    │   └── RequestExceedsLimit       429 rate_limit_error        (none: it can never fit)
    ├── Shed                          429 | 503 overloaded_error  (Retry-After)
    ├── ServerBusy                    503 service_unavailable     (Retry-After: slots, bytes held, shutdown)
    └── UpstreamError                 502 upstream_error
        ├── NoReplicaAvailable        503 service_unavailable     (Retry-After)
        └── UpstreamTimeout           504 timeout_error

Handlers raise these; `error_body` and `error_response` are the only places that turn one into bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson


class GatewayError(Exception):
    status = 500
    type = "internal_error"
    code: str | None = None

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


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(GatewayError):
    status = 403
    type = "permission_error"


class NotFound(GatewayError):
    status = 404
    type = "not_found_error"


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
    type = "overloaded_error"
    code = "overloaded"

    def __init__(self, message: str, *, status: int = 429, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.status = status


class ServerBusy(GatewayError):
    """The gateway itself is full (request slots, or bytes of request bodies held), not a pool."""

    status = 503
    type = "service_unavailable"
    code = "server_busy"


class UpstreamError(GatewayError):
    status = 502
    type = "upstream_error"
    code = "bad_gateway"


class NoReplicaAvailable(UpstreamError):
    status = 503
    type = "service_unavailable"
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
