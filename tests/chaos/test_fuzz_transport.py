"""Hostile HTTP at the transport level, on raw sockets against a real gateway process: bodies that lie
about their length, header floods, odd bytes in headers, slowloris clients. The gateway answers
each with a well-formed OpenAI-shaped error (also what the HTTP server layer refuses before the
app sees a request: 400, 408, 431), never a 5xx, and stays responsive for everybody else.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.transport.protocol import HEADER_TIMEOUT_S
from tests.chaos.conftest import (
    MODEL,
    TENANT_KEY,
    GatewayProc,
    assert_openai_error,
    body_of,
    status_of,
)

BODY = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello"}]})
AUTH = f"authorization: Bearer {TENANT_KEY}\r\n".encode()


def request(body: bytes = BODY, *, extra: bytes = b"", length: bytes | None = None) -> bytes:
    cl = str(len(body)).encode() if length is None else length
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n" + AUTH
        + b"content-type: application/json\r\ncontent-length: " + cl + b"\r\n" + extra + b"\r\n"
        + body
    )  # fmt: skip


def well_formed(resp: bytes) -> None:
    """Every answer on the connection: a 2xx or an OpenAI-shaped error (the HTTP parser's 400
    too)."""
    rest = resp
    while rest:
        status = status_of(rest)
        head = rest.partition(b"\r\n\r\n")[0].lower()
        assert status and status < 500, rest[:300]
        if status >= 400:
            assert b"content-type: application/json" in head, rest[:300]
            length = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
            body = body_of(rest)[:length]
            assert_openai_error(status, body)
        nxt = rest.find(b"HTTP/1.1 ", 1)
        rest = rest[nxt:] if nxt > 0 else b""


@pytest.fixture(scope="module")
def stale_clients(gw: GatewayProc) -> Iterator[tuple[float, list[socket.socket]]]:
    """Opened first, checked by the last test: connections that never finish a request."""
    idle = socket.create_connection(("127.0.0.1", gw.port))
    half_head = socket.create_connection(("127.0.0.1", gw.port))
    half_head.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n")
    half_body = socket.create_connection(("127.0.0.1", gw.port))
    half_body.sendall(request(BODY[:10], length=b"1000"))
    socks = [idle, half_head, half_body]
    yield time.monotonic(), socks
    for s in socks:
        s.close()


def test_normal_request_works(gw: GatewayProc, stale_clients: object) -> None:
    resp = gw.raw(request())
    assert status_of(resp) == 200, resp[:300]


# --- bodies that lie about their length --------------------------------------------------------


def test_content_length_shorter_than_the_body(gw: GatewayProc) -> None:
    resp = gw.raw(request(length=b"10"), read_s=3, until_close=True)
    assert status_of(resp) == 400, resp[:300]  # 10 bytes of JSON, then junk as the next request
    well_formed(resp)


def test_content_length_longer_than_the_body_then_eof(gw: GatewayProc) -> None:
    """The client half-closes before the promised body is in: the gateway lets it go itself, on
    the EOF, not when the module's body timeout (2 s) answers 408."""
    resp, ended = gw.exchange(request(length=b"5000"), read_s=5, shut=True)
    assert ended and status_of(resp) != 408, "the gateway kept a half-closed client waiting"
    well_formed(resp)


@pytest.mark.parametrize(
    "length",
    [b"abc", b"-5", b"1e3", b"99999999999999999999999", b" 12", b"0x10", b"12, 12"],
    ids=lambda b: b.decode(),
)
def test_malformed_content_length(gw: GatewayProc, length: bytes) -> None:
    well_formed(gw.raw(request(length=length), read_s=3, until_close=True))


def test_duplicate_content_lengths_disagreeing(gw: GatewayProc) -> None:
    well_formed(gw.raw(request(extra=b"content-length: 3\r\n"), read_s=3, until_close=True))


