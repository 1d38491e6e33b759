"""Every serving endpoint through the gateway to simulated vLLM replicas: one table row per path,
each with auth (401), a rate limit (429) and one failover (a dead replica in the rotation); wrong
types, unknown models, oversized uploads, unknown paths, `passthrough:`, `previous_response_id`
stickiness, and the official `openai` SDK unchanged."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from gateway import create_app, parse_config
from gateway.api.kinds import PATHS
from gateway.config import ConfigError
from gateway.routing.router import Router
from prefix_index import ByteChunker, TokenChunker
from simulator import Fleet
from tests.simulator.tiny_tokenizer import train_tokenizer
from tests.support import free_port, start_server

KEY, TINY, ADMIN = "sk-endpoints-main-1", "sk-endpoints-tiny-1", "adm-endpoints-1"
MODEL = "qwen2.5-14b"  # the simulated fleet's served name
BOUNDARY = "gwtestboundary7f3a"
Check = Callable[[httpx.Response], bool]


def multipart(fields: dict[str, str], audio: bytes = b"RIFF" + bytes(2000)) -> bytes:
    out = b""
    for name, value in fields.items():
        out += (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'
                f"{value}\r\n").encode()
    out += (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
            "Content-Type: audio/wav\r\n\r\n").encode() + audio + f"\r\n--{BOUNDARY}--\r\n".encode()
    return out


MULTIPART = {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}


@dataclass(frozen=True)
class Case:
    path: str
    body: Any  # a JSON body, or bytes (multipart)
    check: Check


def _json(f: Callable[[Any], bool]) -> Check:
    return lambda r: r.headers["content-type"].startswith("application/json") and f(r.json())


CASES = [
    Case("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 3},
         _json(lambda j: j["object"] == "chat.completion")),
    Case("/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 3},
         _json(lambda j: j["object"] == "text_completion")),
    Case("/v1/responses", {"model": MODEL, "input": "hello there", "max_output_tokens": 4},
         _json(lambda j: j["object"] == "response" and j["id"].startswith("resp_")
               and j["usage"]["output_tokens"] == 4)),
    Case("/v1/embeddings", {"model": MODEL, "input": ["a cat", "a dog"], "dimensions": 8},
         _json(lambda j: [len(d["embedding"]) for d in j["data"]] == [8, 8])),
    Case("/pooling", {"model": MODEL, "input": "a cat"},
         _json(lambda j: j["data"][0]["object"] == "pooling")),
    Case("/classify", {"model": MODEL, "input": ["good", "bad"]},
         _json(lambda j: len(j["data"]) == 2 and j["data"][0]["num_classes"] == 2)),
    *(Case(p, {"model": MODEL, "text_1": "the cat sat", "text_2": ["the cat sat", "zebra"]},
           _json(lambda j: j["data"][0]["score"] > j["data"][1]["score"]))
      for p in ("/v1/score", "/score")),
    *(Case(p, {"model": MODEL, "query": "the cat sat", "documents": ["zebra", "the cat sat"]},
           _json(lambda j: j["results"][0]["index"] == 1 and j["usage"]["total_tokens"] > 0))
      for p in ("/v1/rerank", "/rerank", "/v2/rerank")),
    Case("/tokenize", {"model": MODEL, "prompt": "hello world"},
         _json(lambda j: j["count"] == len(j["tokens"]) > 0 and j["max_model_len"] > 0)),
    Case("/detokenize", {"model": MODEL, "tokens": [17, 18]},
         _json(lambda j: isinstance(j["prompt"], str))),
    *(Case(p, multipart({"model": MODEL}), _json(lambda j: j["text"].endswith(".")))
      for p in ("/v1/audio/transcriptions", "/v1/audio/translations")),
]


@contextlib.asynccontextmanager
async def gateway_rig(dead: int = 0, **extra: Any) -> AsyncIterator[tuple[str, Any]]:
    """Two simulated replicas (and `dead` addresses nothing listens on, which stay in rotation:
    their circuits open only after many failures) behind a gateway that requires keys."""
    async with Fleet(n=2, speedup=1000.0) as fleet:
        replicas: list[Any] = [{"url": u, "name": f"r{i}"} for i, u in enumerate(fleet.urls)]
        replicas += [{"url": f"http://127.0.0.1:{free_port()}", "name": f"dead{i}"}
                     for i in range(dead)]
        pool = {"replicas": replicas, "policy": "round_robin", "retries": 2,
                "health": {"interval_s": 5, "failures_to_open": 1000},
                "timeouts": {"connect_s": 1, "first_byte_s": 10, "total_s": 20},
                **extra.pop("pool", {})}
        cfg = {
            "server": {"admin_key": ADMIN, **extra.pop("server", {})},
            "pools": {"chat": pool},
            "auth": "required",
            "tenants": [{"name": "main", "api_keys": [KEY]},
                        {"name": "tiny", "api_keys": [TINY],
                         "limits": {"requests_per_minute": 1}}],
            **extra,
        }
        app = create_app(parse_config(cfg))
        gw = await start_server(app, lifespan="on")
        try:
            yield gw.url, app
        finally:
            await gw.stop()


def send(h: httpx.AsyncClient, case: Case, key: str | None) -> Any:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    if isinstance(case.body, bytes):
        return h.post(case.path, content=case.body, headers={**headers, **MULTIPART})
    return h.post(case.path, json=case.body, headers=headers)


def attempts(app: Any, replica: str) -> float:
    total = 0.0
    for family in app.gateway.metrics.registry.collect():
        for s in family.samples:
            if s.name == "gateway_upstream_attempts_total" and s.labels.get("replica") == replica:
                total += s.value
    return total


@pytest.mark.parametrize("case", CASES, ids=[c.path for c in CASES])
async def test_each_endpoint_with_auth_limits_and_failover(case: Case) -> None:
    async with gateway_rig(dead=1) as (url, app), httpx.AsyncClient(base_url=url, timeout=30) as h:
        res = await send(h, case, None)
        assert res.status_code == 401 and res.json()["error"]["type"] == "authentication_error"
        for _ in range(3):  # round robin over r0, r1, dead0: one request meets the dead one
            res = await send(h, case, KEY)
            assert res.status_code == 200, res.text
            assert case.check(res), res.text
        assert attempts(app, "dead0") >= 1  # it was tried, and the request went on elsewhere
        assert (await send(h, case, TINY)).status_code == 200
        limited = await send(h, case, TINY)
        assert limited.status_code == 429 and "retry-after" in limited.headers
        assert limited.json()["error"]["type"] == "rate_limit_error"


WRONG_TYPES = [
    ("/v1/embeddings", {"model": MODEL, "input": 5}, "input"),
    ("/v1/embeddings", {"model": MODEL, "input": "x", "dimensions": "8"}, "dimensions"),
    ("/v1/embeddings", {"model": 7, "input": "x"}, "model"),
    ("/v1/responses", {"model": MODEL, "input": 3}, "input"),
    ("/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": "9"}, "max_output_tokens"),
    ("/v1/responses", {"model": MODEL, "input": "x", "stream": "yes"}, "stream"),
    ("/v1/responses", {"model": MODEL, "input": [{"role": "user", "content": 1}]}, "input[0].content"),
    ("/v1/rerank", {"model": MODEL, "query": ["x"], "documents": ["a"]}, "query"),
    ("/v1/rerank", {"model": MODEL, "query": "x", "documents": "a"}, "documents"),
    ("/score", {"model": MODEL, "text_1": 1, "text_2": "a"}, "text_1"),
    ("/tokenize", {"model": MODEL, "prompt": 1}, "prompt"),
    ("/detokenize", {"model": MODEL, "tokens": ["a"]}, "tokens"),
    ("/classify", {"model": MODEL}, "input"),
]


async def test_wrong_types_are_400_naming_the_field() -> None:
    async with gateway_rig() as (url, app), httpx.AsyncClient(base_url=url, timeout=30) as h:
        for path, body, param in WRONG_TYPES:
            res = await h.post(path, json=body, headers={"authorization": f"Bearer {KEY}"})
            assert res.status_code == 400, (path, body, res.text)
            err = res.json()["error"]
            assert (err["type"], err["param"]) == ("invalid_request_error", param), (path, err)
        res = await h.post("/v1/audio/transcriptions", content=b"not a form",
                           headers={"authorization": f"Bearer {KEY}", "content-type": "text/plain"})
        assert res.status_code == 400 and res.json()["error"]["code"] == "invalid_multipart"


async def test_unknown_models_are_404_model_not_found_from_the_gateway_or_the_replica() -> None:
    routes = [{"match": {"model": "qwen*"}, "pool": "chat"}]
    auth = {"authorization": f"Bearer {KEY}"}
    async with gateway_rig(routes=routes) as (url, _), httpx.AsyncClient(base_url=url) as h:
        for path, body in [("/v1/embeddings", {"model": "nope", "input": "x"}),
                           ("/v1/responses", {"model": "nope", "input": "x"}),
                           ("/v1/rerank", {"model": "nope", "query": "q", "documents": ["d"]})]:
            res = await h.post(path, json=body, headers=auth)
            assert res.status_code == 404 and res.json()["error"]["code"] == "model_not_found"
        # routed (the glob matches), and the replica knows no such model: the same answer
        res = await h.post("/v1/embeddings", json={"model": "qwen-other", "input": "x"}, headers=auth)
        assert res.status_code == 404, res.text
        err = res.json()["error"]
        assert (err["type"], err["code"], err["param"]) == ("not_found_error", "model_not_found", "model")
        # no model at all: the default pool (the route that takes any model, else the first pool)
        res = await h.post("/tokenize", json={"prompt": "hi"}, headers=auth)
        assert res.status_code == 200 and res.json()["count"] > 0


async def test_an_upload_over_the_body_limit_is_413_and_multipart_passes_unchanged() -> None:
    async with gateway_rig(server={"max_body_bytes": 4096}) as (url, _), httpx.AsyncClient(
        base_url=url, timeout=30
    ) as h:
        auth = {"authorization": f"Bearer {KEY}", **MULTIPART}
        big = multipart({"model": MODEL}, audio=bytes(8192))
        res = await h.post("/v1/audio/transcriptions", content=big, headers=auth)
        assert res.status_code == 413 and res.json()["error"]["code"] == "request_too_large"
        small = multipart({"model": MODEL, "response_format": "text"}, audio=b"abc" * 100)
        res = await h.post("/v1/audio/translations", content=small, headers=auth)
        assert res.status_code == 200 and res.headers["content-type"].startswith("text/plain")
        assert res.text.endswith(".")  # the replica read the form: the body arrived intact
        res = await h.post("/v1/audio/transcriptions", headers=auth,
                           content=multipart({"model": "other"}, audio=b"x"))
        assert res.status_code == 404 and res.json()["error"]["code"] == "model_not_found"


async def test_unknown_paths_are_404_and_passthrough_paths_are_forwarded() -> None:
    auth = {"authorization": f"Bearer {KEY}"}
    async with gateway_rig(passthrough=["/sim/stats", "/reset_prefix_cache"]) as (url, _), \
            httpx.AsyncClient(base_url=url, timeout=30) as h:  # fmt: skip
        for method, path in [("POST", "/v1/nope"), ("GET", "/sim/cache"), ("POST", "/sim/fault")]:
            res = await h.request(method, path, headers=auth)
            assert res.status_code == 404, (path, res.text)
            assert res.json()["error"]["code"] == "unknown_url"
        res = await h.get("/sim/stats", headers=auth)
        assert res.status_code == 200 and "requests" in res.text, res.text
        res = await h.post("/reset_prefix_cache", headers=auth)
        assert res.status_code == 200
        assert (await h.get("/sim/stats")).status_code == 401  # passthrough needs a key too
        assert (await h.get("/v1/embeddings", headers=auth)).status_code == 405


async def test_previous_response_id_sticks_to_the_replica_that_made_it() -> None:
    auth = {"authorization": f"Bearer {KEY}"}
    async with gateway_rig() as (url, _), httpx.AsyncClient(base_url=url, timeout=30) as h:
        res = await h.post("/v1/responses", headers=auth, json={"model": MODEL, "input": "one"})
        assert res.status_code == 200
        last = res.json()["id"]
        # round robin alternates r0, r1: each follow-up lands on the other replica unless it
        # sticks, and a replica that does not hold the response answers 404
        for i in range(4):
            body = {"model": MODEL, "input": f"turn {i}", "previous_response_id": last,
                    "stream": i % 2 == 1}
            res = await h.post("/v1/responses", headers=auth, json=body)
            assert res.status_code == 200, res.text
            if body["stream"]:
                assert "event: response.completed" in res.text and "[DONE]" not in res.text
                last = res.text.split('"response":{"id":"', 1)[1].split('"', 1)[0]
            else:
                last = res.json()["id"]
        decisions = (await h.get("/debug/decisions",
                                 headers={"authorization": f"Bearer {ADMIN}"})).json()["decisions"]
        assert sum(d["reason"] == "previous_response" for d in decisions) == 4
        res = await h.post("/v1/responses", headers=auth,
                           json={"model": MODEL, "input": "x", "previous_response_id": "resp_gone"})
        assert res.status_code == 404 and res.json()["error"]["type"] == "not_found_error"


async def test_the_openai_sdk_works_unchanged() -> None:
    async with gateway_rig() as (url, _):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        try:
            emb = await client.embeddings.create(model=MODEL, input=["hello", "world"])
            assert [len(d.embedding) for d in emb.data] == [256, 256]  # base64, decoded
            assert abs(sum(x * x for x in emb.data[0].embedding) - 1.0) < 1e-4
            assert emb.usage.prompt_tokens > 0
            resp = await client.responses.create(model=MODEL, input="hi", instructions="Be brief.",
                                                 max_output_tokens=5)
            assert resp.status == "incomplete" and resp.output_text and resp.usage is not None
            assert resp.usage.output_tokens == 5
            kinds: list[str] = []
            stream = await client.responses.create(model=MODEL, input="hi", stream=True,
                                                   max_output_tokens=3)
            async for event in stream:
                kinds.append(event.type)
            assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
            assert kinds.count("response.output_text.delta") == 3
            card = await client.models.retrieve(MODEL)
            assert card.id == MODEL
        finally:
            await client.close()


def hashed(router: Router, path: str, body: dict[str, Any]) -> Any:
    return router.prompt(PATHS[path].parse(orjson.dumps(body), None)).text


def test_a_response_hashes_as_the_chat_with_the_same_messages(tmp_path: Path) -> None:
    tok = train_tokenizer(tmp_path / "tok.json")
    chat = {"model": MODEL, "messages": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "The quick brown fox"}]},
        {"role": "assistant", "content": "jumps"}]}  # fmt: skip
    resp = {"model": MODEL, "instructions": "Answer briefly.", "input": [
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "The quick brown fox"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "jumps"}]}]}  # fmt: skip
    for router in (Router(ByteChunker(), None), Router(TokenChunker(tok), None)):
        prompt = partial(hashed, router)

        assert prompt("/v1/responses", resp) == prompt("/v1/chat/completions", chat)
        # after a stored response, only the instructions are known to lead the engine's prompt
        follow = {**resp, "previous_response_id": "resp_1"}
        system_only = {**chat, "messages": chat["messages"][:1]}
        assert prompt("/v1/responses", follow) == prompt("/v1/chat/completions", system_only)
        # embeddings route by their first input; tokenize by load alone (nothing hashed)
        first = prompt("/v1/completions", {"model": MODEL, "prompt": "The quick brown fox"})
        assert prompt("/v1/embeddings", {"input": ["The quick brown fox", "b"]}) == first
        assert prompt("/tokenize", {"prompt": "The quick brown fox"}) == ""


@pytest.mark.parametrize(("path", "why"), [
    ("/v1/embeddings", "serves itself"), ("/v1/models/x", "serves itself"), ("/admin/x", "serves"),
    ("sim/stats", "exact absolute path"), ("/a?b=1", "exact absolute path"),
])  # fmt: skip
def test_a_passthrough_path_must_be_exact_and_not_the_gateways(path: str, why: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"pools": {"p": {"replicas": ["http://127.0.0.1:1"]}}, "passthrough": [path]})
    assert err.value.problems[0].startswith("passthrough[0]: ") and why in str(err.value)
