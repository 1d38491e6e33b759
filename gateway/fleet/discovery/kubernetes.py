"""Replicas behind a Kubernetes Service (`{kind: kubernetes, service: ...}`): its EndpointSlices,
listed then watched through the API server (httpx; in-cluster credentials by default)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from gateway.fleet.discovery.base import (
    DiscoveryError,
    Endpoint,
    describe,
    endpoint,
    log,
    settled,
    warn_outage,
)
from gateway.transport.control import open_api_client

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
_SLICES_PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
_MAX_BACKOFF_S = 30.0
_CONNECT_S = 10.0
_LIST_S = 30.0  # a whole list request


class _Gone(Exception):
    """410: the resourceVersion is too old to watch from; list again."""


class _ApiError(Exception):
    pass


# unreachable API, bad status, malformed JSON or object: keep the last set, back off, list again
_RETRIED = (httpx.HTTPError, OSError, TimeoutError, _ApiError, ValueError, LookupError)


async def _json_lines(resp: httpx.Response) -> AsyncGenerator[dict[str, Any], None]:
    """The watch stream's events: one JSON object a line, lines split across chunks at will."""
    buf = b""
    async for chunk in resp.aiter_bytes():
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.strip():
                yield orjson.loads(line)
    if buf.strip():
        yield orjson.loads(buf)


@dataclass(frozen=True, slots=True)
class _Api:
    url: str  # the namespace's endpointslices collection
    token_path: Path | None
    ssl: ssl.SSLContext  # the API server's CA (the system's trust store unless ca_path is set)

    async def headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self.token_path is not None:
            # read on every (re)connect: the kubelet rotates projected tokens in place
            token = await asyncio.to_thread(self.token_path.read_text, encoding="utf-8")
            headers["Authorization"] = f"Bearer {token.strip()}"
        return headers


