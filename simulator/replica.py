"""One simulated replica: engine, runner, metrics, faults, and a uvicorn server on its port.

`start()` binds and serves in the running loop; `stop()` kills it the way a crash would.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Generator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import uvicorn

from simulator.app import AppParts, create_app
from simulator.config import EngineConfig, KvEventsOptions
from simulator.engine import Engine, StepResult
from simulator.faults import FaultSwitch
from simulator.metrics import ReplicaMetrics
from simulator.pd import PdOptions, PdService
from simulator.runner import EngineRunner
from simulator.serving import CompletionService
from simulator.stats import EngineCounters
from simulator.tokenizer import ByteTokenizer, Tokenizer

if TYPE_CHECKING:
    from simulator.kv_publisher import KvEventPublisher

START_TIMEOUT_S = 10.0


class Server(uvicorn.Server):
    """A uvicorn server that leaves signal handling to whoever owns the process and stops at
    once on `exit()`: uvicorn's own loop looks at `should_exit` every 0.1 s, so a test that
    started a gateway and three replicas waited 0.4 s for nothing to stop them."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._wake = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    def exit(self, force: bool = False) -> None:
        self.should_exit = True
        self.force_exit = self.force_exit or force
        self._wake.set()

    async def main_loop(self) -> None:
        """uvicorn's: a tick every 0.1 s until one says stop; the wait cut short by `exit()`."""
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864_000
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.1):
                    await self._wake.wait()


async def serve(
    config: uvicorn.Config, startup_s: float = 15.0, *,
    sockets: list[socket.socket] | None = None, name: str | None = None,
) -> tuple[Server, asyncio.Task[None]]:
    """Serve `config` (on `sockets` when given, already bound) in the running loop; returns (the
    server, its task, named `name`) once it listens. Raises when it exits during startup or
    does not start within `startup_s`."""
    server = Server(config)
    task = asyncio.create_task(server.serve(sockets=sockets), name=name)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + startup_s
    while not (server.started or task.done()):  # noqa: ASYNC110 - uvicorn offers no event
        if loop.time() > deadline:
            server.exit()
            await task
            raise RuntimeError(f"the server did not start within {startup_s} s")
        await asyncio.sleep(0.005)
    if task.done():
        task.result()
        raise RuntimeError("the server exited during startup")
    return server, task


def bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class Replica:
    """A vLLM-like server with a simulated GPU behind it; with `kv_events`, it also publishes
    KV cache events over ZMQ (which imports pyzmq and msgspec, the `events` extra)."""

    def __init__(self, config: EngineConfig, *, seed: int = 0, speedup: float = 1.0,
                 served_model_name: str | None = None, host: str = "127.0.0.1",
                 port: int = 0, tokenizer: Tokenizer | None = None,
                 kv_events: KvEventsOptions | None = None, pd: PdOptions | None = None,
                 ) -> None:
        self.config = config
        self.host, self.port = host, port
        self.speedup = speedup
        self.model_name = served_model_name or config.model.name
        self.tokenizer: Tokenizer = tokenizer or ByteTokenizer()
        self.engine = Engine(config, seed=seed, filler_ids=self.tokenizer.filler_ids)
        self.metrics = ReplicaMetrics(self.engine, self.model_name)
        self.runner = EngineRunner(self.engine, speedup=speedup, on_step=self._on_step)
        self.kv_events_options = kv_events
        self.kv_events: KvEventPublisher | None = None
        self.faults = FaultSwitch()
        self.pd = None if pd is None else PdService(
            pd, self.engine, self.runner, host=host, model_name=self.model_name,
            registry=self.metrics.registry)
        self.service = CompletionService(runner=self.runner, tokenizer=self.tokenizer,
                                         model_name=self.model_name, faults=self.faults,
                                         kill_connection=self.kill_connection, pd=self.pd)
        self.app = create_app(self._app_parts())
        self._server: Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._base = EngineCounters()
        self._base_evictions = 0
        self._base_sim_s = 0.0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def _app_parts(self) -> AppParts:
        engine = self.engine
        return AppParts(
            model_name=self.model_name,
            model_root=self.config.model.hf_name or self.model_name,
            max_model_len=self.config.max_model_len, service=self.service,
            tokenizer=self.tokenizer, load=lambda: engine.num_running + engine.num_waiting,
            render_metrics=self.metrics.render, stats=self.stats, reset_stats=self.reset_stats,
            faults=self.faults, cache=engine.cache, kv_publisher=lambda: self.kv_events,
            reset_prefix_cache=self.reset_prefix_cache, lora=engine.lora,
            server_info=self.server_info)

    def server_info(self) -> dict[str, Any]:
        """SGLang's /server_info subset a router reads (disaggregation_mode)."""
        if self.pd is not None:
            return {"model_path": self.model_name, **self.pd.server_info()}
        cfg = self.config
        return {"model_path": self.model_name, "disaggregation_mode": "null",
                "tp_size": cfg.tensor_parallel_size, "dp_size": 1,
                "max_running_requests": cfg.max_num_seqs}

    def _on_step(self, result: StepResult) -> None:
        self.metrics.on_step(result)
        if self.kv_events is not None:
            self.kv_events.flush()  # one batch per step, published after it, as vLLM does

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix (the publisher sends AllBlocksCleared at once)."""
        n = self.engine.cache.reset()
        if self.kv_events is not None:
            self.kv_events.flush()
        return n

    async def start(self) -> None:
        options = self.kv_events_options
        if options is not None:
            from simulator.kv_publisher import KvEventPublisher  # pyzmq only when asked for

            publisher = KvEventPublisher(self.engine.cache, options, host=self.host)
            await publisher.start()
            self.kv_events = publisher
            # the ports it got, so that a restarted replica publishes where this one did
            self.kv_events_options = replace(options, port=publisher.port,
                                             replay_port=publisher.replay_port)
        try:
            sock = bind(self.host, self.port)
        except OSError:
            if self.kv_events is not None:
                await self.kv_events.stop()
            raise
        self.port = sock.getsockname()[1]
        if self.pd is not None:
            await self.pd.start()
        config = uvicorn.Config(self.app, lifespan="off", log_level="warning", access_log=False,
                                ws="none")
        self.runner.start()
        try:  # the socket already listens; the wait only surfaces failures
            self._server, self._task = await serve(
                config, START_TIMEOUT_S, sockets=[sock], name=f"replica-{self.port}")
        except Exception as exc:
            await self.stop()
            raise RuntimeError(f"replica on port {self.port} failed to start: {exc}") from exc

    def kill_connection(self, client: Any) -> None:
        """Abort (RST) the TCP connection of the client at `client` = (host, port)."""
        if self._server is None:
            return
        for conn in list(self._server.server_state.connections):
            if getattr(conn, "client", None) == tuple(client or ()):
                conn.transport.abort()

    async def stop(self) -> None:
        """Die: drop every connection, stop serving, stop the engine. Idempotent."""
        server, task = self._server, self._task
        if server is not None:
            server.exit(force=True)
            for conn in list(server.server_state.connections):
                conn.transport.abort()
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task
            for t in list(server.server_state.tasks if server else ()):
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
        await self.runner.stop()
        if self.pd is not None:
            await self.pd.stop()
        self._task = None
        if self.kv_events is not None:
            await self.kv_events.stop()

    # -- /sim/stats -----------------------------------------------------------------------
    def reset_stats(self) -> None:
        self._base = self.engine.counters.copy()
        self._base_evictions = self.engine.cache.evictions
        self._base_sim_s = self.runner.sim_now()

    def stats(self) -> dict[str, Any]:
        e = self.engine
        d = e.counters.minus(self._base)
        elapsed = max(self.runner.sim_now() - self._base_sim_s, 1e-9)
        return {
            "requests_served": d.requests_served, "requests_received": d.requests_received,
            "requests_aborted": d.requests_aborted, "prompt_tokens": d.prompt_tokens,
            "prefix_hit_tokens": d.cached_prompt_tokens,
            "hit_ratio": d.cached_prompt_tokens / d.prompt_tokens if d.prompt_tokens else 0.0,
            "prefix_query_tokens": d.prefix_queries, "prefix_lookup_hit_tokens": d.prefix_hits,
            "generation_tokens": d.generation_tokens, "preemptions": d.preemptions,
            "steps": d.steps, "busy_time_s": d.busy_time_s, "sim_time_s": elapsed,
            "utilization": min(1.0, d.busy_time_s / elapsed),
            "evicted_blocks": e.cache.evictions - self._base_evictions,
            "running": e.num_running, "waiting": e.num_waiting, "kv_usage": e.kv_usage,
            "cached_blocks": e.cache.num_cached, "num_blocks": e.cache.num_blocks,
            "block_size": e.config.block_size, "model": self.model_name,
            "gpu": e.config.gpu.key, "tensor_parallel_size": e.config.tensor_parallel_size,
            "speedup": self.speedup, "fault": self.faults.state(),
            **({"pd": self.pd.stats()} if self.pd is not None else {}),
        }
