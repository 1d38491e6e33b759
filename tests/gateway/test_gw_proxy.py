"""The proxy through real sockets: OpenAI SDK in front, scripted upstreams behind."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.gateway.conftest import rig
from tests.gateway.fake_replica import Upstream

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello"}]


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=10)


async def test_chat_and_completions_stream_and_not() -> None:
    async with rig([Upstream("a")]) as r:
        c = client(r.url)
        res = await c.chat.completions.create(model="test-model", messages=CHAT)
        assert res.choices[0].message.content == "w0 w1 w2 w3 w4 w5 w6 w7"
        stream = await c.chat.completions.create(model="test-model", messages=CHAT, stream=True)
        parts = [ch.choices[0].delta.content async for ch in stream]
        assert "".join(p or "" for p in parts) == "".join(f"w{i} " for i in range(8))
        for prompt in ("hi", ["a", "b"], [1, 2, 3], [[1, 2], [3]]):
            comp = await c.completions.create(model="test-model", prompt=prompt)
            assert comp.choices[0].text.startswith("w0")
        cs = await c.completions.create(model="test-model", prompt="hi", stream=True)
        assert "".join([ch.choices[0].text async for ch in cs]).startswith("w0 w1")
        await c.close()


async def test_stream_bytes_relayed_unchanged() -> None:
    async with rig([Upstream("a")]) as r:
        body = {"model": "test-model", "messages": CHAT, "stream": True}
        async with httpx.AsyncClient() as h:
            direct = (await h.post(r.served[0].url + "/v1/chat/completions", json=body)).content
            via = await h.post(r.url + "/v1/chat/completions", json=body)
        assert via.status_code == 200
        assert via.headers["content-type"].startswith("text/event-stream")
        assert via.content == direct


async def test_round_robin_spreads_evenly() -> None:
    ups = [Upstream(n) for n in "abc"]
    async with rig(ups) as r:
        c = client(r.url)
        for _ in range(30):
            await c.chat.completions.create(model="test-model", messages=CHAT)
        await c.close()
    assert [u.calls for u in ups] == [10, 10, 10]


async def test_least_loaded_spreads_concurrent_requests() -> None:
    ups = [Upstream(n, delay_s=0.3) for n in "abcd"]
    async with rig(ups, pool={"policy": "least_loaded"}) as r:
        c = client(r.url)
        await asyncio.gather(
            *(c.chat.completions.create(model="test-model", messages=CHAT) for _ in range(8))
        )
        await c.close()
    assert [u.calls for u in ups] == [2, 2, 2, 2]


async def test_refused_replica_costs_no_request() -> None:
    ups = [Upstream("a"), Upstream("b")]
    # circuits never open here, so every round robin turn on a dead replica must fail over
    async with rig(ups, dead=2, pool={"health": {"interval_s": 60, "failures_to_open": 100}}) as r:
        c = client(r.url)
        for i in range(20):
            res = await c.chat.completions.create(
                model="test-model", messages=CHAT, stream=i % 2 == 0
            )
            if i % 2 == 0:
                async for _ in res:
                    pass
        await c.close()
        assert sum(u.calls for u in ups) == 20
        async with httpx.AsyncClient() as h:
            text = (await h.get(r.url + "/metrics")).text
        assert (
            'gateway_upstream_attempts_total{outcome="connect_error",pool="chat",replica="dead0"}'
            in text
        )


async def test_503_replica_fails_over() -> None:
    ups = [Upstream("bad", mode="error_503"), Upstream("good")]
    async with rig(ups, pool={"health": {"failures_to_open": 100}}) as r:
        c = client(r.url)
        for _ in range(6):
            res = await c.chat.completions.create(model="test-model", messages=CHAT)
            assert res.choices[0].message.content
        await c.close()
    assert ups[1].calls == 6 and ups[0].calls == 3


async def test_all_replicas_failing_gives_clear_error() -> None:
    async with rig([Upstream("bad", mode="error_503")], dead=1, pool={"retries": 3}) as r:
        async with httpx.AsyncClient() as h:
            res = await h.post(
                r.url + "/v1/chat/completions", json={"model": "m", "messages": CHAT}
            )
        # 502 when the dead replica was tried too; 503 when its circuit had opened already
        assert res.status_code in (502, 503)
        err = res.json()["error"]
        kind = {502: "server_error", 503: "service_unavailable_error"}[res.status_code]
        assert err["type"] == kind and err["message"]


async def test_replica_dying_mid_stream_ends_with_error_event() -> None:
    ups = [Upstream("dies", mode="die_midstream")]
    async with rig(ups, pool={"health": {"failures_to_open": 100}}) as r:
        async with httpx.AsyncClient(timeout=10) as h:
            body = {"model": "m", "messages": CHAT, "stream": True}
            async with h.stream("POST", r.url + "/v1/chat/completions", json=body) as res:
                assert res.status_code == 200
                raw = b"".join([chunk async for chunk in res.aiter_bytes()])
        events = [e for e in raw.split(b"\n\n") if e]
        assert events[-1].startswith(b'data: {"error"')
        assert b"[DONE]" not in raw
        assert len(events) == 3  # two content chunks, then the error event
        ups[0].mode = "ok"
        c = client(r.url)
        res2 = await c.chat.completions.create(model="m", messages=CHAT)
        assert res2.choices[0].message.content
        await c.close()


async def test_client_disconnect_cancels_upstream() -> None:
    up = Upstream("stall", mode="stall")
    async with rig([up]) as r:
        async with httpx.AsyncClient(timeout=10) as h:
            body = {"model": "m", "messages": CHAT, "stream": True}
            async with h.stream("POST", r.url + "/v1/chat/completions", json=body) as res:
                it = res.aiter_bytes()
                await it.__anext__()
        for _ in range(200):
            if up.cancelled:
                break
            await asyncio.sleep(0.01)
        assert up.cancelled == 1
        assert r.gateway.pools["chat"].replicas[0].inflight == 0


async def test_stalled_stream_hits_idle_timeout() -> None:
    up = Upstream("stall", mode="stall")
    async with rig([up], pool={"timeouts": {"first_byte_s": 5, "idle_s": 0.5, "total_s": 30}}) as r:
        async with httpx.AsyncClient(timeout=10) as h:
            body = {"model": "m", "messages": CHAT, "stream": True}
            res = await h.post(r.url + "/v1/chat/completions", json=body)
        assert res.content.rstrip().endswith(b"}")
        assert b'"type":"timeout_error"' in res.content


async def test_upstream_error_bodies_normalized() -> None:
    async with rig([Upstream("s", mode="sglang_error")]) as r:
        async with httpx.AsyncClient() as h:
            res = await h.post(
                r.url + "/v1/chat/completions", json={"model": "m", "messages": CHAT}
            )
        assert res.status_code == 400
        assert res.json() == {
            "error": {
                "message": "bad thing",
                "type": "invalid_request_error",
                "param": None,
                "code": "bad_request",
            }
        }


async def test_upstream_errors_hidden_when_not_exposed() -> None:
    up = Upstream("s", mode="error_500")
    async with rig([up], extra={"server": {"expose_upstream_errors": False}}) as r:
        async with httpx.AsyncClient() as h:
            res = await h.post(
                r.url + "/v1/chat/completions", json={"model": "m", "messages": CHAT}
            )
        assert res.status_code == 500
        assert "10.0.0.7" not in res.text
        assert res.json()["error"] == {
            "message": "boom at <hidden>",  # the replica's words, its address hidden
            "type": "server_error",
            "param": None,
            "code": "internal_error",
        }


async def test_client_key_not_forwarded_and_upstream_key_set() -> None:
    up = Upstream("a")
    async with rig([up], pool={"upstream_api_key": "up-secret"}) as r:
        c = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="client-secret", max_retries=0)
        await c.chat.completions.create(model="m", messages=CHAT)
        await c.close()
    assert up.headers[0][b"authorization"] == b"Bearer up-secret"
    assert all(b"client-secret" not in v for v in up.headers[0].values())


async def test_models_ready_health_metrics() -> None:
    async with rig([Upstream("a", model="qwen-a"), Upstream("b", model="qwen-b")], dead=1) as r:
        async with httpx.AsyncClient() as h:
            models = (await h.get(r.url + "/v1/models")).json()
            assert [m["id"] for m in models["data"]] == ["qwen-a", "qwen-b"]
            assert (await h.get(r.url + "/health")).json() == {"status": "ok"}
            ready = await h.get(r.url + "/ready")
            assert ready.status_code == 200
            await h.post(r.url + "/v1/chat/completions", json={"model": "m", "messages": CHAT})
            text = (await h.get(r.url + "/metrics")).text
        for family in (
            "gateway_requests_total",
            "gateway_request_duration_seconds",
            "gateway_ttft_seconds",
            "gateway_routing_decisions_total",
            "gateway_replica_up",
            "gateway_replica_circuit_state",
        ):
            assert family in text, family


async def test_dead_replica_circuit_opens_and_ready_reflects_it() -> None:
    async with rig([], dead=1) as r:
        async with httpx.AsyncClient() as h:
            for _ in range(200):
                res = await h.get(r.url + "/ready")
                if res.status_code == 503:
                    break
                await asyncio.sleep(0.02)
            assert res.status_code == 503
            res = await h.post(
                r.url + "/v1/chat/completions", json={"model": "m", "messages": CHAT}
            )
            assert res.status_code == 503
            assert int(res.headers["retry-after"]) >= 1
            assert res.json()["error"]["code"] == "no_replica_available"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b'{"messages": []}', "model"),
        (b'{"model": 5, "messages": [{"role": "user", "content": "x"}]}', "model"),
        (b'{"model": "m"}', "messages"),
        (b'{"model": "m", "messages": []}', "messages"),
        (b'{"model": "m", "messages": [{"role": "wizard", "content": "x"}]}', "messages[0].role"),
        (b'{"model": "m", "messages": [{"role": "user", "content": 7}]}', "messages[0].content"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
            "stream",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}',
            "max_tokens",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1e99}',
            "max_tokens",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
            None,
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}',
            "temperature",
        ),
        (b"\xff\xfe\x00", None),
        (b"[" * 5000 + b"]" * 5000, None),
    ],
)
async def test_malformed_chat_bodies_are_400(body: bytes, param: str | None) -> None:
    up = Upstream("a")
    async with rig([up]) as r:
        async with httpx.AsyncClient() as h:
            res = await h.post(
                r.url + "/v1/chat/completions",
                content=body,
                headers={"content-type": "application/json"},
            )
        assert res.status_code == 400, res.text
        err = res.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
        assert err["param"] == param
    assert up.calls == 0


async def test_completions_prompt_checked() -> None:
    async with rig([Upstream("a")]) as r:
        async with httpx.AsyncClient() as h:
            for prompt in (None, 5, [], [1.5], [[-1]], {"a": 1}):
                body = {"model": "m"} if prompt is None else {"model": "m", "prompt": prompt}
                res = await h.post(r.url + "/v1/completions", json=body)
                assert res.status_code == 400 and res.json()["error"]["param"] == "prompt", prompt


async def test_body_over_limit_is_413_without_reading_it() -> None:
    up = Upstream("a")
    async with rig([up], extra={"server": {"max_body_bytes": 4096}}) as r:
        async with httpx.AsyncClient() as h:
            big = (
                b'{"model": "m", "messages": [{"role": "user", "content": "'
                + b"x" * 10000
                + b'"}]}'
            )
            res = await h.post(r.url + "/v1/chat/completions", content=big)
            assert res.status_code == 413
            assert res.json()["error"]["code"] == "request_too_large"

            async def chunks():  # no content-length: counted while reading
                for _ in range(10):
                    yield b"x" * 1000

            res = await h.post(r.url + "/v1/chat/completions", content=chunks())
            assert res.status_code == 413
    assert up.calls == 0


async def test_unknown_model_without_default_route_is_404() -> None:
    extra = {"routes": [{"match": {"model": "qwen*"}, "pool": "chat"}]}
    async with rig([Upstream("a")], extra=extra) as r:
        async with httpx.AsyncClient() as h:
            ok = await h.post(
                r.url + "/v1/chat/completions", json={"model": "qwen-7b", "messages": CHAT}
            )
            assert ok.status_code == 200
            res = await h.post(
                r.url + "/v1/chat/completions", json={"model": "llama", "messages": CHAT}
            )
        assert res.status_code == 404
        assert res.json()["error"]["code"] == "model_not_found"


async def test_unknown_path_and_method_are_openai_errors() -> None:
    async with rig([Upstream("a")]) as r:
        async with httpx.AsyncClient() as h:
            res = await h.get(r.url + "/v1/nope")
            assert res.status_code == 404 and res.json()["error"]["type"] == "not_found_error"
            res = await h.get(r.url + "/v1/chat/completions")
            assert res.status_code == 405 and res.json()["error"]["code"] == "method_not_allowed"


async def test_huge_declared_body_refused_unread() -> None:
    up = Upstream("a")
    async with rig([up], extra={"server": {"max_body_bytes": 4096}}) as r:
        reader, writer = await asyncio.open_connection("127.0.0.1", int(r.url.rsplit(":", 1)[1]))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 1000000000\r\n\r\n"
        )
        await writer.drain()
        head = await asyncio.wait_for(
            reader.readuntil(b"\r\n\r\n"), 5
        )  # answered with no body sent
        assert head.startswith(b"HTTP/1.1 413")
        writer.close()


async def test_trace_segments_and_traceparent_continued() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from gateway import create_app, parse_config
    from gateway.telemetry.tracing import Tracing
    from tests.support import start_server

    up = Upstream("a", chunks=16, chunk_delay_s=0.01)
    served = await start_server(up)
    exporter = InMemorySpanExporter()
    cfg = parse_config({"pools": {"chat": {"replicas": [served.url], "policy": "round_robin"}}})
    app = create_app(cfg, tracing=Tracing(None, exporter=exporter))
    gw = await start_server(app, lifespan="on")
    try:
        incoming = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        async with httpx.AsyncClient() as h:
            body = {"model": "m", "messages": CHAT, "stream": True}
            res = await h.post(
                gw.url + "/v1/chat/completions", json=body, headers={"traceparent": incoming}
            )
            assert res.status_code == 200
    finally:
        await gw.stop()
        await served.stop()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root = spans["gateway.request"]
    assert root.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    assert root.parent is not None and root.parent.span_id == 0xB7AD6B7169203331
    seq = [spans[n] for n in ("gateway.route", "upstream.prefill", "upstream.decode")]
    for a, b in zip(seq, seq[1:], strict=False):
        assert a.end_time <= b.start_time
    for s in seq:
        assert s.parent.span_id == root.context.span_id
    decode = seq[2]
    assert decode.end_time - decode.start_time >= 0.1e9  # 15 gaps of 10 ms
    attrs = root.attributes
    assert attrs["gateway.replica"] == "127.0.0.1:" + served.url.rsplit(":", 1)[1]
    assert attrs["gateway.pool"] == "chat" and attrs["gateway.outcome"] == "ok"
    assert attrs["gateway.policy"] == "round_robin"
    assert attrs["gateway.config.version"] == 1  # the snapshot the gateway started with
    # the upstream got a traceparent in the same trace, parented on the gateway's root span
    sent = up.headers[0][b"traceparent"].decode()
    assert sent.split("-")[1] == "0af7651916cd43dd8448eb211c80319c"
    assert sent.split("-")[2] == f"{root.context.span_id:016x}"
