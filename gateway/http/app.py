"""`create_app(config)`: the ASGI application, built explicitly from its parts.

The proxied paths (every endpoint kind, `gateway/api/kinds.py`, and the operator's `passthrough:`
paths) are dispatched by a dict lookup in front of Starlette, so the hot path carries no framework
middleware; everything else (health, metrics, models, admin) is plain Starlette.

Admin routes (`/admin/*`, `/debug/*`) need `Authorization: Bearer <server.admin_key>`; with no key
configured they are off and answer 404. `/dashboard` is a static page holding no data, served either
way: it reads the key from its URL fragment and fetches `/admin/status` with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import hmac
import importlib.resources
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.api.kinds import PATHS, passthrough_kind
from gateway.config import Config
from gateway.errors import (
    ConfigRejected,
    GatewayError,
    MethodNotAllowed,
    NotFound,
    ServerBusy,
    Unauthorized,
    error_payload,
)
from gateway.fleet.shared_load import ready_fields
from gateway.http.endpoint import ProxyEndpoint, send_error
from gateway.http.openapi import openapi_document
from gateway.http.status import status_of
from gateway.limits.budgets import BUSY_RETRY_S, BodyBudget
from gateway.pipeline.by_id import KINDS as BY_ID
from gateway.pipeline.by_id import PREFIX as RESPONSE_IDS
from gateway.pipeline.by_id import by_id, response_route
from gateway.pipeline.steps import Pipeline
from gateway.runtime.gateway import Gateway
from gateway.runtime.reload import ConfigReloader
from gateway.telemetry.tracing import Tracing
from gateway.transport.control import model_cards
from gateway.transport.writer import ResponseWriter
from gateway.types import Receive, Scope, Send
from gateway.version import gateway_version

Handler = Callable[[Request], Awaitable[Response]]

# the page fetches only its own origin and runs only its one inline script
_PAGE_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'unsafe-inline'; "
    "style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'",
    "cache-control": "no-store",
    "referrer-policy": "no-referrer",
    "x-content-type-options": "nosniff",
}


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data), status, headers=headers, media_type="application/json")


def _error(exc: GatewayError) -> Response:
    return _json(error_payload(exc), exc.status, exc.headers())


def admin_only(gateway: Gateway, handler: Handler) -> Handler:
    """Guard an admin route: Bearer `server.admin_key` (constant-time compare), 404 when no key.

    The key is read per request, so a reloaded config's key applies at once.
    """

    async def guarded(request: Request) -> Response:
        key = gateway.config.server.admin_key
        expected = key.get_secret_value().encode() if key is not None else None
        if expected is None:  # admin routes are off unless a key is configured
            return _error(NotFound(f"Unknown path {request.url.path}", code="unknown_url"))
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode("latin-1") if scheme.lower() == "bearer" else b""
        if not given or not hmac.compare_digest(given, expected):  # an empty key opens nothing
            return _error(
                Unauthorized(
                    "This admin route needs `Authorization: Bearer <server.admin_key>`.",
                    headers={"www-authenticate": "Bearer"},
                )
            )
        return await handler(request)

    return guarded


def tenants_only(gateway: Gateway, handler: Handler) -> Handler:
    """Guard a read-only public route (`/v1/models`): under `auth: required` it needs a tenant's
    key, as the proxy routes do (401 otherwise); with auth off it is open. The tenant directory is
    read per request, so a reload applies at once."""

    async def guarded(request: Request) -> Response:
        given = next((v for k, v in request.scope["headers"] if k == b"authorization"), None)
        try:
            gateway.tenants.identify(given)
        except GatewayError as exc:
            return _error(exc)
        return await handler(request)

    return guarded


# answered even when every request slot is taken: probes must tell "busy" from "dead"
UNLIMITED_PATHS = frozenset({"/health", "/ready", "/metrics"})


class GatewayApp:
    """The ASGI callable: proxy paths straight to their endpoint, the rest to Starlette.

    It also holds the request slots (`server.max_connections`, read per request so a reload
    applies at once): a request beyond them gets an OpenAI-shaped 503 with Retry-After before
    its body is read; UNLIMITED_PATHS take no slot.
    """

    def __init__(self, gateway: Gateway, rest: Starlette) -> None:
        self.gateway = gateway
        self.rest = rest
        self.inflight = 0  # requests holding a slot
        self.bodies = BodyBudget()
        self.pipeline = pipeline = Pipeline(gateway)
        self._proxy = {path: ProxyEndpoint(pipeline, kind, self.bodies) for path, kind in PATHS.items()}
        self._passthrough: dict[tuple[str, str], ProxyEndpoint] = {}
        run = functools.partial(by_id, pipeline)  # /v1/responses/{id}: to the response's replica
        self._by_id = {
            name: ProxyEndpoint(pipeline, kind, self.bodies, run) for name, kind in BY_ID.items()
        }

    def passthrough(self, scope: Scope) -> ProxyEndpoint | None:
        """The endpoint of a `passthrough:` path (GET or POST), read per request (reloads)."""
        method, path = scope["method"], scope["path"]
        if method not in ("GET", "POST") or path not in self.gateway.config.passthrough:
            return None
        endpoint = self._passthrough.get((method, path))
        if endpoint is None:
            kind = passthrough_kind(method.encode(), path)
            endpoint = self._passthrough[method, path] = ProxyEndpoint(self.pipeline, kind, self.bodies)
        return endpoint

    def begin_shutdown(self, grace_s: float) -> None:
        """The server's graceful shutdown began (gateway/transport/protocol.py): end streams in time."""
        self.gateway.live_streams.close_in(grace_s)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNLIMITED_PATHS:
            await self.rest(scope, receive, send)
            return
        endpoint = self._proxy.get(scope["path"]) if scope["method"] == "POST" else None
        if endpoint is None:
            path = scope["path"]
            if path.startswith(RESPONSE_IDS):
                endpoint = self._by_id.get(response_route(scope["method"], path) or "")
            elif self.gateway.config.passthrough:
                endpoint = self.passthrough(scope)
        slots = self.gateway.config.server.max_connections
        if slots is not None and self.inflight >= slots:
            busy = ServerBusy(
                f"The gateway is serving its limit of {slots} requests; retry shortly",
                code="max_connections",
                retry_after=BUSY_RETRY_S,
            )
            if endpoint is not None:
                await endpoint.refuse(send, busy)
            else:
                await send_error(ResponseWriter(send), busy, close=True)
            return
        self.inflight += 1
        try:
            if endpoint is not None:
                await endpoint(scope, receive, send)
            else:
                await self.rest(scope, receive, send)
        finally:
            self.inflight -= 1


