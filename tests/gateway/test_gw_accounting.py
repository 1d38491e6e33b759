"""Every request the gateway accepts gets exactly one answer and one request-log line, whatever
its replicas do: aiohttp, httpx and the OpenAI SDK at their defaults, at once, in front of a
replica that answers, one that answers 503, one that dies mid-stream and one nothing serves. (The
OpenAI SDK without its retries: each of them would be a request of its own, under the same id.)"""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp
import httpx
import openai
import orjson
import pytest

from bench.access_log import access_lines
from bench.harness import free_port
from tests.gateway.fake_replica import Upstream
from tests.gateway.test_gw_keepalive import CHAT, KEY, GatewayThread

pytestmark = pytest.mark.timeout(60)
STREAM = {**CHAT, "stream": True}


def _judge(status: int, body: bytes, stream: bool) -> str:
    """`ok`, `error` (one clear error), or what is wrong with the answer."""
    if status != 200:
        err = orjson.loads(body).get("error", {})
        return "error" if err.get("message") and err.get("type") else f"bad error {body[:80]!r}"
    if not stream:
        return "ok" if orjson.loads(body).get("choices") else f"bad answer {body[:80]!r}"
    events = [e for e in body.decode().split("\n\n") if e]
    if events[-1] == "data: [DONE]":
        return "ok"
    last = orjson.loads(events[-1].removeprefix("data: "))
    return "error" if "error" in last else f"cut stream {body[-80:]!r}"


async def test_every_request_gets_one_answer_and_one_log_line() -> None:
    replicas = [Upstream("ok"), Upstream("busy", mode="error_503"),
                Upstream("dies", mode="die_midstream"), f"http://127.0.0.1:{free_port()}"]  # fmt: skip
    pool = {"retries": 1, "health": {"interval_s": 0.2, "failures_to_open": 100},
            "timeouts": {"connect_s": 1, "first_byte_s": 5, "total_s": 10}}  # fmt: skip
    headers = {"authorization": f"Bearer {KEY}"}
    got: dict[str, tuple[int, str]] = {}
    with access_lines() as lines, GatewayThread({}, replicas, pool) as gw:
        url = gw.url + "/v1/chat/completions"
        async with (
            aiohttp.ClientSession() as session,
            httpx.AsyncClient(timeout=30) as http,  # its default 5 s is short for a busy box
            openai.AsyncOpenAI(api_key=KEY, base_url=gw.url + "/v1", max_retries=0) as sdk,
        ):

            async def one(i: int) -> None:
                rid, stream = f"acct-{i}", i % 2 == 1
                body, h = (STREAM if stream else CHAT), {**headers, "x-request-id": rid}
                if i % 3 == 0:
                    async with session.post(url, json=body, headers=h) as r:
                        got[rid] = (r.status, _judge(r.status, await r.read(), stream))
                elif i % 3 == 1:
                    res = await http.post(url, json=body, headers=h)
                    got[rid] = (res.status_code, _judge(res.status_code, res.content, stream))
                else:
                    try:
                        await sdk.chat.completions.create(**CHAT, extra_headers=h)  # type: ignore[call-overload]
                        got[rid] = (200, "ok")
                    except openai.APIStatusError as exc:
                        got[rid] = (exc.status_code, "error")

            await asyncio.gather(*(one(i) for i in range(90)))
    assert len(got) == 90
    assert {v for _, v in got.values()} <= {"ok", "error"}, got
    logged = Counter(line["request_id"] for line in lines)
    assert all(logged[rid] == 1 for rid in got), {rid: logged[rid] for rid in got if logged[rid] != 1}
    status = {line["request_id"]: line["status"] for line in lines}
    assert all(status[rid] == code for rid, (code, _) in got.items()), (status, got)
    assert Counter(v for _, v in got.values())["error"] > 0  # the faults reached clients
