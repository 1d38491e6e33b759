"""Discovery: DNS with a scripted resolver, Kubernetes against a fake API server that speaks the
real EndpointSlice list + watch protocol (JSON lines, resourceVersions, bookmarks, 410 Gone)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import socket
import ssl
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from pydantic import TypeAdapter, ValidationError

from gateway.fleet.discovery import (
    SERVICE_ACCOUNT_DIR,
    DiscoveryConfig,
    DiscoveryError,
    DnsDiscovery,
    DnsDiscoveryConfig,
    Endpoint,
    KubernetesDiscovery,
    KubernetesDiscoveryConfig,
    StaticDiscovery,
    StaticDiscoveryConfig,
    endpoint,
    open_discovery,
)
from tests.support import poll_until

STEP_S = 5.0  # the longest any single expected change may take


def names(eps: list[Endpoint]) -> list[str]:
    return [e.name for e in eps]


async def next_set(it: AsyncIterator[list[Endpoint]]) -> list[str]:
    async with asyncio.timeout(STEP_S):
        return names(await anext(it))


# --- static and DNS ---------------------------------------------------------------------------


async def test_static_yields_once_sorted_and_deduplicated() -> None:
    d = StaticDiscovery([endpoint("http", "10.0.0.2", 80), endpoint("http", "10.0.0.1", 80)] * 2)
    async with contextlib.aclosing(d.watch()) as it:
        assert await next_set(it) == ["10.0.0.1:80", "10.0.0.2:80"]
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await anext(it)


class ScriptedResolver:
    """Answers from a script, one entry a call; the last entry repeats. Exceptions are raised."""

    def __init__(self, script: Sequence[list[str] | Exception]) -> None:
        self.script = list(script)
        self.calls = 0

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls += 1
        answer = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


async def test_dns_adds_removes_and_keeps_the_last_set_on_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fail = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
    resolver = ScriptedResolver(
        [
            fail,  # before any answer: nothing to yield
            ["10.0.0.1"],
            ["10.0.0.1"],  # unchanged: no yield
            ["10.0.0.2", "10.0.0.1", "10.0.0.2"],  # added (duplicates collapse)
            fail,
            fail,
            fail,  # errors keep the last set, logged once
            ["10.0.0.2"],  # removed
            ["fd00::7", "10.0.0.2"],
        ]
    )
    d = DnsDiscovery("vllm.test", 8000, interval_s=0.001, resolver=resolver)
    with caplog.at_level(logging.INFO, logger="gateway.discovery"):
        async with contextlib.aclosing(d.watch()) as it:
            assert await next_set(it) == ["10.0.0.1:8000"]
            assert await next_set(it) == ["10.0.0.1:8000", "10.0.0.2:8000"]
            assert await next_set(it) == ["10.0.0.2:8000"]
            last = await anext(it)
    assert [(e.name, e.url) for e in last] == [
        ("10.0.0.2:8000", "http://10.0.0.2:8000"),
        ("[fd00::7]:8000", "http://[fd00::7]:8000"),
    ]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, "one warning per outage (two outages)"
    assert "keeping the last 2 endpoints" in warnings[1].getMessage()
    assert sum("resolving again" in r.getMessage() for r in caplog.records) == 2


async def test_dns_with_the_system_resolver_on_a_literal_address() -> None:
    d = DnsDiscovery("127.0.0.1", 9001, scheme="https", interval_s=60)
    async with contextlib.aclosing(d.watch()) as it:
        first = await anext(it)
    assert first == [Endpoint("https://127.0.0.1:9001", "127.0.0.1:9001")]


async def test_dns_slow_resolver_times_out_and_keeps_going() -> None:
    calls = 0

    async def resolver(host: str, port: int) -> list[str]:
        nonlocal calls
        calls += 1
        if calls == 1:
            await asyncio.sleep(10)
        return ["10.1.1.1"]

    d = DnsDiscovery("x", 1, interval_s=0.001, resolver=resolver, timeout_s=0.02)
    async with contextlib.aclosing(d.watch()) as it:
        assert await next_set(it) == ["10.1.1.1:1"]


# --- a fake Kubernetes API server ---------------------------------------------------------------

SLICES = "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"


def ep(ip: str, ready: bool | None = True, terminating: bool = False) -> dict[str, Any]:
    cond: dict[str, Any] = {"serving": ready if not terminating else True}
    if ready is not None:
        cond["ready"] = ready
    if terminating:
        cond["terminating"] = True
    return {"addresses": [ip], "conditions": cond, "targetRef": {"kind": "Pod", "name": f"p-{ip}"}}


def eps_slice(
    name: str, service: str, endpoints: list[dict[str, Any]], **labels: str
) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": "llm",
            "labels": {"kubernetes.io/service-name": service, **labels},
        },
        "addressType": "IPv4",
        "ports": [
            {"name": "metrics", "port": 9400, "protocol": "TCP"},
            {"name": "http", "port": 8000, "protocol": "TCP"},
        ],
        "endpoints": endpoints,
    }


class FakeApi:
    """Just enough of the API server: list and watch of EndpointSlices in one namespace, with a
    label selector, resourceVersions, bookmarks, history compaction (410 Gone) and requests log."""

    def __init__(self, namespace: str = "llm") -> None:
        self.namespace = namespace
        self.rv = 100
        self.slices: dict[str, dict[str, Any]] = {}
        self.history: list[tuple[int, dict[str, Any]]] = []  # (rv, event)
        self.compacted = 0  # watches from an older resourceVersion get 410
        self.requests: list[dict[str, str]] = []
        self.epoch = 0  # bumping it ends every open watch
        self.expire_open = False  # end open watches with an ERROR 410 event instead
        self.http_gone_once = False
        self.fail_lists = 0  # answer this many lists with 500
        self.delivered = 0  # the newest resourceVersion written to a watch stream
        self.changed = asyncio.Condition()
        app = web.Application()
        app.router.add_get(SLICES.format(ns="{ns}"), self.handle)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        self.url = ""

    async def start(self) -> None:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        await self.end_watches()
        await self.runner.cleanup()

    @property
    def lists(self) -> list[dict[str, str]]:
        return [r for r in self.requests if r.get("watch") != "true"]

    @property
    def watches(self) -> list[dict[str, str]]:
        return [r for r in self.requests if r.get("watch") == "true"]

    # --- what a test does ---
    async def put(self, kind: str, obj: dict[str, Any], *, silently: bool = False) -> int:
        """Store (or delete) a slice and record the event; `silently` skips the watchers."""
        self.rv += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.rv)
        if kind == "DELETED":
            self.slices.pop(obj["metadata"]["name"], None)
        else:
            self.slices[obj["metadata"]["name"]] = obj
        if silently:
            self.compacted = self.rv
        else:
            self.history.append((self.rv, {"type": kind, "object": obj}))
        async with self.changed:
            self.changed.notify_all()
        return self.rv

    async def bookmark(self) -> int:
        self.rv += 1
        obj = {
            "kind": "EndpointSlice",
            "apiVersion": "discovery.k8s.io/v1",
            "metadata": {"resourceVersion": str(self.rv)},
        }
        self.history.append((self.rv, {"type": "BOOKMARK", "object": obj}))
        async with self.changed:
            self.changed.notify_all()
        return self.rv

    async def end_watches(self, *, expire: bool = False) -> None:
        self.expire_open = expire
        self.epoch += 1
        async with self.changed:
            self.changed.notify_all()

    # --- the HTTP side ---
    def _selected(self, obj: dict[str, Any], selector: str) -> bool:
        labels = obj["metadata"].get("labels") or {}
        for term in filter(None, selector.split(",")):
            key, _, value = term.partition("=")
            if labels.get(key) != value:
                return False
        return True

    async def handle(self, request: web.Request) -> web.StreamResponse:
        q = dict(request.query)
        q["authorization"] = request.headers.get("Authorization", "")
        q["namespace"] = request.match_info["ns"]
        self.requests.append(q)
        if request.match_info["ns"] != self.namespace:
            return web.json_response({"kind": "Status", "code": 403}, status=403)
        selector = q.get("labelSelector", "")
        if q.get("watch") != "true":
            if self.fail_lists:
                self.fail_lists -= 1
                return web.json_response({"kind": "Status", "code": 500}, status=500)
            items = [s for s in self.slices.values() if self._selected(s, selector)]
            q["answered_rv"] = str(self.rv)
            body = {
                "kind": "EndpointSliceList",
                "metadata": {"resourceVersion": str(self.rv)},
                "items": items,
            }
            return web.json_response(body)
        since = int(q["resourceVersion"])
        if self.http_gone_once:
            self.http_gone_once = False
            return web.json_response(
                {"kind": "Status", "code": 410, "reason": "Expired"}, status=410
            )
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        if since < self.compacted:
            await self._send(resp, self._gone())
            return resp
        epoch = self.epoch
        while True:
            for rv, event in list(self.history):
                if rv > since:
                    obj = event["object"]
                    if event["type"] == "BOOKMARK" or self._selected(obj, selector):
                        await self._send(resp, event)
                    since = self.delivered = rv
            async with self.changed:
                if self.epoch == epoch and not (self.history and self.history[-1][0] > since):
                    await self.changed.wait()
            if self.epoch != epoch:
                if self.expire_open:
                    await self._send(resp, self._gone())
                return resp

    @staticmethod
    def _gone() -> dict[str, Any]:
        status = {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "code": 410,
            "reason": "Expired",
            "message": "too old resource version",
        }
        return {"type": "ERROR", "object": status}

    @staticmethod
    async def _send(resp: web.StreamResponse, event: dict[str, Any]) -> None:
        data = orjson.dumps(event) + b"\n"
        half = len(data) // 2  # split lines across chunks, as a real stream may
        await resp.write(data[:half])
        await resp.write(data[half:])


@pytest.fixture
async def api() -> AsyncIterator[FakeApi]:
    fake = FakeApi()
    await fake.start()
    try:
        yield fake
    finally:
        await fake.stop()


def k8s(api: FakeApi, **kw: Any) -> KubernetesDiscovery:
    kw.setdefault("port_name", "http")
    return KubernetesDiscovery("vllm", "llm", api_url=api.url, retry_s=0.01, **kw)


async def test_kubernetes_list_then_watch(api: FakeApi) -> None:
    await api.put(
        "ADDED", eps_slice("vllm-a", "vllm", [ep("10.0.0.1"), ep("10.0.0.2", ready=False)])
    )
    await api.put("ADDED", eps_slice("other-a", "other", [ep("10.9.9.9")]))
    async with contextlib.aclosing(k8s(api).watch()) as it:
        assert await next_set(it) == ["10.0.0.1:8000"]  # listed; not-ready and other services out

        # readiness flips on
        await api.put("MODIFIED", eps_slice("vllm-a", "vllm", [ep("10.0.0.1"), ep("10.0.0.2")]))
        assert await next_set(it) == ["10.0.0.1:8000", "10.0.0.2:8000"]

        # a second slice; its terminating endpoint does not count
        await api.put(
            "ADDED",
            eps_slice(
                "vllm-b", "vllm", [ep("10.0.0.3"), ep("10.0.0.4", ready=False, terminating=True)]
            ),
        )
        assert await next_set(it) == ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]

        # another service's change and a bookmark yield nothing; the next change does
        await api.put("MODIFIED", eps_slice("other-a", "other", [ep("10.9.9.8")]))
        await api.bookmark()
        await api.put(
            "MODIFIED", eps_slice("vllm-a", "vllm", [ep("10.0.0.1", ready=False), ep("10.0.0.2")])
        )
        assert await next_set(it) == ["10.0.0.2:8000", "10.0.0.3:8000"]

        # the server ends the watch (timeoutSeconds): resume from the last event, no relist
        mark = await api.bookmark()
        await poll_until(lambda: api.delivered >= mark)
        await api.end_watches()
        await api.put("DELETED", eps_slice("vllm-b", "vllm", []))
        assert await next_set(it) == ["10.0.0.2:8000"]
        assert api.watches[-1]["resourceVersion"] == str(mark)
        assert len(api.lists) == 1

    first_watch = api.watches[0]
    assert first_watch["labelSelector"] == "kubernetes.io/service-name=vllm"
    assert first_watch["allowWatchBookmarks"] == "true"
    assert first_watch["resourceVersion"] == api.lists[0]["answered_rv"]
    assert first_watch["authorization"] == ""  # api_url given, no token_path: no credentials


async def test_kubernetes_410_gone_relists(api: FakeApi) -> None:
    await api.put("ADDED", eps_slice("vllm-a", "vllm", [ep("10.0.0.1")]))
    async with contextlib.aclosing(k8s(api).watch()) as it:
        assert await next_set(it) == ["10.0.0.1:8000"]

        # history compacted past the watcher, then the open watch expires: ERROR 410 event
        await api.put("ADDED", eps_slice("vllm-b", "vllm", [ep("10.0.0.5")]), silently=True)
        await api.end_watches(expire=True)
        assert await next_set(it) == ["10.0.0.1:8000", "10.0.0.5:8000"]
        assert len(api.lists) == 2

        # a watch request answered with HTTP 410 relists too
        api.http_gone_once = True
        await api.put("DELETED", eps_slice("vllm-a", "vllm", []), silently=True)
        await api.end_watches()
        assert await next_set(it) == ["10.0.0.5:8000"]
        assert len(api.lists) == 3

        # and watching goes on from the relist
        await api.put("MODIFIED", eps_slice("vllm-b", "vllm", [ep("10.0.0.5"), ep("10.0.0.6")]))
        assert await next_set(it) == ["10.0.0.5:8000", "10.0.0.6:8000"]


async def test_kubernetes_api_errors_keep_the_last_set(
    api: FakeApi, caplog: pytest.LogCaptureFixture
) -> None:
    await api.put("ADDED", eps_slice("vllm-a", "vllm", [ep("10.0.0.1")]))
    async with contextlib.aclosing(k8s(api).watch()) as it:
        assert await next_set(it) == ["10.0.0.1:8000"]
        api.http_gone_once = True  # forces a relist, which fails three times
        api.fail_lists = 3
        with caplog.at_level(logging.INFO, logger="gateway.discovery"):
            await api.end_watches()
            await api.put("MODIFIED", eps_slice("vllm-a", "vllm", [ep("10.0.0.1"), ep("10.0.0.2")]))
            assert await next_set(it) == ["10.0.0.1:8000", "10.0.0.2:8000"]
    assert api.fail_lists == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "HTTP 500" in warnings[0]
    assert "keeping the last 1 endpoints" in warnings[0]


async def test_kubernetes_selector_port_choice_token_and_unready_default(
    api: FakeApi, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("secret-token\n")
    s = eps_slice("vllm-a", "vllm", [ep("10.0.0.1", ready=None), ep("10.0.0.2")], tier="gold")
    s["endpoints"][1]["conditions"] = {}  # unset conditions: ready
    await api.put("ADDED", s)
    await api.put("ADDED", eps_slice("vllm-b", "vllm", [ep("10.0.0.3")], tier="silver"))
    d = k8s(api, port_name="metrics", label_selector="tier=gold", token_path=str(token))
    async with contextlib.aclosing(d.watch()) as it:
        assert await next_set(it) == ["10.0.0.1:9400", "10.0.0.2:9400"]
    assert api.lists[0]["labelSelector"] == "kubernetes.io/service-name=vllm,tier=gold"
    assert api.lists[0]["authorization"] == "Bearer secret-token"


async def test_kubernetes_ambiguous_port_skips_the_slice(
    api: FakeApi, caplog: pytest.LogCaptureFixture
) -> None:
    await api.put("ADDED", eps_slice("vllm-a", "vllm", [ep("10.0.0.1")]))  # two ports
    one_port = eps_slice("vllm-b", "vllm", [ep("10.0.0.2")])
    one_port["ports"] = [{"port": 8080}]  # unnamed, protocol defaults to TCP
    await api.put("ADDED", one_port)
    async with contextlib.aclosing(k8s(api, port_name=None).watch()) as it:
        assert await next_set(it) == ["10.0.0.2:8080"]
    assert any("vllm-a lacks exactly one TCP port" in r.getMessage() for r in caplog.records)


async def test_kubernetes_outside_a_cluster_needs_api_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    d = KubernetesDiscovery("vllm", "llm")
    with pytest.raises(DiscoveryError, match="not running in a cluster"):
        async with contextlib.aclosing(d.watch()) as it:
            await anext(it)


def test_kubernetes_in_cluster_access_uses_the_service_account(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    if not SERVICE_ACCOUNT_DIR.exists():  # outside a pod: the default CA path is missing
        with pytest.raises(DiscoveryError, match="serviceaccount/ca.crt"):
            KubernetesDiscovery("vllm", "llm")._access()
    ca = Path(ssl.get_default_verify_paths().openssl_cafile)
    if not ca.is_file():
        pytest.skip(f"no CA bundle at {ca} to stand in for the service account CA")
    access = KubernetesDiscovery("vllm", "llm", ca_path=str(ca))._access()
    assert (
        access.url == "https://[fd00::1]:443/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices"
    )
    assert access.token_path == SERVICE_ACCOUNT_DIR / "token"
    assert isinstance(access.ssl, ssl.SSLContext)


# --- configuration ------------------------------------------------------------------------------

ADAPTER: TypeAdapter[Any] = TypeAdapter(DiscoveryConfig)


def test_config_kinds_build_their_discovery() -> None:
    static = ADAPTER.validate_python({"kind": "static", "endpoints": ["http://10.0.0.1:8000"]})
    dns = ADAPTER.validate_python({"kind": "dns", "name": "vllm-headless", "port": 8000})
    kube = ADAPTER.validate_python({"kind": "kubernetes", "service": "vllm", "port_name": "http"})
    assert isinstance(static, StaticDiscoveryConfig) and isinstance(
        open_discovery(static), StaticDiscovery
    )
    assert isinstance(dns, DnsDiscoveryConfig) and isinstance(open_discovery(dns), DnsDiscovery)
    assert isinstance(kube, KubernetesDiscoveryConfig)
    built = open_discovery(kube)
    assert isinstance(built, KubernetesDiscovery) and built.namespace is None
    assert dns.interval_s == 5.0 and kube.watch_timeout_s == 300


@pytest.mark.parametrize(
    "data",
    [
        {"kind": "consul", "name": "x"},
        {"kind": "dns", "name": "x"},  # port missing
        {"kind": "dns", "name": "x", "port": 80, "extra": 1},
        {"kind": "kubernetes", "service": "Not_A_Name"},
        {"kind": "static", "endpoints": ["10.0.0.1:8000"]},
        {"kind": "static", "endpoints": []},
    ],
)
def test_config_rejects(data: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        ADAPTER.validate_python(data)


def test_config_is_frozen() -> None:
    dns = ADAPTER.validate_python({"kind": "dns", "name": "x", "port": 80})
    with pytest.raises(ValidationError):
        dns.port = 81
