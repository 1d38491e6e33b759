"""cProfile of the gateway's event-loop thread at saturation: call counts and own time per request.

py-spy (`bench.overhead --profile`) samples a gateway process from outside and sees coroutine
stacks cut short; this runs the gateway's app in this process (the server protocol, loop and
settings `gateway serve` uses), loads it from a child process with bench.overhead's generator
(closed loop, 32 connections, the same 2 KB chat bodies) over bench.zero_upstream, and profiles
the loop thread during the load; the gateway's config is bench.overhead's. cProfile roughly
doubles the cost of Python code and not that of system calls: read shares and call counts, not
times. With `--tracing`, the export thread's own CPU per span is printed too (its clock, not the
profile).

    .venv/bin/python -m bench.cprofile_gateway --policy round_robin --seconds 6
    .venv/bin/python -m bench.cprofile_gateway --tracing --sort cumulative
    .venv/bin/python -m bench.cprofile_gateway --policy ttft --stream
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import sys
import time
from typing import Any

import orjson


def _load(port: int, seconds: float, stream: bool = False) -> None:
    """The child: bench.overhead's closed-loop generator against `port` (64-chunk unpaced
    streams with `stream`)."""
    import uvloop

    from bench.overhead import MODEL, Load, chat_bodies, http_requests, measure

    async def run() -> None:
        reqs = http_requests(port, chat_bodies(256, stream, MODEL))
        w = await measure(Load("sat", "sat", stream, concurrency=32, seconds=seconds), [port],
                          reqs, {}, 0.5)  # fmt: skip
        print(orjson.dumps({"answers": w.n, "errors": w.errors, "rps": w.rps}).decode(), flush=True)

    uvloop.run(run())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.cprofile_gateway", description=__doc__.splitlines()[0])
    p.add_argument("--policy", default="round_robin")
    p.add_argument("--seconds", type=float, default=6.0, help="profiled load")
    p.add_argument("--sort", default="tottime", help="pstats order: tottime, cumulative, ncalls")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--stream", action="store_true", help="64-chunk unpaced streams (bench.overhead's)")
    p.add_argument("--tracing", action="store_true", help="sampling 1.0, OTLP/HTTP to the upstream")
    p.add_argument("--dump", help="also write the raw profile here (pstats, snakeviz)")
    p.add_argument("--load-port", type=int, help=argparse.SUPPRESS)  # the child's side
    p.add_argument("--load-stream", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.load_port is not None:
        _load(args.load_port, args.seconds, args.load_stream)
        return 0

    import uvloop

    from bench import in_process
    from bench.harness import free_port
    from bench.overhead import gateway_config, policy_variant, traced
    from gateway import create_app, parse_config
    from gateway.telemetry.otlp import OtlpHttpSink

    thread_cpu: list[tuple[int, float]] = []
    if args.tracing:  # the export thread's own clock: traces taken and CPU spent
        run = OtlpHttpSink._run

        def timed(self: OtlpHttpSink) -> None:
            try:
                run(self)
            finally:
                thread_cpu.append((self._taken, time.thread_time()))

        OtlpHttpSink._run = timed  # type: ignore[method-assign]

    with in_process.upstream() as started:
        ports, port = started["ports"], free_port()
        variant = policy_variant(args.policy)  # bench.overhead's config: its load goes to `zero`
        if args.tracing:  # the upstream's /v1/traces is an OTLP/HTTP sink
            variant = traced(variant, f"http://127.0.0.1:{ports[0]}")
        cfg = gateway_config(port, ports, started["paced_ports"], variant)
        app = create_app(parse_config(cfg), own_process=True)
        prof = cProfile.Profile()
        result: dict[str, Any] = {}

        async def serve() -> None:
            server, task = await in_process.start(app, port)
            await asyncio.sleep(2.0)  # the first probes and scrapes
            gen = await in_process.load(port, args.seconds, args.stream)
            assert gen.stdout is not None
            await asyncio.sleep(0.5)  # the generator's warm-up
            prof.enable()
            out = await gen.stdout.read()
            prof.disable()
            await gen.wait()
            result.update(orjson.loads(out.splitlines()[-1]))
            server.should_exit = True
            await task

        uvloop.run(serve())
    answers = max(1, int(result.get("answers", 0)))
    if args.dump:
        prof.dump_stats(args.dump)
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats(args.sort).print_stats(args.top)
    print(f"bench.cprofile_gateway: policy {args.policy}, tracing {'on' if args.tracing else 'off'}; "
          f"{answers} answers in the {args.seconds:g} s window ({result.get('rps', 0):.0f}/s, "
          f"{result.get('errors', 0)} errors); the profile spans the generator's warm-up too; "
          f"a coroutine's ncalls counts its resumptions")  # fmt: skip
    for spans, cpu in thread_cpu:
        print(f"export thread: {spans} spans exported, {cpu:.2f} s of its CPU, "
              f"{1e6 * cpu / max(1, spans):.1f} us per span")  # fmt: skip
    print(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
