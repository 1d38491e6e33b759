"""Where a pool's replicas are: a fixed list, a DNS name, or a Kubernetes Service's EndpointSlices.

A `Discovery` yields the pool's whole current endpoint set, first once known, then on every change;
errors keep the last set. Imports nothing from the gateway, so `config.py` can import it.

```yaml
pools:
  chat:
    discovery: {kind: dns, name: vllm-headless.llm.svc, port: 8000}
    # or {kind: kubernetes, service: vllm, port_name: http}
    # or {kind: static, endpoints: [http://10.0.0.11:8000]}
```
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import ssl
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol
from urllib.parse import urlsplit

import aiohttp
import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator

log = logging.getLogger("gateway.discovery")

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
_SLICES_PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
_MAX_BACKOFF_S = 30.0

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
"""`(host, port) -> addresses`; raises on failure (an `OSError` such as `socket.gaierror`)."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    url: str  # scheme://host:port
    name: str  # host:port ([v6]:port), unique within a pool's set


class DiscoveryError(Exception):
    """Discovery cannot work at all (no cluster and no api_url, no namespace); not retried."""


class Discovery(Protocol):
    def watch(self) -> AsyncGenerator[list[Endpoint], None]:
        """Yield the full current set, sorted by name, once known and then after each change.

        Runs until the consumer stops iterating (close it with `contextlib.aclosing`). A failed
        lookup never yields: the last set stands until a lookup succeeds again.
        """
        ...