def test_content_length_and_chunked_together(gw: GatewayProc) -> None:
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)
    data = request(chunked, length=b"4", extra=b"transfer-encoding: chunked\r\n")
    well_formed(gw.raw(data, read_s=3, until_close=True))


def test_chunked_body(gw: GatewayProc) -> None:
    data = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n" + AUTH
        + b"transfer-encoding: chunked\r\n\r\n"
        + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (BODY[:7], BODY[7:]))
        + b"0\r\n\r\n"
    )  # fmt: skip
    resp = gw.raw(data, read_s=3)
    assert status_of(resp) == 200, resp[:300]


def test_chunk_size_lies(gw: GatewayProc) -> None:
    data = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n" + AUTH
        + b"transfer-encoding: chunked\r\n\r\nffffffffffffffff\r\n" + BODY
    )  # fmt: skip
    resp, ended = gw.exchange(data, read_s=3, shut=True)  # kept open it is a slow client: below
    assert ended and status_of(resp) != 408, "the gateway waited out the body timeout"
    well_formed(resp)


def test_declared_length_over_the_limit_is_refused_unread(gw: GatewayProc) -> None:
    resp = gw.raw(request(length=b"%d" % (64 << 20)), read_s=3)
    assert status_of(resp) == 413, resp[:300]
    well_formed(resp)


# --- headers -------------------------------------------------------------------------------------


header_bytes = st.binary(min_size=1, max_size=200).filter(
    lambda b: not any(c in b for c in b"\r\n\x00") and b.strip() == b
)


@settings(
    max_examples=120,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
@given(
    name=st.sampled_from(
        [b"x-priority", b"x-request-id", b"x-session-id", b"authorization", b"traceparent",
         b"tracestate", b"x-gateway-explain", b"content-type", b"host", b"x-\xff"]
    ),
    value=header_bytes,
)  # fmt: skip
def test_odd_bytes_in_headers(gw: GatewayProc, name: bytes, value: bytes) -> None:
    hdrs = (b"authorization: " + value + b"\r\n") if name == b"authorization" else b""
    if name != b"authorization":
        hdrs = AUTH + name + b": " + value + b"\r\n"
    data = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n" + hdrs
        + b"content-length: %d\r\n\r\n" % len(BODY) + BODY
    )  # fmt: skip
    well_formed(gw.raw(data, read_s=5))


def test_many_small_headers_within_reason(gw: GatewayProc) -> None:
    extra = b"".join(b"x-h%d: %d\r\n" % (i, i) for i in range(200))
    assert status_of(gw.raw(request(extra=extra))) == 200


FLOODS = {
    "10k headers": b"".join(b"x-flood-%d: %s\r\n" % (i, b"a" * 90) for i in range(10_000)),
    "one 1 MiB header": b"x-flood: " + b"a" * (1 << 20) + b"\r\n",
}


@pytest.mark.parametrize("flood", list(FLOODS), ids=list(FLOODS))
def test_header_flood_is_refused(gw: GatewayProc, flood: str) -> None:
    resp = gw.raw(request(extra=FLOODS[flood]), read_s=5)
    # refused with a 431 the client reads (the server reads on, dropping, until it is done)
    assert status_of(resp) == 431, resp[:200]
    well_formed(resp)


# what the HTTP server layer answers itself, before any app sees a request (issue 39): each an
# OpenAI-shaped JSON error with its status, read whole by the client that sent it
SERVER_ANSWERS = {
    "a 200 KB header": (request(extra=b"x-big: " + b"a" * 200_000 + b"\r\n"), 431),
    "100 headers of 8 KB": (
        request(extra=b"".join(b"x-h%d: %s\r\n" % (i, b"a" * 8192) for i in range(100))), 431
    ),
    "a 200 KB request line": (b"GET /" + b"a" * 200_000 + b" HTTP/1.1\r\nhost: gw\r\n\r\n", 431),
    "broken chunked encoding": (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n" + AUTH
        + b"transfer-encoding: chunked\r\n\r\nzz\r\n" + BODY + b"\r\n0\r\n\r\n",
        400,
    ),
    "an invalid request line": (b"NOT AN HTTP REQUEST\r\n\r\n", 400),
    "an HTTP/2 preface": (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400),
    "a header without a colon": (b"GET /health HTTP/1.1\r\nhost gw\r\n\r\n", 400),
}  # fmt: skip


