"""What a streaming client receives is always well-formed SSE: the replica's complete, valid events,
then at most one gateway error event on its own event boundary, then nothing (no `[DONE]`: the
`openai` SDK raises APIError on the error event and a `[DONE]` after it would only tell simpler
clients that the stream completed). Replicas here break framing the ways real ones do: CRLF or CR
line ends, events cut across reads, death or a stall mid-event, bytes that are not UTF-8 or JSON.
"""

from __future__ import annotations

import random

import httpx
import openai
import orjson
import pytest

from gateway.api.streams import StreamTap
from tests.gateway.conftest import rig
from tests.gateway.fake_replica import Upstream

CHAT = [{"role": "user", "content": "hello"}]
BODY = {"model": "m", "messages": CHAT, "stream": True}
NO_TRIP = {"health": {"failures_to_open": 100}}
WORDS = "".join(f"w{i} " for i in range(8))


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=10)


def sse_events(raw: bytes) -> list[bytes]:
    """The data of each event in `raw`, which must end on an event boundary and hold nothing but
    UTF-8 `data:` events whose data is a JSON object or `[DONE]`."""
    text = raw.decode("utf-8")  # a UnicodeDecodeError here is a failure too
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    assert text == "" or text.endswith("\n\n"), f"ends mid-event: {raw[-80:]!r}"
    out = []
    for block in text.split("\n\n")[:-1]:
        lines = [ln for ln in block.split("\n") if ln]
        assert lines and all(ln.startswith("data: ") for ln in lines), f"odd event: {block!r}"
        data = "\n".join(ln[6:] for ln in lines)
        if data != "[DONE]":
            assert isinstance(orjson.loads(data), dict), data
        out.append(data.encode())
    return out


def assert_ends_with_one_error(raw: bytes, good: int) -> None:
    events = sse_events(raw)
    assert len(events) == good + 1, events
    assert all(b'"error"' not in e for e in events[:-1])
    assert orjson.loads(events[-1])["error"]["message"]
    assert b"[DONE]" not in raw


async def stream_raw(url: str, body: dict[str, object] = BODY) -> bytes:
    async with httpx.AsyncClient(timeout=10) as h:
        async with h.stream("POST", url + "/v1/chat/completions", json=body) as res:
            assert res.status_code == 200
            return b"".join([chunk async for chunk in res.aiter_bytes()])


async def sdk_stream_raises_api_error(url: str) -> list[str]:
    """Consume a stream with the SDK; it must raise APIError (not a decode error) at the end."""
    c = client(url)
    got: list[str] = []
    with pytest.raises(openai.APIError):
        stream = await c.chat.completions.create(model="m", messages=CHAT, stream=True)  # type: ignore[arg-type]
        async for ch in stream:
            got.append(ch.choices[0].delta.content or "")
    await c.close()
    return got


# --- a replica dies or stalls in the middle of an event ---------------------------------------------
@pytest.mark.parametrize("mode", ["die_mid_event", "stall_mid_event"])
async def test_broken_mid_event_ends_with_a_separate_error_event(mode: str) -> None:
    up = Upstream(mode, mode=mode)
    timeouts = {"first_byte_s": 5, "idle_s": 0.5, "total_s": 30}
    async with rig([up], pool={**NO_TRIP, "timeouts": timeouts}) as r:
        assert "".join(await sdk_stream_raises_api_error(r.url)) == "w0 w1 "
        raw = await stream_raw(r.url)
        assert_ends_with_one_error(raw, good=2)
        assert b"choi" not in raw.split(b"\n\n")[-2]  # the half event is not relayed


