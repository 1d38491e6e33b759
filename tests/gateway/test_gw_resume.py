"""A stream that breaks finishes anyway (issue 41, docs/resume.md): simulated replicas answer
token ids as vLLM does (`return_token_ids`), greedy answers are a function of their context, so
a resumed answer must equal the uninterrupted one, id for id."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from gateway import create_app, parse_config
from simulator.fleet import Fleet
from tests.support import poll_until, start_server

MAX = 24


@contextlib.asynccontextmanager
async def resume_rig(
    n: int = 2, tracing: Any = None, **pool: Any
) -> AsyncIterator[tuple[str, Fleet, Any]]:
    """`n` simulated replicas behind a gateway (admin key `k`)."""
    async with Fleet(n=n, speedup=1000.0) as fleet:
        cfg = {"pools": {"chat": {
            "replicas": [{"url": r.url, "name": f"r{i}"} for i, r in enumerate(fleet.replicas)],
            "policy": "round_robin",
            "health": {"interval_s": 0.2, "timeout_s": 0.5},
            "timeouts": {"connect_s": 1, "first_byte_s": 5, "idle_s": 0.4, "total_s": 30},
            **pool,
        }}, "server": {"admin_key": "k"}}  # fmt: skip
        app = create_app(parse_config(cfg), tracing=tracing)
        gw = await start_server(app, lifespan="on")
        try:
            yield gw.url, fleet, app
        finally:
            await gw.stop()


def events(raw: bytes) -> list[Any]:
    out: list[Any] = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: "):
            data = block[6:]
            out.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return out


def answer(evs: list[Any], chat: bool) -> tuple[str, list[int], dict[str, Any] | None]:
    """The text, the token ids (when relayed) and the usage of a stream's events."""
    text, ids, usage = [], [], None
    for e in evs:
        if e == "[DONE]":
            continue
        assert "error" not in e, e
        if e.get("usage"):
            usage = e["usage"]
        for c in e["choices"]:
            text.append((c["delta"].get("content") or "") if chat else c["text"])
            ids.extend(c.get("token_ids") or [])
    return "".join(text), ids, usage


async def fault_all(fleet: Fleet, **f: Any) -> None:
    async with httpx.AsyncClient() as h:
        for r in fleet.replicas:
            assert (await h.post(r.url + "/sim/fault", json=f)).status_code == 200


async def stream(url: str, path: str, body: dict[str, Any]) -> list[Any]:
    async with httpx.AsyncClient(timeout=30) as h, h.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200
        return events(await r.aread())


async def resumes(url: str) -> dict[tuple[str, str], float]:
    async with httpx.AsyncClient() as h:
        text = (await h.get(url + "/metrics")).text
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("gateway_stream_resumes_total{"):
            labels = dict(p.split("=") for p in line[line.index("{") + 1 : line.index("}")].split(","))
            key = (labels["trigger"].strip('"'), labels["outcome"].strip('"'))
            out[key] = out.get(key, 0) + float(line.rsplit(" ", 1)[1])
    return out


def body(chat: bool, model: str, **kw: Any) -> dict[str, Any]:
    shape: dict[str, Any] = (
        {"messages": [{"role": "user", "content": "tell me a story"}]} if chat
        else {"prompt": "once upon a time"}
    )  # fmt: skip
    return {"model": model, **shape, "max_tokens": MAX, "temperature": 0, "stream": True, **kw}


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize(
    ("mode", "trigger"),
    [("die_midstream", "reset"), ("garbage_sse", "malformed"), ("error_midstream", "error_event"),
     ("stall", "idle_timeout")],
)  # fmt: skip
async def test_a_broken_stream_resumes_exactly(chat: bool, mode: str, trigger: str) -> None:
    async with resume_rig() as (url, fleet, _):
        path = "/v1/chat/completions" if chat else "/v1/completions"
        model = fleet.replicas[0].model_name
        whole = await stream(url, path, body(chat, model, stream_options={"include_usage": True},
                                             return_token_ids=True))  # fmt: skip
        want_text, want_ids, want_usage = answer(whole, chat)
        assert len(want_ids) == MAX and want_usage is not None
        await fault_all(fleet, mode=mode, after_chunks=7, count=1)  # every replica, once
        got = await stream(url, path, body(chat, model, stream_options={"include_usage": True},
                                           return_token_ids=True))  # fmt: skip
        text, ids, usage = answer(got, chat)
        assert (text, ids) == (want_text, want_ids)
        assert usage is not None and usage["completion_tokens"] == MAX
        assert usage["prompt_tokens"] == want_usage["prompt_tokens"]
        assert usage["total_tokens"] == want_usage["total_tokens"]
        assert got[-1] == "[DONE]" and len({e["id"] for e in got[:-1]}) == 1
        assert {e["object"] for e in got[:-1]} == {whole[0]["object"]}
        # the second break (the continuation's replica had the fault too) resumed again
        assert (await resumes(url)).get((trigger, "resumed"), 0) >= 1


