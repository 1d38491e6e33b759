"""One error vocabulary, through real sockets: the gateway's own errors and its replicas', with
`server.expose_upstream_errors` off (the default) and on, and the types `gateway_errors_total`
may carry (exactly the ones docs/operations.md documents)."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from bench.harness import read_body
from gateway.errors import ERROR_TYPES
from tests.gateway.conftest import rig
from tests.gateway.fake_replica import Upstream

ROOT = Path(__file__).resolve().parents[2]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
KEY = "k-errors-0123456789"
# what a body must never hold with expose off: the replicas' and the gateway's addresses
ADDRESSES = re.compile(r"127\.0\.0\.1|10\.0\.0\.7|localhost|https?://")


@dataclass
class Answers(Upstream):
    """A replica that answers every proxied request with one fixed error."""

    status: int = 500
    payload: bytes = b""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in ("/health", "/metrics", "/v1/models"):
            await super().__call__(scope, receive, send)
            return
        await read_body(receive)
        self.calls += 1
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": self.payload})


def vllm_error(status: int, message: str, kind: str, param: str | None = None) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}
    )


STEADY = {"health": {"failures_to_open": 1000}}  # circuits stay closed: every case is a request
CONTEXT = "This model's maximum context length is 4096 tokens."
NO_MODEL = "The model `m` does not exist."
# name: the replica, then the status and the error body a client gets (expose off)
REPLICA_CASES: dict[str, tuple[Upstream, int, str, str, str | None, str]] = {
    "400 context length": (Answers("r", status=400, payload=vllm_error(400, CONTEXT, "BadRequestError")),
                           400, CONTEXT, "invalid_request_error", None, "bad_request"),
    "404 unknown model": (Answers("r", status=404, payload=vllm_error(404, NO_MODEL, "NotFoundError", "model")),
                          404, NO_MODEL, "not_found_error", "model", "model_not_found"),
    "429 replica limit": (Answers("r", status=429, payload=b'{"error": {"message": "slow down", "code": 429}}'),
                          429, "slow down", "rate_limit_error", None, "rate_limit_exceeded"),
    "500 with an address": (Upstream("r", mode="error_500"),
                            500, "boom at <hidden>", "server_error", None, "internal_error"),
    "500 html page": (Answers("r", status=500, payload=b"<html>nginx at 10.0.0.7:8000</html>"),
                      500, "The upstream replica answered 500", "server_error", None, "internal_error"),
    "sglang flat 400": (Upstream("r", mode="sglang_error"),
                        400, "bad thing", "invalid_request_error", None, "bad_request"),
}  # fmt: skip


async def post(url: str, body: Any = CHAT, **kw: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=15) as h:
        return await h.post(url + "/v1/chat/completions", json=body, **kw)


def assert_shape(res: httpx.Response, status: int, kind: str, code: str) -> dict[str, Any]:
    assert res.status_code == status, res.text
    err = res.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["code"]) == (kind, code), err
    assert err["type"] in ERROR_TYPES and isinstance(err["code"], str) and err["message"]
    return dict(err)


@pytest.mark.parametrize("case", list(REPLICA_CASES))
async def test_replica_errors_keep_status_and_message_in_the_vocabulary(case: str) -> None:
    up, status, message, kind, param, code = REPLICA_CASES[case]
    body = {"message": message, "type": kind, "param": param, "code": code}
    async with rig([up], pool=STEADY) as r:
        res = await post(r.url)
        assert res.status_code == status and res.json() == {"error": body}
        assert not ADDRESSES.search(res.text), res.text
        # streamed requests get the same error body (nothing was streamed yet)
        res = await post(r.url, {**CHAT, "stream": True})
        assert res.status_code == status and res.json() == {"error": body}


async def test_expose_on_shows_the_replicas_message_unchanged() -> None:
    up = Upstream("r", mode="error_500")
    async with rig([up], pool=STEADY, extra={"server": {"expose_upstream_errors": True}}) as r:
        err = assert_shape(await post(r.url), 500, "server_error", "internal_error")
    assert err["message"] == "boom at 10.0.0.7"


@pytest.mark.parametrize("expose", [False, True])
async def test_every_replica_503_is_a_503_with_retry_after(expose: bool) -> None:
    ups = [Upstream("a", mode="error_503"), Upstream("b", mode="error_503")]
    extra = {"server": {"expose_upstream_errors": expose}}
    async with rig(ups, pool={**STEADY, "retries": 3}, extra=extra) as r:
        for stream in (False, True):
            res = await post(r.url, {**CHAT, "stream": stream})
            err = assert_shape(res, 503, "service_unavailable_error", "replicas_overloaded")
            assert int(res.headers["retry-after"]) >= 1
            named = "a: upstream status 503" in err["message"]
            assert named is expose, err  # which replicas were tried: only with expose
    assert ups[0].calls and ups[1].calls


@pytest.mark.parametrize("expose", [False, True])
async def test_dead_replicas_are_a_502_naming_hosts_only_with_expose(expose: bool) -> None:
    extra = {"server": {"expose_upstream_errors": expose}}
    async with rig([], dead=2, pool={**STEADY, "retries": 3}, extra=extra) as r:
        res = await post(r.url)
    err = assert_shape(res, 502, "server_error", "bad_gateway")
    assert err["message"].startswith("All 2 attempted replicas failed.")
    assert bool(ADDRESSES.search(res.text)) is expose, res.text  # connect errors name the host


async def test_a_replica_that_never_answers_is_a_504() -> None:
    pool = {**STEADY, "retries": 0, "timeouts": {"connect_s": 1, "first_byte_s": 5,
                                                 "idle_s": 5, "total_s": 0.3}}  # fmt: skip
    async with rig([Upstream("slow", delay_s=3)], pool=pool) as r:
        err = assert_shape(await post(r.url), 504, "timeout_error", "upstream_timeout")
    assert "total_s (0.3 s)" in err["message"] and not ADDRESSES.search(err["message"])


async def test_the_gateways_own_errors() -> None:
    extra = {
        "server": {"max_body_bytes": 4096},
        "routes": [{"match": {"model": "m*"}, "pool": "chat"}],
        "tenants": [{"name": "t", "api_keys": [KEY], "limits": {"requests_per_minute": 1}}],
    }
    auth = {"authorization": f"Bearer {KEY}"}
    async with rig([Upstream("a")], pool=STEADY, extra=extra) as r:
        assert_shape(await post(r.url), 401, "authentication_error", "invalid_api_key")
        async with httpx.AsyncClient(timeout=15) as h:
            res = await h.post(r.url + "/v1/chat/completions", content=b"{nope", headers=auth)
            assert_shape(res, 400, "invalid_request_error", "invalid_json")
            res = await h.post(r.url + "/v1/chat/completions", headers=auth,
                               content=b'{"model": "m", "x": "' + b"y" * 8000 + b'"}')  # fmt: skip
            assert_shape(res, 413, "invalid_request_error", "request_too_large")
            res = await h.get(r.url + "/v1/nope")
            assert_shape(res, 404, "not_found_error", "unknown_url")
            res = await h.get(r.url + "/v1/chat/completions")
            assert_shape(res, 405, "invalid_request_error", "method_not_allowed")
        res = await post(r.url, {**CHAT, "model": "llama"}, headers=auth)
        assert_shape(res, 404, "not_found_error", "model_not_found")
        assert (await post(r.url, headers=auth)).status_code == 200
        res = await post(r.url, headers=auth)
        assert_shape(res, 429, "rate_limit_error", "rate_limit_exceeded")
        assert int(res.headers["retry-after"]) >= 1


async def test_no_replica_available_is_the_gateways_503() -> None:
    pool = {"health": {"interval_s": 0.05, "timeout_s": 0.2, "failures_to_open": 1, "open_s": 30}}
    async with rig([], dead=1, pool=pool) as r:
        for _ in range(200):
            if not r.gateway.pools["chat"].any_available():
                break
            await asyncio.sleep(0.02)
        res = await post(r.url)
    assert_shape(res, 503, "service_unavailable_error", "no_replica_available")
    assert int(res.headers["retry-after"]) >= 1 and not ADDRESSES.search(res.text)


def documented_error_labels() -> set[str]:
    line = next(
        ln for ln in (ROOT / "docs/operations.md").read_text().splitlines()
        if ln.startswith("| `gateway_errors_total")
    )  # fmt: skip
    return set(re.findall(r"`([a-z_]+)`", line.split("|")[2])) - {"type"}


def test_the_readme_documents_exactly_the_error_types() -> None:
    assert documented_error_labels() == set(ERROR_TYPES) | {"client_disconnected"}
    text = (ROOT / "docs/operations.md").read_text()
    table = text[text.index("## Errors") : text.index("## Request log")]
    rows = set(re.findall(r"^\| `([a-z_]+)` \| \d", table, re.MULTILINE))  # | `type` | status |
    assert rows == set(ERROR_TYPES)


async def test_errors_total_carries_only_documented_types() -> None:
    ups = [Answers("a", status=400, payload=b"{}"), Upstream("b", mode="error_500"),
           Upstream("c", mode="die_midstream")]  # fmt: skip
    async with rig(ups, pool=STEADY) as r:
        for _ in range(3):  # round robin: each replica's error once
            await post(r.url, {**CHAT, "stream": True})
            await post(r.url)
        await post(r.url, {**CHAT, "model": 5})
        async with httpx.AsyncClient() as h:
            text = (await h.get(r.url + "/metrics")).text
    types = set(re.findall(r'^gateway_errors_total\{[^}]*type="([^"]+)"', text, re.MULTILINE))
    assert {"invalid_request_error", "server_error"} <= types
    assert types <= documented_error_labels(), types