# --- CRLF and bare CR line ends ------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["crlf", "bare_cr"])
async def test_cr_framed_stream_is_relayed_promptly_and_whole(mode: str) -> None:
    up = Upstream(mode, mode=mode, chunk_delay_s=0.25)  # 8 events over 2 s
    async with rig([up]) as r:
        c = client(r.url)
        stream = await c.chat.completions.create(model="m", messages=CHAT, stream=True)  # type: ignore[arg-type]
        ended_before_first: bool | None = None  # had the replica sent its last event?
        chunks = []
        async for ch in stream:
            if ended_before_first is None:
                ended_before_first = up.completed > 0
            chunks.append(ch)
        await c.close()
        # promptly: the first event reached the client while the replica was still sending
        assert ended_before_first is False
        # the usage chunk the gateway asked for is not shown to a client that did not ask
        assert all(ch.choices and ch.usage is None for ch in chunks)
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == WORDS
        up.chunk_delay_s = 0.0  # promptness is shown: the framing checks need no pacing
        raw = await stream_raw(r.url)
        events = sse_events(raw)
        assert events[-1] == b"[DONE]" and not any(b'"error"' in e for e in events)
        assert len(events) == 9
        # asked for: relayed
        asked = {**BODY, "stream_options": {"include_usage": True}}
        events = sse_events(await stream_raw(r.url, asked))
        assert orjson.loads(events[-2])["usage"]["completion_tokens"] == 8


async def test_cr_framed_streams_do_not_count_against_the_replica() -> None:
    up = Upstream("crlf", mode="crlf")
    async with rig([up]) as r:  # failures_to_open: 2
        for _ in range(5):
            raw = await stream_raw(r.url)
            assert b'"error"' not in raw and sse_events(raw)[-1] == b"[DONE]"
        replica = r.gateway.pools["chat"].replicas[0]
        assert replica.circuit.failures == 0 and replica.circuit.state == "closed"
    assert up.completed == 5


# --- garbage from the replica ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("mode", "garbage"), [("garbage_utf8", b"\xff"), ("garbage_json", b"not json")]
)
async def test_invalid_event_is_dropped_and_the_stream_ends_with_an_error(
    mode: str, garbage: bytes
) -> None:
    up = Upstream(mode, mode=mode)
    async with rig([up], pool=NO_TRIP) as r:
        assert "".join(await sdk_stream_raises_api_error(r.url)) == "w0 w1 "
        raw = await stream_raw(r.url)
        assert garbage not in raw
        assert_ends_with_one_error(raw, good=2)


# --- events cut across reads ---------------------------------------------------------------------
async def test_events_split_across_reads_arrive_whole() -> None:
    async with rig([Upstream("split", mode="split")]) as r:
        c = client(r.url)
        stream = await c.chat.completions.create(model="m", messages=CHAT, stream=True)  # type: ignore[arg-type]
        chunks = [ch async for ch in stream]
        await c.close()
        assert all(ch.choices and ch.usage is None for ch in chunks)
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == WORDS
        assert sse_events(await stream_raw(r.url))[-1] == b"[DONE]"


# --- headers ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [True, False])
async def test_only_the_gateways_request_id_reaches_the_client(stream: bool) -> None:
    async with rig([Upstream("echo", mode="echo_request_id")]) as r:
        async with httpx.AsyncClient(timeout=10) as h:
            res = await h.post(
                r.url + "/v1/chat/completions",
                json={**BODY, "stream": stream},
                headers={"x-request-id": "client-rid-1"},
            )
        assert res.status_code == 200
        assert res.headers.get_list("x-request-id") == ["client-rid-1"]
        res_ids = [v for k, v in res.headers.raw if k.lower() == b"x-request-id"]
        assert res_ids == [b"client-rid-1"]


# --- the tap on its own: any cut of the bytes gives the same events ------------------------------
def _stream(sep: bytes, usage: bool, extra: bytes = b"") -> bytes:
    evs = [b'data: {"choices":[{"delta":{"content":"w%d"}}]}' % i for i in range(5)]
    if usage:
        evs.append(b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5}}')
    evs.insert(3, extra) if extra else None
    evs.append(b"data: [DONE]")
    return b"".join(e + sep for e in evs)