@dataclass(eq=False)  # one watcher is one object
class KubernetesDiscovery:
    """List, then watch, the `discovery.k8s.io/v1` EndpointSlices of one Service.

    Only ready endpoints count (`conditions.ready` not false, `serving` not false, `terminating`
    not true; unset conditions read as the API documents them), with the slice port named
    `port_name` (the only port when unset). Watches resume from the last resourceVersion or
    bookmark; a 410 Gone lists again; other errors list again after a backoff, keep the last set
    and are logged once per outage. Without `api_url`, the in-cluster API server, service account
    token and CA are used; without `namespace`, the pod's own namespace.
    """

    service: str
    namespace: str | None = None
    _: KW_ONLY
    port_name: str | None = None
    label_selector: str | None = None  # ANDed with kubernetes.io/service-name=<service>
    api_url: str | None = None
    token_path: str | None = None
    ca_path: str | None = None
    scheme: str = "http"
    retry_s: float = 2.0
    watch_timeout_s: int = 300
    _warned: set[str] = field(default_factory=set, init=False, repr=False)

    @property
    def selector(self) -> str:
        """The EndpointSlices' label selector: the Service's, and `label_selector`'s."""
        extra = f",{self.label_selector}" if self.label_selector else ""
        return f"kubernetes.io/service-name={self.service}{extra}"

    def _access(self) -> _Api:
        """Where the API is and how to authenticate (reads files: run it in a thread)."""
        token_path, ca_path = self.token_path, self.ca_path
        if self.api_url:
            base = self.api_url.rstrip("/")
        else:
            host = os.environ.get("KUBERNETES_SERVICE_HOST")
            port = os.environ.get("KUBERNETES_SERVICE_PORT")
            if not host or not port:
                raise DiscoveryError(
                    f"kubernetes discovery of {self.service!r}: not running in a cluster "
                    "(KUBERNETES_SERVICE_HOST/PORT unset); set api_url"
                )
            base = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
            token_path = token_path or str(SERVICE_ACCOUNT_DIR / "token")
            ca_path = ca_path or str(SERVICE_ACCOUNT_DIR / "ca.crt")
        namespace = self.namespace
        if not namespace:
            try:
                namespace = (SERVICE_ACCOUNT_DIR / "namespace").read_text(encoding="utf-8").strip()
            except OSError:
                raise DiscoveryError(
                    f"kubernetes discovery of {self.service!r}: no namespace set and "
                    f"{SERVICE_ACCOUNT_DIR / 'namespace'} is unreadable"
                ) from None
        try:
            context = ssl.create_default_context(cafile=ca_path)  # None: the system's store
        except OSError as exc:
            raise DiscoveryError(f"kubernetes discovery: cannot read CA {ca_path}: {exc}") from None
        return _Api(
            base + _SLICES_PATH.format(namespace=namespace),
            Path(token_path) if token_path else None,
            context,
        )

    async def watch(self) -> AsyncGenerator[list[Endpoint], None]:
        api = await asyncio.to_thread(self._access)
        slices: dict[str, list[Endpoint]] = {}
        last: list[Endpoint] | None = None
        rv: str | None = None  # None: list before watching
        failures = 0  # consecutive, for the backoff; the outage is logged at the first
        async with open_api_client(_CONNECT_S, verify=api.ssl) as client:
            while True:
                try:
                    if rv is None:
                        rv, slices = await self._list(client, api)
                    else:
                        started, events = time.monotonic(), 0
                        async with self._watch(client, api, rv) as resp:
                            if failures:
                                log.info("kubernetes discovery %s: watching again", self.service)
                                failures = 0
                            async with contextlib.aclosing(_json_lines(resp)) as stream:
                                async for event in stream:
                                    events += 1
                                    rv = self._apply(event, slices)
                                    current = settled(e for eps in slices.values() for e in eps)
                                    if current != last:
                                        last = current
                                        yield current
                        if not events and time.monotonic() - started < 1.0:
                            # a watch that closes at once must not become a busy loop
                            await asyncio.sleep(self.retry_s)
                        continue  # the server ended the watch (timeoutSeconds): resume from rv
                except _Gone:
                    log.info("kubernetes discovery %s: watch expired (410), listing", self.service)
                    rv = None
                    continue
                except _RETRIED as exc:
                    failures += 1
                    if failures == 1:
                        warn_outage(f"kubernetes discovery {self.service}", describe(exc), last)
                    rv = None
                    await asyncio.sleep(min(self.retry_s * 2 ** (failures - 1), _MAX_BACKOFF_S))
                    continue
                current = settled(e for eps in slices.values() for e in eps)
                if current != last:
                    last = current
                    yield current

    async def _list(
        self, client: httpx.AsyncClient, api: _Api
    ) -> tuple[str, dict[str, list[Endpoint]]]:
        async with asyncio.timeout(_LIST_S):
            resp = await client.get(
                api.url,
                params={"labelSelector": self.selector},
                headers=await api.headers(),
                timeout=_LIST_S,
            )
        body = resp.content
        if resp.status_code != 200:
            raise _ApiError(f"list: HTTP {resp.status_code} {body[:200].decode(errors='replace')}")
        data = orjson.loads(body)
        slices = {item["metadata"]["name"]: self._ready(item) for item in data.get("items") or ()}
        return str(data["metadata"]["resourceVersion"]), slices

    @contextlib.asynccontextmanager
    async def _watch(
        self, client: httpx.AsyncClient, api: _Api, rv: str
    ) -> AsyncIterator[httpx.Response]:
        """The open watch stream from `rv`; 410 raises `_Gone`, any other non-200 `_ApiError`."""
        params = {
            "labelSelector": self.selector,
            "watch": "true",
            "resourceVersion": rv,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self.watch_timeout_s),
        }
        # no bound on the whole stream; the server ends it after timeoutSeconds, and a read that
        # waits past that (plus slack) means the connection is gone
        timeout = httpx.Timeout(None, connect=_CONNECT_S, read=self.watch_timeout_s + 30)
        async with client.stream(
            "GET", api.url, params=params, headers=await api.headers(), timeout=timeout
        ) as resp:
            if resp.status_code == 410:
                raise _Gone()
            if resp.status_code != 200:
                body = await resp.aread()
                raise _ApiError(
                    f"watch: HTTP {resp.status_code} {body[:200].decode(errors='replace')}"
                )
            yield resp

    def _apply(self, event: dict[str, Any], slices: dict[str, list[Endpoint]]) -> str:
        """Fold one watch event into `slices`; return the resourceVersion to resume from."""
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Gone()
            raise _ApiError(f"watch: {obj.get('code')} {obj.get('reason')}: {obj.get('message')}")
        rv = str(obj["metadata"]["resourceVersion"])
        if kind == "BOOKMARK":
            return rv
        name = obj["metadata"]["name"]
        if kind == "DELETED":
            slices.pop(name, None)
        elif kind in ("ADDED", "MODIFIED"):
            slices[name] = self._ready(obj)
        else:
            raise _ApiError(f"watch: unknown event type {kind!r}")
        return rv

    def _ready(self, eps: dict[str, Any]) -> list[Endpoint]:
        """The ready endpoints of one EndpointSlice, at the chosen port."""
        port = self._port(eps)
        if port is None:
            return []
        out = []
        for ep in eps.get("endpoints") or ():
            cond = ep.get("conditions") or {}
            if (
                cond.get("ready") is False
                or cond.get("serving") is False
                or cond.get("terminating") is True
            ):
                continue
            addresses = ep.get("addresses") or ()
            if addresses:  # the API defines no meaning for any address past the first
                out.append(endpoint(self.scheme, addresses[0], port))
        return out

    def _port(self, eps: dict[str, Any]) -> int | None:
        ports = [
            p for p in eps.get("ports") or () if p.get("port") and p.get("protocol", "TCP") == "TCP"
        ]
        if self.port_name is not None:
            ports = [p for p in ports if p.get("name") == self.port_name]
        if len(ports) == 1:
            return int(ports[0]["port"])
        name = eps.get("metadata", {}).get("name", "?")
        if name not in self._warned:
            self._warned.add(name)
            want = f"a port named {self.port_name!r}" if self.port_name else "exactly one TCP port"
            log.warning(
                "kubernetes discovery %s: EndpointSlice %s lacks %s (set port_name); skipped",
                self.service,
                name,
                want,
            )
        return None
