"""The request log (`gateway.access`) through real sockets: one line per finished request with
its fields, sampling, the per-tenant switch, JSON without ANSI, and never a prompt or a key."""

from __future__ import annotations

import logging
import re
from typing import Any

import httpx
import orjson
import pytest

from gateway.telemetry.logs import AccessLine, JsonFormatter
from tests.gateway.conftest import rig
from tests.gateway.fake_replica import Upstream
from tests.support import poll_until

KEY_A, KEY_B = "k-team-a-SECRETKEY-0001", "k-team-b-SECRETKEY-0002"
PROMPT = "PROMPT-MARKER-do-not-log"
CHAT = {"model": "test-model", "messages": [{"role": "user", "content": PROMPT}]}
TENANTS = [
    {"name": "team-a", "api_keys": [KEY_A]},
    {"name": "team-b", "api_keys": [KEY_B], "request_log": False},
]
FIELDS = ["request_id", "tenant", "model", "pool", "replica", "status", "outcome", "error_type",
          "stream", "priority", "prompt_tokens", "predicted_cached_tokens", "cached_tokens", "output_tokens", "queue_s",
          "ttft_s", "total_s", "retries", "policy", "reason", "resumes", "resumed_at", "resume_gap_s"]  # fmt: skip


def lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [dict(r.msg.fields) for r in caplog.records if isinstance(r.msg, AccessLine)]


async def post(url: str, key: str, body: Any = CHAT, **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=15) as h:
        return await h.post(
            url + "/v1/chat/completions", json=body,
            headers={"authorization": f"Bearer {key}", **headers},
        )  # fmt: skip