def _feed_cut(tap: StreamTap, data: bytes, rng: random.Random) -> bytes:
    out = []
    i = 0
    while i < len(data):
        n = rng.randint(1, 40)
        out.append(bytes(tap.feed(data[i : i + n])))
        i += n
        if tap.broken:
            break
    return b"".join(out)


@pytest.mark.parametrize("sep", [b"\n\n", b"\r\n\r\n", b"\r\r", b"\n\r\n", b"\r\n\n"])
def test_tap_any_cut_gives_the_same_events(sep: bytes) -> None:
    rng = random.Random(7)
    data = _stream(sep, usage=True)
    for strip in (True, False):
        whole = StreamTap(strip_usage=strip)
        ref = bytes(whole.feed(data))
        assert whole.done and not whole.broken
        assert whole.usage == {"prompt_tokens": 3, "completion_tokens": 5}
        assert (b'"usage"' in ref) is not strip
        assert len(sse_events(ref)) == (6 if strip else 7)
        for seed in range(50):
            rng.seed(seed)
            tap = StreamTap(strip_usage=strip)
            out = _feed_cut(tap, data, rng)
            # a CR ending one read may be half a CRLF: the LF after it can come out elsewhere
            assert out == ref if sep == b"\n\n" else sse_events(out) == sse_events(ref), seed
            assert tap.done and tap.usage == whole.usage and not tap.discard()


@pytest.mark.parametrize(
    "bad",
    [
        b'data: {"a":"\xff"}',
        b"data: {nope",
        b"data: [1, 2]",
        b'data: {"a":1}\ndata: {"b":2}',
        b"event: x",
        b": \xff comment",
        b"retry: 5",
    ],
)
def test_tap_stops_at_an_invalid_event(bad: bytes) -> None:
    data = _stream(b"\n\n", usage=False, extra=bad)
    for seed in range(20):
        tap = StreamTap(strip_usage=True)
        out = _feed_cut(tap, data, random.Random(seed))
        assert tap.broken and not tap.done
        assert len(sse_events(out)) == 3 and bad not in out
        assert not tap.feed(b"data: {}\n\n")  # nothing more once broken


def test_tap_passes_comments_and_whole_chunks_through_uncopied() -> None:
    tap = StreamTap(strip_usage=True)
    chunk = b': keep-alive\n\ndata: {"choices":[]}\n\n'
    assert tap.feed(chunk) is chunk
    done = b"data: [DONE]\n\n"
    assert tap.feed(done) is done and tap.done


def test_tap_mixed_line_ends_in_one_stream() -> None:
    seps = [b"\n\n", b"\r\n\r\n", b"\r\r", b"\n\r\n", b"\r\n\n", b"\r\r\n", b"\n\r"]
    evs = [b'data: {"choices":[{"delta":{"content":"w%d"}}]}' % i for i in range(14)]
    data = b"".join(e + seps[i % len(seps)] for i, e in enumerate(evs)) + b"data: [DONE]\n\n"
    want = sse_events(data)
    for seed in range(50):
        tap = StreamTap(strip_usage=True)
        assert sse_events(_feed_cut(tap, data, random.Random(seed))) == want, seed
        assert tap.done and not tap.broken


def test_tap_relays_nothing_after_done_and_holds_no_endless_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tap = StreamTap(strip_usage=False)
    assert tap.feed(b'data: {"a":1}\n\ndata: [DONE]\n\ndata: {"b":2}\n\n') == (
        b'data: {"a":1}\n\ndata: [DONE]\n\n'
    )
    assert tap.feed(b'data: {"c":3}\n\n') == b"" and tap.done
    monkeypatch.setattr("gateway.api.streams.MAX_EVENT_BYTES", 1000)
    tap = StreamTap(strip_usage=False)
    for _ in range(20):
        assert tap.feed(b"data: " + b"x" * 100) == b""
    assert tap.broken and not tap.discard()
