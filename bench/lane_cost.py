"""What a fast lane of the server protocol saves, in one gateway process: on vs off, alternated.

The gateway answers through `gateway.http_protocol.BodyWriter` where it can: `whole` (a
non-streamed answer in one write), `begin` (a stream's head with its first event), `write` (a
chunk straight to the socket) and `end` (the last chunk and the terminator). Each falls back to
uvicorn's ASGI `send` when it returns False. Here one gateway (its app in this process, as
bench.trace_cost runs it: the protocol, loop and settings `gateway serve` uses, bench.overhead's
config, round robin) is loaded without pause by bench.overhead's closed-loop generator (a child
process, 32 connections; 64-chunk unpaced streams, or non-streamed bodies for `whole`), while
the lane is switched between itself and "always False", window after window. The ratio of CPU
per request, on over off, is taken between neighbouring windows and the median printed. `--lane
none` switches nothing: its ratio is the harness's own noise.

    .venv/bin/python -m bench.lane_cost --lane end          # 16 windows of 2 s, about 40 s
    .venv/bin/python -m bench.lane_cost --lane none         # the noise floor
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from typing import Any

LANES = ("begin", "end", "write", "whole", "none")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.lane_cost", description=__doc__.splitlines()[0])
    p.add_argument("--lane", choices=LANES, required=True)
    p.add_argument("--windows", type=int, default=16, help="windows, half of them with the lane")
    p.add_argument("--window-s", type=float, default=2.0)
    args = p.parse_args(argv)

    import uvloop

    from bench import in_process
    from bench.harness import free_port
    from bench.overhead import gateway_config, policy_variant
    from gateway import create_app, parse_config
    from gateway.transport.protocol import BodyWriter

    def refuse(self: BodyWriter, *a: Any) -> bool:
        return False

    name = args.lane if args.lane != "none" else "whole"
    real = getattr(BodyWriter, name)
    taken = 0  # answers the lane wrote (in the windows it is on)

    def lane(self: BodyWriter, *a: Any) -> bool:
        nonlocal taken
        done: bool = real(self, *a)
        taken += done
        return done
    stream = args.lane not in ("whole", "none")
    gw_cpu, load_cpu = sorted(os.sched_getaffinity(0))[:2]  # as bench.overhead pins them
    os.sched_setaffinity(0, {gw_cpu})
    with in_process.upstream(load_cpu) as started:
        ports, port = started["ports"], free_port()
        cfg = gateway_config(port, ports, started["paced_ports"], policy_variant("round_robin"))
        app = create_app(parse_config(cfg), own_process=True)
        answered = 0

        async def counted(scope: Any, receive: Any, send: Any) -> None:
            nonlocal answered
            await app(scope, receive, send)
            answered += 1

        windows: list[tuple[bool, float, int]] = []  # lane on, CPU seconds, requests

        async def serve() -> None:
            server, task = await in_process.start(counted, port)
            gen = await in_process.load(port, args.windows * args.window_s + 1.5, stream)
            os.sched_setaffinity(gen.pid, {load_cpu})
            await asyncio.sleep(1.0)  # the generator's warm-up, and the first probes
            def switch(on: bool) -> None:
                if args.lane != "none":
                    setattr(BodyWriter, name, lane if on else refuse)

            windows.extend(await in_process.alternate(args.windows, args.window_s, switch,
                                                      lambda: answered))  # fmt: skip
            setattr(BodyWriter, name, real)
            await gen.wait()
            server.should_exit = True
            await task

        uvloop.run(serve())
    on_us, off_us, ratios = in_process.compare(windows)
    kind = "64-chunk streams" if stream else "non-streamed requests"
    print(f"bench.lane_cost: lane {args.lane}, {len(windows)} windows of {args.window_s:g} s, "
          f"{sum(n for _, _, n in windows)} {kind}; gateway CPU per request: lane on "
          f"{on_us:.0f} us, off (ASGI send) {off_us:.0f} us; "
          f"the lane wrote {taken} times")  # fmt: skip
    print(f"  on / off (neighbouring windows, median of {len(ratios)})  "
          f"{statistics.median(ratios):.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
