"""bench/floor_proxy.py, the floor bench.overhead holds the gateway against, really proxies: under
both server layers, and with the gateway's routing unit in front (floor@routed), it returns the
upstream's exact bytes, non-streamed and streamed, over one keep-alive connection, over the
upstream ports (a floor that answered by itself would be a fake measurement); the routed one
parses what it routes, so a body that is no JSON gets no answer from an upstream."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.harness import free_port

ROOT = Path(__file__).resolve().parents[2]
BODY = {"model": "bench-model", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def upstream() -> Iterator[list[int]]:
    up = subprocess.Popen(
        [sys.executable, "-m", "bench.zero_upstream", "--ports", "2", "--chunks", "5"],
        stdout=subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    try:
        assert up.stdout is not None
        yield [int(p) for p in json.loads(up.stdout.readline())["ports"]]
    finally:
        up.terminate()
        up.wait(10)
        if up.stdout is not None:
            up.stdout.close()


LAYERS = {
    "raw": ["--server", "raw"],
    "uvicorn": ["--server", "uvicorn"],
    "routed": ["--server", "uvicorn", "--route", "ttft"],
}


@pytest.mark.parametrize("layer", list(LAYERS))
def test_the_floor_proxy_relays_the_upstream_bytes(layer: str, upstream: list[int]) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.floor_proxy", *LAYERS[layer], "--port", str(port),
         "--upstream", *(f"http://127.0.0.1:{p}" for p in upstream)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        with httpx.Client(timeout=10) as h:
            deadline = time.monotonic() + 20
            while True:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                try:
                    if h.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    assert time.monotonic() < deadline, "the floor proxy did not start"
                    time.sleep(0.05)
            for stream in (False, True):
                body = {**BODY, "stream": stream}
                direct = h.post(f"http://127.0.0.1:{upstream[0]}/v1/chat/completions", json=body)
                for _ in range(4):  # through both upstream ports, one keep-alive connection
                    res = h.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body)
                    assert res.status_code == 200
                    assert res.headers["content-type"] == direct.headers["content-type"]
                    assert res.content == direct.content
                if stream:
                    assert res.content.count(b"data: ") == 5 + 1  # 5 chunks, then [DONE]
                    assert res.content.endswith(b"data: [DONE]\n\n")
            if layer == "routed":
                res = h.post(f"http://127.0.0.1:{port}/v1/chat/completions", content=b"{nope")
                assert res.status_code == 500
    finally:
        proc.terminate()
        proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()
