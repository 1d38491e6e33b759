"""A real `gateway --config` process in front of `bench.zero_upstream`, for the hostile-input tests.

Black-box on purpose: the same uvicorn settings as production, and a process whose RSS and open file
descriptors can be read from /proc.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.support import gateway_process

TENANT_KEY = "sk-fuzz-tenant-3b9e41c7"
ADMIN_KEY = "adm-fuzz-admin-90f2d6aa"
MODEL = "bench-model"
MAX_BODY = 1 << 20


@dataclass
class GatewayProc:
    url: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def raw(
        self, data: bytes, *, read_s: float = 5.0, shut: bool = False, until_close: bool = False
    ) -> bytes:
        """Send raw bytes on a fresh connection; return what the gateway answers: its first whole
        response, or with `until_close` everything until it closes (or `read_s` of silence).
        `shut` half-closes after sending (uvicorn takes that as the client leaving)."""
        return self.exchange(data, read_s=read_s, shut=shut, until_close=until_close)[0]

    def exchange(
        self, data: bytes, *, read_s: float = 5.0, shut: bool = False, until_close: bool = False
    ) -> tuple[bytes, bool]:
        """`raw`, and whether the gateway ended the connection itself (closed or reset it)
        rather than leaving this client to give up after `read_s` of silence."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=read_s) as s:
            try:
                s.sendall(data)
                if shut:
                    s.shutdown(socket.SHUT_WR)
            except OSError:  # the gateway closed early: read what it said
                pass
            out = b""
            try:
                while chunk := s.recv(65536):
                    out += chunk
                    if not until_close and _complete(out):
                        return out, False
            except TimeoutError:
                return out, False
            except ConnectionResetError:
                pass
            return out, True


def _complete(resp: bytes) -> bool:
    head, sep, body = resp.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            return len(body) >= int(v)
        if k.strip().lower() == b"transfer-encoding":
            return body.endswith(b"0\r\n\r\n")
    return False


def status_of(resp: bytes) -> int:
    try:
        return int(resp.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0


def body_of(resp: bytes) -> bytes:
    return resp.partition(b"\r\n\r\n")[2]


def assert_openai_error(status: int, body: bytes, content_type: str = "application/json") -> None:
    """A well-formed gateway error: 4xx, OpenAI-shaped JSON, never a 5xx on input."""
    assert 400 <= status < 500, (status, body[:300])
    assert content_type.startswith("application/json"), content_type
    err = orjson.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)


def fuzz_config(upstream_port: int) -> dict[str, Any]:
    return {
        "server": {
            "max_body_bytes": MAX_BODY,
            "expose_upstream_errors": False,
            "admin_key": ADMIN_KEY,
            "log_level": "warning",
            "body_timeout_s": 2,  # a client that stops sending its body is let go soon
        },
        "pools": {
            "chat": {
                "replicas": [{"url": f"http://127.0.0.1:{upstream_port}", "name": "zero"}],
                "max_inflight_per_replica": 256,
                "health": {"interval_s": 0.5},
                "scrape": {"interval_s": 0.5},
            }
        },
        "tenants": [
            {
                "name": "fuzzer",
                "api_keys": [TENANT_KEY],
                "allowed_priorities": ["interactive", "batch"],
                "limits": {"requests_per_second": 1_000_000, "tokens_per_minute": 1e15},
            }
        ],
    }


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=1.0) as h:
        while time.monotonic() < deadline:
            assert proc.poll() is None, "gateway process exited"
            try:
                if h.get(url + "/ready").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    raise AssertionError("gateway did not become ready")


@pytest.fixture(scope="module")
def zero_upstream() -> Iterator[int]:
    up = subprocess.Popen(
        [sys.executable, "-m", "bench.zero_upstream", "--ports", "1", "--chunks", "4"],
        stdout=subprocess.PIPE,
    )
    try:
        assert up.stdout is not None
        port = int(json.loads(up.stdout.readline())["ports"][0])
        yield port
    finally:
        up.terminate()
        up.wait(10)
        if up.stdout is not None:
            up.stdout.close()


@pytest.fixture(scope="module")
def gw(zero_upstream: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProc]:
    with running_gateway(fuzz_config(zero_upstream), tmp_path_factory.mktemp("gw")) as proc:
        yield proc


@contextlib.contextmanager
def running_gateway(cfg: dict[str, Any], tmp: Path) -> Iterator[GatewayProc]:
    """`gateway serve` for `cfg` in a subprocess, ready; terminated on exit."""
    proc, url = gateway_process(cfg, tmp)
    port = int(url.rsplit(":", 1)[1])
    try:
        _wait_ready(url, proc)
        yield GatewayProc(url, port, proc, tmp / f"gw-{port}.log")
    finally:
        proc.terminate()
        proc.wait(15)