async def test_ids_are_stripped_unless_asked_and_usage_only_when_asked() -> None:
    async with resume_rig() as (url, fleet, _):
        model = fleet.replicas[0].model_name
        path = "/v1/chat/completions"
        whole = answer(await stream(url, path, body(True, model, return_token_ids=True)), True)
        await fault_all(fleet, mode="die_midstream", after_chunks=5, count=1)
        raw: bytes
        async with httpx.AsyncClient(timeout=30) as h:
            r = await h.post(url + path, json=body(True, model))
            raw = r.content
        assert b"token_ids" not in raw and b'"usage"' not in raw
        text, ids, usage = answer(events(raw), True)
        assert text == whole[0] and ids == [] and usage is None
        first = events(raw)[0]
        assert first["choices"][0]["delta"].get("role") == "assistant"
        roles = [e for e in events(raw)[:-1] if e["choices"][0]["delta"].get("role")]
        assert len(roles) == 1  # the continuation's own role chunk is not relayed


async def test_what_cannot_be_continued_ends_with_one_clear_error() -> None:
    async with resume_rig() as (url, fleet, _):
        model = fleet.replicas[0].model_name
        await fault_all(fleet, mode="die_midstream", after_chunks=5)
        raw = b""
        async with httpx.AsyncClient(timeout=30) as h:
            r = await h.post(url + "/v1/chat/completions",
                             json=body(True, model, logprobs=True, top_logprobs=2))  # fmt: skip
            raw = r.content
        evs = events(raw)
        errors = [e for e in evs if e != "[DONE]" and "error" in e]
        assert len(errors) == 1 and evs[-1] == errors[0]
        assert "not resumed: logprobs" in errors[0]["error"]["message"]
        assert (await resumes(url)).get(("reset", "not_resumable")) == 1


async def test_resume_off_relays_the_break_as_before() -> None:
    async with resume_rig(resume={"enabled": False}) as (url, fleet, _):
        model = fleet.replicas[0].model_name
        await fault_all(fleet, mode="die_midstream", after_chunks=5)
        async with httpx.AsyncClient(timeout=30) as h:
            r = await h.post(url + "/v1/chat/completions", json=body(True, model))
        evs = events(r.content)
        assert "error" in evs[-1] and b"token_ids" not in r.content
        assert await resumes(url) == {}


async def test_sglang_chat_resumes_from_its_text_counted_inexact() -> None:
    """SGLang's chat refuses return_token_ids streamed: the gateway does not ask (resume.engine:
    sglang), and with `from_text` the answer goes on from its text (continue_final_message);
    its completions give ids in vLLM's completions shape and resume exactly."""
    async with resume_rig(resume={"engine": "sglang", "from_text": True}) as (url, fleet, _):
        for r in fleet.replicas:
            r.service.api = "sglang"
        model = fleet.replicas[0].model_name
        want, _, _ = answer(await stream(url, "/v1/chat/completions", body(True, model)), True)
        await fault_all(fleet, mode="die_midstream", after_chunks=6, count=1)
        got, _, _ = answer(await stream(url, "/v1/chat/completions", body(True, model)), True)
        assert got == want  # the stand-in tokenizer re-tokenizes the text to the same ids
        assert (await resumes(url)).get(("reset", "inexact"), 0) >= 1
        want_c = answer(await stream(url, "/v1/completions", body(False, model)), False)[0]
        await fault_all(fleet, mode="die_midstream", after_chunks=6, count=1)
        assert answer(await stream(url, "/v1/completions", body(False, model)), False)[0] == want_c
        assert (await resumes(url)).get(("reset", "resumed"), 0) >= 1