async def test_one_line_per_request_with_its_fields(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway.access")
    ups = [Upstream("a"), Upstream("b", mode="error_500")]
    pool = {"health": {"failures_to_open": 1000}}
    async with rig(ups, dead=1, pool=pool, extra={"tenants": TENANTS}) as r:
        for i in range(4):  # round robin over a, b, dead0
            await post(r.url, KEY_A, {**CHAT, "stream": i == 0}, **{"x-request-id": f"req-{i}"})
        await post(r.url, "k-wrong-key")  # refused before any pool: still one line
        await post(r.url, KEY_B)  # team-b is not logged
    got = lines(caplog)
    assert len(got) == 5, got
    for line in got:
        assert list(line) == FIELDS
    by_id = {line["request_id"]: line for line in got}
    ok = by_id["req-0"]
    assert ok["tenant"] == "team-a" and ok["model"] == "test-model" and ok["pool"] == "chat"
    assert (ok["replica"], ok["status"], ok["outcome"], ok["error_type"]) == ("a", 200, "ok", None)
    assert ok["stream"] is True and ok["priority"] == "interactive"
    assert ok["queue_s"] >= 0 and 0 < ok["ttft_s"] <= ok["total_s"] and ok["retries"] == 0
    assert ok["policy"] == "round_robin" and ok["reason"]
    failed = by_id["req-1"]
    assert (failed["replica"], failed["status"], failed["outcome"]) == ("b", 500, "upstream_error")
    assert failed["error_type"] == "server_error" and failed["ttft_s"] is None
    dead = by_id["req-2"]  # dead0 refused the connection, then the next replica answered
    assert dead["retries"] >= 1 and dead["status"] in (200, 500)
    plain = [line for line in got if line["replica"] == "a" and not line["stream"]]
    assert plain and plain[0]["prompt_tokens"] == 5 and plain[0]["output_tokens"] == 8  # usage
    refused = [line for line in got if line["status"] == 401]
    assert refused and refused[0]["error_type"] == "authentication_error"
    assert refused[0]["replica"] == "none" and refused[0]["queue_s"] is None


async def test_sampling_and_a_level_above_info_leave_lines_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.access")
    for sample, n, low, high in ((0, 10, 0, 0), (0.5, 60, 1, 59), (1, 10, 10, 10)):
        caplog.clear()
        extra = {"tenants": TENANTS, "server": {"request_log": {"sample": sample}}}
        async with rig([Upstream("a")], extra=extra) as r:
            for _ in range(n):
                await post(r.url, KEY_A)
        assert low <= len(lines(caplog)) <= high, (sample, len(lines(caplog)))
    caplog.clear()
    caplog.set_level(logging.WARNING, logger="gateway.access")
    async with rig([Upstream("a")], extra={"tenants": TENANTS}) as r:
        await post(r.url, KEY_A)
    assert lines(caplog) == []


async def test_json_and_text_lines_hold_no_prompt_key_or_ansi(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.access")
    async with rig([Upstream("a")], extra={"tenants": TENANTS}) as r:
        await post(r.url, KEY_A)
        await post(r.url, KEY_A, {**CHAT, "stream": True})
        await post(r.url, KEY_A, {**CHAT, "model": "evil\nmodel \x1b[31m forged=1"})
        await post(r.url, KEY_B)
    records = [r for r in caplog.records if isinstance(r.msg, AccessLine)]
    assert len(records) == 3
    as_json = JsonFormatter()
    as_text = logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    for rec in records:
        out = [as_json.format(rec), as_text.format(rec)]
        for text in out:
            assert PROMPT not in text and "SECRETKEY" not in text and "\n" not in text
            assert "\x1b" not in text
        obj = orjson.loads(out[0])
        assert obj["logger"] == "gateway.access" and obj["msg"] == "request"
        assert obj["level"] == "info" and list(obj)[4:] == FIELDS
        assert out[1].split(": ", 1)[1].startswith("request request_id=")
    forged = as_text.format(records[2])
    assert '"evil\\nmodel \\u001b[31m forged=1"' in forged  # quoted: no line or field forged


def test_json_drops_uvicorns_color_message() -> None:
    record = logging.makeLogRecord({
        "name": "uvicorn.error", "levelno": logging.INFO, "levelname": "INFO",
        "msg": "Started server process [%d]", "args": (7,),
        "color_message": "Started server process [\x1b[36m%d\x1b[0m]",
    })  # fmt: skip
    obj = orjson.loads(JsonFormatter().format(record))
    assert obj["msg"] == "Started server process [7]" and "color_message" not in obj
    record.msg, record.args = "\x1b[32mINFO\x1b[0m: ready", ()
    assert orjson.loads(JsonFormatter().format(record))["msg"] == "INFO: ready"


async def test_the_log_handler_writes_lines_in_batches() -> None:
    """A line per request is cheap: lines wait for a batch (256 lines, a warning, the delay
    after the first one, or close) instead of a write and a flush each; none is lost or
    reordered."""
    import io

    from gateway.telemetry.logs import BatchedStreamHandler, TextFormatter

    def record(msg: str, level: int = logging.INFO) -> logging.LogRecord:
        return logging.makeLogRecord({"msg": msg, "levelno": level, "levelname": "X", "name": "t"})

    out = io.StringIO()
    slow = BatchedStreamHandler(out, delay_s=30.0)  # the timer will not fire in this test
    slow.setFormatter(logging.Formatter("%(message)s"))
    for i in range(3):
        slow.handle(record(f"a{i}"))
    assert out.getvalue() == ""  # waiting for the batch
    slow.handle(record("w", logging.WARNING))  # a warning: everything waiting, then it
    assert out.getvalue() == "a0\na1\na2\nw\n"
    for i in range(BatchedStreamHandler.MAX_LINES):
        slow.handle(record(f"b{i}"))
    assert out.getvalue().count("\n") == 4 + BatchedStreamHandler.MAX_LINES  # a full batch
    slow.handle(record("last"))
    slow.close()  # close writes what waits
    assert out.getvalue().endswith("b255\nlast\n")

    out = io.StringIO()
    quick = BatchedStreamHandler(out, delay_s=0.05)
    quick.setFormatter(TextFormatter())
    quick.handle(record("c"))
    await poll_until(lambda: out.getvalue() != "", 10)  # the timer wrote it
    stamp = logging.Formatter().formatTime(record("c"))  # logging's own asctime format
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} X       t: c\n", out.getvalue())
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}", stamp)
    quick.close()