def endpoint(scheme: str, host: str, port: int) -> Endpoint:
    """`Endpoint` for an address or host name; IPv6 addresses are bracketed in url and name."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        hostport = f"{host}:{port}"
    else:
        hostport = f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
    return Endpoint(f"{scheme}://{hostport}", hostport)


def _settled(endpoints: Iterable[Endpoint]) -> list[Endpoint]:
    """One endpoint per name, sorted by name: the canonical form sets are compared in."""
    return sorted({e.name: e for e in endpoints}.values(), key=lambda e: e.name)


class StaticDiscovery:
    def __init__(self, endpoints: Iterable[Endpoint]) -> None:
        self.endpoints = _settled(endpoints)

    async def watch(self) -> AsyncGenerator[list[Endpoint], None]:
        yield list(self.endpoints)
        await asyncio.Event().wait()  # a fixed list never changes; wait to be closed


async def getaddrinfo_resolver(host: str, port: int) -> list[str]:
    """A and AAAA answers through the system resolver (the loop's thread pool)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


class DnsDiscovery:
    """Resolve `name` every `interval_s`; each address becomes `scheme://address:port`.

    Fits a headless Service or any name with one record per replica. A failed resolution keeps the
    last set and is logged once per outage.
    """

    def __init__(
        self,
        name: str,
        port: int,
        scheme: str = "http",
        interval_s: float = 5.0,
        resolver: Resolver | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        self.name = name
        self.port = port
        self.scheme = scheme
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.resolver: Resolver = resolver or getaddrinfo_resolver

    async def watch(self) -> AsyncGenerator[list[Endpoint], None]:
        last: list[Endpoint] | None = None
        failing = False
        while True:
            try:
                async with asyncio.timeout(self.timeout_s):
                    addresses = await self.resolver(self.name, self.port)
            except Exception as exc:  # any resolver failure: keep serving the last set
                if not failing:
                    log.warning(
                        "dns discovery %s: resolution failed (%s); keeping the last %s endpoints",
                        self.name,
                        exc or type(exc).__name__,
                        "no" if last is None else len(last),
                    )
                    failing = True
            else:
                if failing:
                    log.info("dns discovery %s: resolving again", self.name)
                    failing = False
                current = _settled(endpoint(self.scheme, a, self.port) for a in addresses)
                if current != last:
                    last = current
                    yield current
            await asyncio.sleep(self.interval_s)


class _Gone(Exception):
    """410: the resourceVersion is too old to watch from; list again."""


class _ApiError(Exception):
    pass


# unreachable API, bad status, malformed JSON or object: keep the last set, back off, list again
_RETRIED = (aiohttp.ClientError, TimeoutError, _ApiError, ValueError, LookupError)


async def _json_lines(resp: aiohttp.ClientResponse) -> AsyncGenerator[dict[str, Any], None]:
    """The watch stream's events: one JSON object a line, lines split across chunks at will."""
    buf = b""
    async for chunk in resp.content.iter_any():
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
    ssl: ssl.SSLContext | bool

    async def headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self.token_path is not None:
            # read on every (re)connect: the kubelet rotates projected tokens in place
            token = await asyncio.to_thread(self.token_path.read_text, encoding="utf-8")
            headers["Authorization"] = f"Bearer {token.strip()}"
        return headers


class KubernetesDiscovery:
    """List, then watch, the `discovery.k8s.io/v1` EndpointSlices of one Service.

    Only ready endpoints count (`conditions.ready` not false, `serving` not false, `terminating`
    not true; unset conditions read as the API documents them), with the slice port named
    `port_name` (the only port when unset). Watches resume from the last resourceVersion or
    bookmark; a 410 Gone lists again; other errors list again after a backoff, keep the last set
    and are logged once per outage. Without `api_url`, the in-cluster API server, service account
    token and CA are used; without `namespace`, the pod's own namespace.
    """

    def __init__(
        self,
        service: str,
        namespace: str | None = None,
        *,
        port_name: str | None = None,
        label_selector: str | None = None,
        api_url: str | None = None,
        token_path: str | None = None,
        ca_path: str | None = None,
        scheme: str = "http",
        retry_s: float = 2.0,
        watch_timeout_s: int = 300,
    ) -> None:
        self.service = service
        self.namespace = namespace
        self.port_name = port_name
        self.selector = f"kubernetes.io/service-name={service}" + (
            f",{label_selector}" if label_selector else ""
        )
        self.api_url = api_url
        self.token_path = token_path
        self.ca_path = ca_path
        self.scheme = scheme
        self.retry_s = retry_s
        self.watch_timeout_s = watch_timeout_s
        self._warned: set[str] = set()

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
            context: ssl.SSLContext | bool = (
                ssl.create_default_context(cafile=ca_path) if ca_path else True
            )
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
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                try:
                    if rv is None:
                        rv, slices = await self._list(session, api)
                    else:
                        started, events = time.monotonic(), 0
                        async with self._watch(session, api, rv) as resp:
                            if failures:
                                log.info("kubernetes discovery %s: watching again", self.service)
                                failures = 0
                            async with contextlib.aclosing(_json_lines(resp)) as stream:
                                async for event in stream:
                                    events += 1
                                    rv = self._apply(event, slices)
                                    current = _settled(e for eps in slices.values() for e in eps)
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
                        log.warning(
                            "kubernetes discovery %s: %s; keeping the last %s endpoints",
                            self.service,
                            exc or type(exc).__name__,
                            "no" if last is None else len(last),
                        )
                    rv = None
                    await asyncio.sleep(min(self.retry_s * 2 ** (failures - 1), _MAX_BACKOFF_S))
                    continue
                current = _settled(e for eps in slices.values() for e in eps)
                if current != last:
                    last = current
                    yield current

    async def _list(
        self, session: aiohttp.ClientSession, api: _Api
    ) -> tuple[str, dict[str, list[Endpoint]]]:
        async with session.get(
            api.url,
            params={"labelSelector": self.selector},
            headers=await api.headers(),
            ssl=api.ssl,
            timeout=aiohttp.ClientTimeout(total=30),
        ) as resp:
            body = await resp.read()
            if resp.status != 200:
                raise _ApiError(f"list: HTTP {resp.status} {body[:200].decode(errors='replace')}")
        data = orjson.loads(body)
        slices = {item["metadata"]["name"]: self._ready(item) for item in data.get("items") or ()}
        return str(data["metadata"]["resourceVersion"]), slices

    @contextlib.asynccontextmanager
    async def _watch(
        self, session: aiohttp.ClientSession, api: _Api, rv: str
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """The open watch stream from `rv`; 410 raises `_Gone`, any other non-200 `_ApiError`."""
        params = {
            "labelSelector": self.selector,
            "watch": "true",
            "resourceVersion": rv,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self.watch_timeout_s),
        }
        async with session.get(
            api.url,
            params=params,
            headers=await api.headers(),
            ssl=api.ssl,
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=10, sock_read=self.watch_timeout_s + 30
            ),
        ) as resp:
            if resp.status == 410:
                raise _Gone()
            if resp.status != 200:
                body = await resp.read()
                raise _ApiError(f"watch: HTTP {resp.status} {body[:200].decode(errors='replace')}")
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


# --- configuration (`pools.<name>.discovery`) --------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StaticDiscoveryConfig(_Strict):
    kind: Literal["static"]
    endpoints: tuple[str, ...] = Field(min_length=1)  # http(s)://host:port; name is host:port

    @field_validator("endpoints")
    @classmethod
    def _urls(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for i, url in enumerate(v):
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname or not parts.port:
                raise ValueError(f"[{i}]: not an http(s)://host:port URL")
            if parts.path not in ("", "/") or parts.query or parts.fragment:
                raise ValueError(f"[{i}]: must be scheme://host:port with no path")
        return v

    def build(self) -> Discovery:
        found = []
        for url in self.endpoints:
            parts = urlsplit(url)
            assert parts.hostname is not None and parts.port is not None  # checked above
            found.append(endpoint(parts.scheme, parts.hostname, parts.port))
        return StaticDiscovery(found)


class DnsDiscoveryConfig(_Strict):
    kind: Literal["dns"]
    name: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)
    scheme: Literal["http", "https"] = "http"
    interval_s: float = Field(5.0, gt=0)
    timeout_s: float = Field(5.0, gt=0)

    def build(self) -> Discovery:
        return DnsDiscovery(
            self.name, self.port, self.scheme, self.interval_s, timeout_s=self.timeout_s
        )


class KubernetesDiscoveryConfig(_Strict):
    kind: Literal["kubernetes"]
    service: str = Field(pattern=r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
    namespace: str | None = Field(None, pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
    port_name: str | None = None  # unset: the slice's only TCP port
    label_selector: str | None = None  # ANDed with kubernetes.io/service-name=<service>
    api_url: str | None = None  # unset: in-cluster (KUBERNETES_SERVICE_HOST/PORT, SA token, CA)
    token_path: str | None = None
    ca_path: str | None = None
    scheme: Literal["http", "https"] = "http"  # of the replica URLs
    retry_s: float = Field(2.0, gt=0)  # first backoff after an API error (doubles, up to 30 s)
    watch_timeout_s: int = Field(300, ge=1)

    def build(self) -> Discovery:
        return KubernetesDiscovery(
            self.service,
            self.namespace,
            port_name=self.port_name,
            label_selector=self.label_selector,
            api_url=self.api_url,
            token_path=self.token_path,
            ca_path=self.ca_path,
            scheme=self.scheme,
            retry_s=self.retry_s,
            watch_timeout_s=self.watch_timeout_s,
        )


DiscoveryConfig = Annotated[
    StaticDiscoveryConfig | DnsDiscoveryConfig | KubernetesDiscoveryConfig,
    Field(discriminator="kind"),
]


def open_discovery(config: DiscoveryConfig) -> Discovery:
    return config.build()
