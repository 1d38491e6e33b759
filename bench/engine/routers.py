"""The routers compared in front of a real fleet, each its own process on a loopback port.

    with start_router("sglang-cache_aware", fleet, log_dir) as url: ...   # http://127.0.0.1:P

- `sglang-cache_aware`, `sglang-round_robin`: sglang-router 0.3.2 (`python -m
  sglang_router.launch_router --worker-urls ... --policy P`), its defaults otherwise.
- `vllm-kv_aware`: vllm-router 0.1.17 `--policy kv_aware`, each replica's KV events and replay
  socket (`--kv-event-source URL=tcp://...`, `--kv-event-replay-source`), the engines' 32-token
  blocks and the model's name; `vllm-cache_aware`: its `cache_aware`.
- `gateway`: this project as shipped (`gateway serve`, the default policy and bytes mode; the
  only keys set are the replicas and the CPU's deadlines, as for every engine test: a CPU
  prefills ~1K tokens a second, no GPU-sized first-byte deadline); `gateway-precise`: the same
  with tokens mode (the model's tokenizer) and the engines' KV events; `gateway-terms`: as
  shipped with the TTFT score's opt-in terms on (`load_s`, `kv_s`) and the recompute priced
  by the target's load, as first tried; `gateway-recompute`: the recompute priced by the load of the replica that would redo
  it (`recompute_load: true`); `gateway-recompute-fleet`: as shipped, spelled out
  (`recompute_load: fleet`); `gateway-latency`: the latency-only score (`recompute: 0`, the
  default before issue 43).

Both peers install from PyPI into the engine's venv (`scripts/engine-requirements.txt`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.engine.fleet import BLOCK_SIZE, EngineFleet, engine_python
from bench.harness import free_port

ROUTERS = ("sglang-cache_aware", "sglang-round_robin", "vllm-kv_aware", "vllm-cache_aware",
           "gateway", "gateway-precise")  # fmt: skip
# the default policy with the opt-in terms of its TTFT score on (the engine's load, KV pressure,
# the fleet's recompute: issue 43 item 2): not in the default comparison, named with --routers
TERMS = "gateway-terms"
TTFT_TERMS = {"scorers": {"ttft": {"weight": 1, "load_s": 0.01, "kv_s": 0.05, "recompute": 1.0,
                                   "recompute_load": True}},
              "picker": "max_score", "guard": False}  # fmt: skip
# the default policy with the fleet's recompute priced otherwise: by the load of the replica that
# would redo it (`gateway-recompute`), not at all (`gateway-latency`: the latency-only score, the
# default before issue 43), or as the default does, by the fleet's load, spelled out
# (`gateway-recompute-fleet`, kept so the commands of earlier runs still run); named with --routers
VARIANTS = {
    TERMS: TTFT_TERMS,
    "gateway-recompute": {"scorers": {"ttft": {"weight": 1, "recompute": 1.0,
                                               "recompute_load": True}},
                          "picker": "max_score", "guard": False},
    "gateway-recompute-fleet": {"scorers": {"ttft": {"weight": 1, "recompute": 1.0,
                                                     "recompute_load": "fleet"}},
                                "picker": "max_score", "guard": False},
    "gateway-latency": {"scorers": {"ttft": {"weight": 1, "recompute": 0.0}},
                        "picker": "max_score", "guard": False},
}  # fmt: skip
BASE = "@base"  # a gateway router's name + this: run from another tree of the project
READY_TIMEOUT_S = 60.0
CPU_TIMEOUTS = {"first_byte_s": 300, "idle_s": 120, "total_s": 600}


def gateway_config(fleet: EngineFleet, precise: bool, **pool: Any) -> dict[str, Any]:
    """The gateway's config in front of `fleet`: as shipped, or precise (tokens + KV events)."""
    replicas: list[dict[str, Any]] = []
    for i, m in enumerate(fleet.members):
        rc: dict[str, Any] = {"url": m.url, "name": f"r{i}"}
        if precise:
            rc["kv_events"], rc["kv_events_replay"] = m.kv_events
        replicas.append(rc)
    config: dict[str, Any] = {
        "pools": {"chat": {"replicas": replicas, "timeouts": dict(CPU_TIMEOUTS), **pool}}
    }
    if precise:
        config["index"] = {
            "chunking": {"mode": "tokens", "tokenizer": str(fleet.model_dir),
                         "block_size": BLOCK_SIZE},
            "events": {"enabled": True},
        }  # fmt: skip
    return config


def command(name: str, fleet: EngineFleet, port: int, tmp: Path) -> list[str]:
    urls = fleet.urls
    engine = str(engine_python())
    if name.startswith("sglang-"):
        return [engine, "-m", "sglang_router.launch_router", "--worker-urls", *urls,
                "--policy", name.split("-", 1)[1], "--host", "127.0.0.1", "--port", str(port),
                "--log-level", "warn"]  # fmt: skip
    if name.startswith("vllm-"):
        cmd = [str(Path(engine).parent / "vllm-router"), "--worker-urls", *urls,
               "--policy", name.split("-", 1)[1], "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "warning"]  # fmt: skip
        if name == "vllm-kv_aware":
            for m in fleet.members:
                pub, replay = m.kv_events
                cmd += ["--kv-event-source", f"{m.url}={pub}",
                        "--kv-event-replay-source", f"{m.url}={replay}"]  # fmt: skip
            cmd += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", fleet.model]
        return cmd
    if name in ("gateway", "gateway-precise", *VARIANTS):
        path = tmp / f"{name}.yaml"  # JSON is YAML
        pool = {"policy": VARIANTS[name]} if name in VARIANTS else {}
        path.write_text(json.dumps(gateway_config(fleet, name == "gateway-precise", **pool)))
        return [sys.executable, "-m", "gateway", "serve", "--config", str(path),
                "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]  # fmt: skip
    raise ValueError(f"unknown router {name!r}; one of {ROUTERS}")


def ready(url: str) -> bool:
    """The router answers /v1/models (sglang-router: 503 until a worker is healthy; it names
    the model `unknown` when the worker has no /model_info, and routes `tiny` all the same)."""
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=2) as res:
            return bool(res.status == 200)
    except (OSError, urllib.error.URLError):
        return False


class Started:
    """A running router: its URL, and the CPU seconds its process has used (`cpu_s()`)."""

    def __init__(self, url: str, pid: int) -> None:
        self.url, self.pid = url, pid

    def cpu_s(self) -> float:
        """User + system CPU seconds of the router's process so far (Linux /proc; 0 elsewhere):
        on a CPU fleet, what it took from the engines."""
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def start_router(
    name: str, fleet: EngineFleet, log_dir: Path, base_src: Path | None = None
) -> Iterator[Started]:
    """Start router `name` in front of `fleet`; yields it once it answers /v1/models. A name
    ending in `@base` is that gateway router run from the tree at `base_src` (an A/B of two
    trees of this project in one run)."""
    port = free_port()
    log = log_dir / f"router-{name}-{port}.log"
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "none", "RUST_LOG": "warn"}
    cwd = None
    if name.endswith(BASE):
        if base_src is None:
            raise ValueError(f"{name}: no tree to run it from (base_src)")
        name, cwd = name.removesuffix(BASE), base_src
        env["PYTHONPATH"] = str(base_src)
    with open(log, "ab") as out:
        proc = subprocess.Popen(command(name, fleet, port, log_dir), stdout=out, cwd=cwd,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"router {name} did not start:\n{tail}")
            time.sleep(0.2)
        yield Started(url, proc.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)