class _ModelList:
    """`/v1/models` merged from the replicas, cached for a few seconds."""

    def __init__(self, gateway: Gateway, ttl_s: float = 5.0) -> None:
        self.gw = gateway
        self.ttl_s = ttl_s
        self._at = 0.0
        self._data: list[dict[str, Any]] = []
        self._lock = asyncio.Lock()

    async def get(self) -> list[dict[str, Any]]:
        async with self._lock:
            if time.monotonic() - self._at > self.ttl_s:
                self._data = await self._fetch()
                self._at = time.monotonic()
            return self._data

    async def _fetch(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        replicas = [r for r in self.gw.all_replicas() if r.available(now)]

        async def one(url: str) -> list[dict[str, Any]]:
            return await model_cards(self.gw.session, url, timeout_s=2.0) or []

        merged: dict[str, dict[str, Any]] = {}
        for cards in await asyncio.gather(*(one(r.url) for r in replicas)):
            for card in cards:
                merged.setdefault(card["id"], card)
        return [merged[k] for k in sorted(merged)]


GC_GEN0_THRESHOLD = 20_000  # allocations between young collections (CPython's default: 700)


def settle_garbage_collector() -> None:
    """Once started: what exists now (config, pools, index, modules) lives as long as the process,
    so the collector stops scanning it (`gc.freeze`), and young collections run less often. A
    request allocates a few hundred short-lived objects, almost all freed by reference counting;
    with the default threshold a young collection ran every couple of requests."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


def create_app(
    config: Config,
    *,
    tracing: Tracing | None = None,
    config_path: str | None = None,
    own_process: bool = False,
) -> GatewayApp:
    """The ASGI app. With `config_path`, the file is watched and SIGHUP reloads it (hot reload).
    `own_process`: the gateway is the process's only app (`gateway serve`): it tunes the garbage
    collector once started (`settle_garbage_collector`)."""
    gateway = Gateway(config, tracing=tracing)
    reloader = ConfigReloader(gateway, config_path) if config_path else None
    models = _ModelList(gateway)
    page = (importlib.resources.files("gateway") / "static" / "dashboard.html").read_bytes()

    async def health(request: Request) -> Response:
        return _json({"status": "ok"})

    async def ready(request: Request) -> Response:
        now = time.monotonic()
        pools = {  # proven replicas: circuit closed; a half-open one is on trial, not counted;
            # a P/D pool counts its weaker set (with either set down it serves nothing)
            name: min(sum(1 for r in part.replicas if r.proven(now)) for part in pool.parts())
            for name, pool in gateway.pools.items()
        }
        ok = all(n > 0 for n in pools.values())
        body = {"status": "ready" if ok else "not_ready", "available_replicas": pools,
                **ready_fields(gateway.fleet, gateway.index)}  # fmt: skip
        return _json(body, 200 if ok else 503)  # Redis down is fail-open: not a 503

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def list_models(request: Request) -> Response:
        return _json({"object": "list", "data": await models.get()})

    async def model_card(request: Request) -> Response:
        wanted = request.path_params["model_id"]
        card = next((c for c in await models.get() if c["id"] == wanted), None)
        if card is None:
            message = f"The model `{wanted[:128]}` does not exist."
            return _error(NotFound(message, param="model", code="model_not_found"))
        return _json(card)

    version_body = {"version": gateway_version()}

    async def version(request: Request) -> Response:
        return _json(version_body)

    async def decisions(request: Request) -> Response:
        return _json({"decisions": gateway.decisions()})

    async def status(request: Request) -> Response:
        return _json(status_of(gateway, gateway.window))

    async def active_config(request: Request) -> Response:
        version = reloader.version() if reloader is not None else {"source": None, "reloads": 0}
        return _json({"version": version, "config": gateway.config.redacted()})

    async def reload_now(request: Request) -> Response:
        if reloader is None:
            return _error(
                NotFound("This gateway was not started from a config file", code="no_config_file")
            )
        if await reloader.reload("admin request"):
            return _json({"applied": True, "version": reloader.version()})
        version = reloader.version()
        exc = ConfigRejected(
            version["last_error"] or "reload failed", code=reloader.last_error_code
        )
        return _json({**error_payload(exc), "applied": False, "version": version}, exc.status)

    async def drain_replica(request: Request) -> Response:
        """Cordon a replica (`drain`): no new requests, its live streams handed over to others
        (docs/resume.md); `undrain` takes it back."""
        name, action = request.path_params["name"], request.path_params["action"]
        found = [r for r in gateway.all_replicas() if r.name == name]
        if not found or action not in ("drain", "undrain"):
            return _error(NotFound(f"Unknown path {request.url.path}", code="unknown_url"))
        handed = 0
        for r in found:
            r.draining = r.cordoned = action == "drain"
            if r.draining:
                handed += r.hand_over()
            gateway.notify_capacity(r.pool)
        return _json({"replica": name, "draining": action == "drain", "handed_over": handed})

    async def openapi_json(request: Request) -> Response:
        return _json(openapi_document(gateway.config.priority_classes))  # classes follow reloads

    async def dashboard(request: Request) -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 405:
            allow = (exc.headers or {}).get("Allow")
            return _error(
                MethodNotAllowed(
                    f"Method {request.method} is not allowed on {request.url.path}",
                    headers={"allow": allow} if allow else None,
                )
            )
        if exc.status_code == 404:
            return _error(NotFound(f"Unknown path {request.url.path}", code="unknown_url"))
        return _error(GatewayError(str(exc.detail)))

    async def server_error(request: Request, exc: Exception) -> Response:
        """A route failed: the OpenAI-shaped 500 (Starlette then raises it on, to be logged)."""
        return _error(GatewayError("Internal gateway error"))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.start()
        if reloader is not None:
            reloader.start()
        if own_process:
            settle_garbage_collector()
        try:
            yield
        finally:
            if reloader is not None:
                await reloader.stop()
            await gateway.stop()

    rest = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/ready", ready, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/v1/models", tenants_only(gateway, list_models), methods=["GET"]),
            Route("/v1/models/{model_id:path}", tenants_only(gateway, model_card), methods=["GET"]),
            Route("/version", version, methods=["GET"]),
            Route("/debug/decisions", admin_only(gateway, decisions), methods=["GET"]),
            Route("/admin/status", admin_only(gateway, status), methods=["GET"]),
            Route("/admin/config", admin_only(gateway, active_config), methods=["GET"]),
            Route("/admin/reload", admin_only(gateway, reload_now), methods=["POST"]),
            Route("/admin/replicas/{name}/{action}", admin_only(gateway, drain_replica),
                  methods=["POST"]),  # fmt: skip
            Route("/dashboard", dashboard, methods=["GET"]),
            Route("/openapi.json", openapi_json, methods=["GET"]),
            # served by GatewayApp; here so that another method gets a 405
            *(Route(path, health, methods=["POST"]) for path in PATHS),
            Route(RESPONSE_IDS + "{response_id}", health, methods=["GET", "DELETE"]),
            Route(RESPONSE_IDS + "{response_id}/cancel", health, methods=["POST"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: server_error},
        lifespan=lifespan,
    )
    rest.router.redirect_slashes = False  # a redirect would echo the client's Host header
    rest.state.gateway = gateway
    return GatewayApp(gateway, rest)