async def test_a_cordoned_replica_hands_its_streams_over() -> None:
    async with resume_rig(n=2) as (url, fleet, app):
        model = fleet.replicas[0].model_name
        long = body(True, model, max_tokens=400, ignore_eos=True)
        want = answer(await stream(url, "/v1/chat/completions", long), True)[0]
        async with httpx.AsyncClient(timeout=30) as h, \
                h.stream("POST", url + "/v1/chat/completions", json=long) as r:  # fmt: skip
            chunks = []
            async for chunk in r.aiter_raw():
                chunks.append(chunk)
                if len(chunks) == 3:
                    rep = next(x for p in app.gateway.pools.values() for x in p.replicas
                               if x.streams)  # fmt: skip
                    drained = await h.post(url + f"/admin/replicas/{rep.name}/drain",
                                           headers={"authorization": "Bearer k"})  # fmt: skip
                    assert drained.json()["handed_over"] == 1
        got = answer(events(b"".join(chunks)), True)[0]
        assert got == want
        assert (await resumes(url)).get(("drain", "resumed")) == 1


async def test_the_log_and_the_trace_show_the_resume(caplog: pytest.LogCaptureFixture) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from gateway.telemetry.logs import AccessLine
    from gateway.telemetry.tracing import Tracing

    caplog.set_level(logging.INFO, logger="gateway.access")
    exporter = InMemorySpanExporter()
    tracing = Tracing(None, exporter=exporter, environ={})
    try:
        async with resume_rig(tracing=tracing) as (url, fleet, _):
            model = fleet.replicas[0].model_name
            await fault_all(fleet, mode="die_midstream", after_chunks=7, count=1)
            await stream(url, "/v1/completions", body(False, model))
            await poll_until(lambda: len(exporter.get_finished_spans()) > 0, 5)
    finally:
        tracing.shutdown()
    line = next(r.msg.fields for r in caplog.records if isinstance(r.msg, AccessLine))
    assert line["outcome"] == "ok" and line["resumes"] == 2 and line["resumed_at"] == 7
    assert line["output_tokens"] == MAX and line["retries"] == 0
    attempts = [dict(s.attributes or {}) for s in exporter.get_finished_spans()
                if s.name == "upstream.attempt"]  # fmt: skip
    assert [a.get("error.type") for a in attempts] == ["broken_mid_stream"] * 2 + [None]
    assert [a.get("gateway.resume.offset") for a in attempts] == [None, 7, 14]


async def test_a_replica_a_reload_removes_hands_its_streams_over() -> None:
    async with resume_rig(n=2) as (url, fleet, app):
        model = fleet.replicas[0].model_name
        long = body(True, model, max_tokens=400, ignore_eos=True)
        want = answer(await stream(url, "/v1/chat/completions", long), True)[0]
        async with httpx.AsyncClient(timeout=30) as h, \
                h.stream("POST", url + "/v1/chat/completions", json=long) as r:  # fmt: skip
            chunks = []
            async for chunk in r.aiter_raw():
                chunks.append(chunk)
                if len(chunks) == 3:
                    gw = app.gateway
                    busy = next(x for x in gw.all_replicas() if x.streams)
                    cfg = gw.config.model_dump()
                    pool = cfg["pools"]["chat"]
                    pool["replicas"] = [rc for rc in pool["replicas"] if rc["name"] != busy.name]
                    await gw.reconfigure(parse_config(cfg))
        assert answer(events(b"".join(chunks)), True)[0] == want
        assert (await resumes(url)).get(("drain", "resumed")) == 1


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
async def test_a_whole_answer_resumes_before_it_is_sent(chat: bool) -> None:
    """`resume.whole`: a non-streamed request is streamed from the engine and answered whole;
    its replica dying mid-answer costs the client nothing (the engine's own answer, same text,
    ids and usage)."""
    async with resume_rig(resume={"whole": True}) as (url, fleet, _):
        model = fleet.replicas[0].model_name
        path = "/v1/chat/completions" if chat else "/v1/completions"
        b = body(chat, model, stream=False, return_token_ids=True)
        async with httpx.AsyncClient(timeout=30) as h:
            direct = (await h.post(fleet.urls[0] + path, json=b)).json()
            await fault_all(fleet, mode="die_midstream", after_chunks=9, count=1)
            got = (await h.post(url + path, json=b)).json()
        key = "message" if chat else "text"
        c, d = got["choices"][0], direct["choices"][0]
        assert (c[key], c["token_ids"], c["finish_reason"]) == (d[key], d["token_ids"], "length")
        assert {k: got["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} \
            == {k: direct["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}  # fmt: skip
        assert got["object"] == direct["object"] and got["id"].startswith(direct["id"][:5])
        assert (await resumes(url)).get(("reset", "resumed"), 0) >= 1