@pytest.mark.parametrize("case", list(SERVER_ANSWERS), ids=list(SERVER_ANSWERS))
def test_what_the_server_refuses_itself_is_an_openai_error(gw: GatewayProc, case: str) -> None:
    data, status = SERVER_ANSWERS[case]
    resp = gw.raw(data, read_s=5)
    assert status_of(resp) == status, resp[:300]
    head, _, body = resp.partition(b"\r\n\r\n")
    assert b"\r\ncontent-type: application/json" in head.lower(), head
    assert b"\r\nconnection: close" in head.lower(), head
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    assert len(body) == length, resp[:300]
    assert_openai_error(status, body)
    assert (
        orjson.loads(body)["error"]["code"]
        in {400: ("invalid_http_request",), 431: ("request_header_fields_too_large",)}[status]
    )


def test_gateway_serves_others_after_floods(gw: GatewayProc) -> None:
    for flood in FLOODS.values():
        gw.raw(request(extra=flood), read_s=5)
    assert status_of(gw.raw(request())) == 200
    assert gw.alive()


# --- slow clients ------------------------------------------------------------------------------


def test_slowloris_does_not_starve_other_clients(gw: GatewayProc) -> None:
    base_fds = gw.fds()
    slow: list[socket.socket] = []
    try:
        for i in range(300):
            s = socket.create_connection(("127.0.0.1", gw.port))
            if i % 3 == 0:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\nx-a: ")
            elif i % 3 == 1:
                s.sendall(request(BODY[:5], length=b"100000"))  # body promised, never sent
            slow.append(s)
        for s in slow[::2]:  # trickle one more byte, the slowloris way
            s.sendall(b"a")
        # every normal request is served beside them, each within the client's 5 s timeout (no
        # tighter wall-clock bound here: this machine is shared, and speed claims live in bench/)
        with httpx.Client(base_url=gw.url, timeout=5) as h:
            for _ in range(40):
                res = h.post(
                    "/v1/chat/completions",
                    content=BODY,
                    headers={"authorization": f"Bearer {TENANT_KEY}"},
                )
                assert res.status_code == 200
        assert (
            gw.fds() >= base_fds + 200
        )  # most slow ones were held open (the header deadline may drop some)
    finally:
        for s in slow:
            s.close()
    deadline = time.monotonic() + 5
    while gw.fds() > base_fds + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gw.fds() <= base_fds + 2, "connections of departed slow clients were not released"


def test_clients_that_never_finish_a_request_are_dropped(
    gw: GatewayProc, stale_clients: tuple[float, list[socket.socket]]
) -> None:
    """Opened when the module started: by now the header deadline (and the module's 2 s body
    timeout) has passed, so each got a 408 or was closed."""
    opened, socks = stale_clients
    time.sleep(max(0.0, opened + HEADER_TIMEOUT_S + 1.0 - time.monotonic()))
    still_open = []
    for name, s in zip(("idle", "half headers", "half body"), socks, strict=True):
        s.settimeout(0.5)
        try:
            data = s.recv(4096)
            if data and not data.startswith(b"HTTP/1.1 408"):
                still_open.append(f"{name}: answered {data[:40]!r}")
            elif data:  # the header deadline's 408 is an OpenAI-shaped error too (issue 39)
                head, _, body = data.partition(b"\r\n\r\n")
                assert b"content-type: application/json" in head.lower(), data[:300]
                assert_openai_error(408, body)
        except TimeoutError:
            still_open.append(name)
        except ConnectionResetError:
            pass
    assert not still_open, f"still held after {HEADER_TIMEOUT_S + 1:g} s: {still_open}"
