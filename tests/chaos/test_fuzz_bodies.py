"""Hostile request bodies and headers against a real gateway process: every answer is a well-formed
error or a valid response, never a 5xx, and the process's memory stays bounded.

Hypothesis runs derandomized with a fixed example budget (the whole module takes ~15 s).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.api.openai import MAX_DEPTH
from tests.chaos.conftest import (
    MAX_BODY,
    MODEL,
    TENANT_KEY,
    GatewayProc,
    assert_openai_error,
)

FUZZ = settings(
    max_examples=250,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
AUTH = {"authorization": f"Bearer {TENANT_KEY}"}

# --- strategies ----------------------------------------------------------------------------------

text = st.text(st.characters(codec="utf-8"), max_size=40)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    text,
)
anything = st.recursive(
    scalars,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(text, kids, max_size=4),
    max_leaves=16,
)


def maybe(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """The valid value most of the time, anything at all otherwise (wrong types, nesting...)."""
    return st.one_of(valid, valid, anything)


big_ints = st.one_of(
    st.integers(min_value=-10, max_value=20_000_000),
    st.sampled_from([0, 1, 10_000_000, 10_000_001, 2**31, 2**63 - 1, -(2**63), 2**64 - 1]),
)
part = st.fixed_dictionaries(
    {"type": maybe(st.sampled_from(["text", "image_url", "input_audio"]))},
    optional={"text": maybe(st.text(max_size=80)), "image_url": anything},
)
message = st.fixed_dictionaries(
    {"role": maybe(st.sampled_from(["system", "user", "assistant", "tool", "robot", ""]))},
    optional={
        "content": st.one_of(st.text(max_size=300), st.lists(part, max_size=3), anything),
        "name": maybe(st.text(max_size=12)),
        "tool_calls": anything,
        "tool_call_id": anything,
        "extra": anything,
    },
)
models = st.sampled_from(
    [MODEL, "http://evil.example/v1", "../../admin/status", "m" * 400, "", "qwen*", "\u0000"]
)
common = {
    "stream": maybe(st.booleans()),
    "stream_options": maybe(st.fixed_dictionaries({}, optional={"include_usage": anything})),
    "max_tokens": maybe(big_ints),
    "max_completion_tokens": maybe(big_ints),
    "n": maybe(st.integers(min_value=-3, max_value=200)),
    "temperature": maybe(st.floats(allow_nan=False, allow_infinity=False)),
    "top_p": anything,
    "user": maybe(st.text(max_size=20)),
    "priority": maybe(st.sampled_from(["interactive", "batch", "gold", "", "x" * 200])),
    "cache_salt": anything,
}
chat_bodies = st.fixed_dictionaries(
    {"model": maybe(models), "messages": maybe(st.lists(message, max_size=4))}, optional=common
)
token_ids = st.integers(min_value=-3, max_value=2**33)
prompts = st.one_of(
    st.text(max_size=300),
    st.lists(st.text(max_size=30), max_size=4),
    st.lists(token_ids, max_size=24),
    st.lists(st.lists(token_ids, max_size=6), max_size=3),
    anything,
)
completion_bodies = st.fixed_dictionaries(
    {"model": maybe(models), "prompt": prompts}, optional=common
)
header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=300).map(
    str.strip
)
headers = st.fixed_dictionaries(
    {},
    optional={
        "authorization": st.sampled_from(
            [f"Bearer {TENANT_KEY}", "Bearer wrong", "Bearer", "", "Basic Zm9vOmJhcg==", TENANT_KEY]
        ),
        "x-priority": st.one_of(st.sampled_from(["interactive", "batch", "gold"]), header_text),
        "x-session-id": header_text,
        "x-request-id": header_text,
        "x-gateway-explain": st.sampled_from(["1", "true", "0"]),
        "traceparent": header_text,
        "tracestate": header_text,
    },
)


def _mutations() -> st.SearchStrategy[Any]:
    def nan(raw: bytes) -> bytes:
        return raw.replace(b'"model":', b'"temperature":NaN,"model":', 1)

    def infinity(raw: bytes) -> bytes:
        return raw.replace(b'"model":', b'"top_p":-Infinity,"model":', 1)

    def bad_utf8(raw: bytes) -> bytes:
        return raw.replace(b'"model":"', b'"model":"\xc3\x28\xff', 1)

    def lone_surrogate(raw: bytes) -> bytes:
        return raw.replace(b'"model":"', b'"model":"\\ud800', 1)

    def duplicate_key(raw: bytes) -> bytes:
        return b'{"model":12,"messages":"x",' + raw[1:] if raw.startswith(b"{") else raw

    def bom(raw: bytes) -> bytes:
        return b"\xef\xbb\xbf" + raw

    def utf16(raw: bytes) -> bytes:
        return raw.decode("utf-8", "replace").encode("utf-16")

    def trailing(raw: bytes) -> bytes:
        return raw + b"}garbage"

    def nul(raw: bytes) -> bytes:
        return raw.replace(b":", b":\x00", 1)

    fixed = st.sampled_from(
        [lambda r: r] * 6 + [nan, infinity, bad_utf8, lone_surrogate, duplicate_key, bom, utf16]
        + [trailing, nul]
    )  # fmt: skip
    truncate = st.integers(min_value=0, max_value=400).map(lambda n: lambda r: r[:n])
    return st.one_of(fixed, truncate)


mutations = _mutations()

# --- checks --------------------------------------------------------------------------------------


def check(res: httpx.Response) -> None:
    """A valid answer (JSON or a complete SSE stream) or a well-formed 4xx; never a 5xx."""
    ctype = res.headers.get("content-type", "")
    if res.status_code == 200:
        if ctype.startswith("text/event-stream"):
            assert res.content.endswith(b"\n\n") and b"data: [DONE]" in res.content, res.content
        else:
            assert isinstance(orjson.loads(res.content), dict)
        return
    assert_openai_error(res.status_code, res.content, ctype)


@pytest.fixture(scope="module")
def client(gw: GatewayProc) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gw.url, timeout=15) as h:
        for _ in range(20):  # warm-up, then the memory baseline
            h.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, headers=AUTH)  # fmt: skip
        yield h


@pytest.fixture(scope="module")
def rss_before(gw: GatewayProc, client: httpx.Client) -> float:
    return gw.rss_mb()


# --- the fuzz tests ------------------------------------------------------------------------------


@FUZZ
@given(body=chat_bodies, hdrs=headers, mutate=mutations)
def test_fuzz_chat(
    client: httpx.Client, rss_before: float, body: Any, hdrs: Any, mutate: Any
) -> None:
    raw = mutate(orjson.dumps(body))
    check(client.post("/v1/chat/completions", content=raw, headers={**AUTH, **hdrs}))


@FUZZ
@given(body=completion_bodies, hdrs=headers, mutate=mutations)
def test_fuzz_completions(client: httpx.Client, body: Any, hdrs: Any, mutate: Any) -> None:
    raw = mutate(orjson.dumps(body))
    check(client.post("/v1/completions", content=raw, headers={**AUTH, **hdrs}))


@settings(FUZZ, max_examples=60)
@given(
    path=st.sampled_from(["/health", "/ready", "/metrics", "/v1/models", "/openapi.json"]),
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
    raw=st.binary(max_size=64),
)
def test_fuzz_other_endpoints(client: httpx.Client, path: str, method: str, raw: bytes) -> None:
    res = client.request(method, path, content=raw, headers=AUTH)
    assert res.status_code < 500 or (path == "/ready" and res.status_code == 503), res
    if res.status_code >= 400 and not (path == "/ready" and res.status_code == 503):
        assert_openai_error(res.status_code, res.content, res.headers.get("content-type", ""))


# --- hand-picked extremes ------------------------------------------------------------------------


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


def _nested(depth: int, content: bytes = b"x", leaf: bytes = b"") -> bytes:
    """A chat body with `depth` arrays nested in a message (`leaf` at the bottom); a long
    `content` takes the walk that large bodies take (gateway/api/openai.py `_too_deep`)."""
    return b'{"model":"%s","messages":[{"role":"user","content":"%s","x":%s%s%s}]}' % (
        MODEL.encode(), content, b"[" * depth, leaf, b"]" * depth
    )  # fmt: skip


_LONG = b"y" * 8000  # a large body: its nesting is walked, not counted
_MANY = b",".join(b"%d" % i for i in range(400))  # more values than the walk takes


EXTREMES: list[tuple[str, bytes, int]] = [
    ("empty body", b"", 400),
    ("null", b"null", 400),
    ("array", b"[1,2]", 400),
    ("number", b"12", 400),
    ("NaN literal", b'{"model":"m","messages":[],"temperature":NaN}', 400),
    ("deep nesting past orjson", b"[" * 5000 + b"]" * 5000, 400),
    ("nesting just within the limit", _nested(MAX_DEPTH - 4), 200),
    ("nesting past the limit", _nested(300), 400),
    ("a large body nesting just within the limit", _nested(MAX_DEPTH - 4, _LONG), 200),
    ("a large body nesting past the limit", _nested(MAX_DEPTH, _LONG), 400),
    ("a large body of many values within the limit", _nested(MAX_DEPTH - 4, _LONG, _MANY), 200),
    ("a large body of many values past the limit", _nested(MAX_DEPTH, _LONG, _MANY), 400),
    ("huge max_tokens", orjson.dumps(_chat(max_tokens=10_000_001)), 400),
    ("max_tokens at the cap", orjson.dumps(_chat(max_tokens=10_000_000)), 200),
    ("u64 max_tokens", orjson.dumps(_chat(max_tokens=2**64 - 1)), 400),
    ("negative max_tokens", orjson.dumps(_chat(max_tokens=-1)), 400),
    ("negative n", orjson.dumps(_chat(n=-1)), 400),
    ("token id past 32 bits", b'{"model":"m","prompt":[1,4294967296]}', 400),
    ("batch with a huge token id", b'{"model":"m","prompt":[[1],[1099511627776]]}', 400),
    ("huge string", orjson.dumps(_chat(user="u" * (MAX_BODY - 200))), 200),
    ("over the body limit", orjson.dumps(_chat(user="u" * (MAX_BODY + 10))), 413),
    ("duplicate keys (last wins, like the replica)", b'{"model":5,"model":"m","messages":[{"role":"user","content":"x"}]}', 200),
    ("invalid UTF-8 in a string", b'{"model":"m\xff","messages":[]}', 400),
    ("lone surrogate escape", b'{"model":"\\udc00","messages":[]}', 400),
    ("wrong type for messages", orjson.dumps({"model": "m", "messages": {"role": "user"}}), 400),
    ("content part without type", orjson.dumps({"model": "m", "messages": [{"role": "user", "content": [{}]}]}), 400),
    ("string priority class unknown", orjson.dumps(_chat(priority="gold")), 400),
]  # fmt: skip


@pytest.mark.parametrize(("what", "raw", "status"), EXTREMES, ids=[e[0] for e in EXTREMES])
def test_extremes(client: httpx.Client, what: str, raw: bytes, status: int) -> None:
    path = "/v1/completions" if b'"prompt"' in raw else "/v1/chat/completions"
    res = client.post(path, content=raw, headers=AUTH)
    assert res.status_code == status, (what, res.status_code, res.content[:300])
    check(res)


def test_memory_stays_bounded(gw: GatewayProc, client: httpx.Client, rss_before: float) -> None:
    for _ in range(20):  # the same hostile mix once more must not grow the process further
        client.post("/v1/chat/completions", content=_nested(300), headers=AUTH)
        client.post("/v1/completions", content=b'{"model":"m","prompt":[4294967296]}', headers=AUTH)
        client.post("/v1/chat/completions", content=orjson.dumps(_chat(user="u" * 500_000)), headers=AUTH)  # fmt: skip
    grown = gw.rss_mb() - rss_before
    assert gw.alive() and grown < 64, f"gateway RSS grew {grown:.0f} MiB during the fuzzing"
