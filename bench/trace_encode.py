"""Encoding a finished trace, in-process: the one pass against build-then-encode, side by side.

The same gateway-shaped traces (the request path's repeating set and measured values, route,
queue and generate segments, one upstream attempt; `--streamed`: prefill and decode, a route
receipt) are encoded both ways, alternating rounds of `--traces` each; the best round of each
is printed, µs per trace, and their ratio. What the export thread does per trace, without the
gateway around it (bench.trace_cost measures that, as operated).

    .venv/bin/python -m bench.trace_encode                 # about 10 s
    .venv/bin/python -m bench.trace_encode --streamed --rounds 20
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from types import MappingProxyType

from gateway.telemetry.otlp import OtlpHttpSink
from gateway.telemetry.trace import Named, RequestTrace
from gateway.telemetry.tracing import Tracing, TracingConfig

MS = 1_000_000
SAME = MappingProxyType({
    "gen_ai.request.model": "m", "gateway.tenant": "t", "gateway.pool": "chat",
    "gateway.retries": 0, "gateway.outcome": "ok", "http.request.method": "POST",
    "url.scheme": "http", "url.path": "/v1/chat/completions", "http.route": "/v1/chat/completions",
    "gateway.replica": "r1", "gateway.policy": "round_robin", "gateway.route.reason": "rr",
    "gateway.config.version": 1, "gateway.replicas_tried": ("r1",), "http.response.status_code": 200,
})  # fmt: skip
ROUTE = {"gateway.route.predicted_cached_tokens": 256, "gateway.route.receipt": "hit"}


def traces(tracing: Tracing, n: int, streamed: bool) -> list[RequestTrace]:
    """`n` finished traces as the request path hands them over (record.py's shapes)."""
    keep = _Keep()
    real, tracing.sink = tracing.sink, keep
    rnd = random.Random(1)
    headers = {b"host": b"127.0.0.1:8080", b"user-agent": b"wrk"}
    for _ in range(n):
        t0 = time.time_ns()
        rt = tracing.start(headers, t0)
        assert rt is not None
        p0 = t0 - rt.epoch_ns(0)
        measured = {
            "gateway.prompt_tokens.estimated": rnd.randrange(400, 700),
            "gateway.prefix.prompt_blocks": rnd.randrange(1, 5),
            "gateway.prefix.predicted_cached_blocks": rnd.randrange(0, 3),
            "gateway.route.hash_us": rnd.randrange(5, 40),
            "gateway.route.match_us": rnd.randrange(1, 9),
            "gateway.route.choose_us": rnd.randrange(1, 9),
            "gen_ai.usage.output_tokens": rnd.randrange(1, 64),
        }
        got: Named = (SAME, measured, ROUTE) if streamed else (SAME, measured)
        first, last = (t0 + 3 * MS, t0 + 9 * MS), (t0 + 9 * MS, t0 + 30 * MS)
        rt.finish(
            route=(t0 + MS, t0 + 2 * MS),
            queue=(t0 + 2 * MS, t0 + 3 * MS),
            prefill=first if streamed else None,
            decode=last if streamed else None,
            generate=None if streamed else (t0 + 3 * MS, t0 + 30 * MS),
            attempts=[("r1", "http://127.0.0.1:8001", p0 + 3 * MS, 0, 200, None)],
            end_ns=t0 + 31 * MS,
            named=got,
        )
    tracing.sink = real
    return keep.traces


class _Keep:
    """A span sink that keeps the finished traces."""

    def __init__(self) -> None:
        self.traces: list[RequestTrace] = []

    def end(self, trace: RequestTrace) -> None:
        self.traces.append(trace)

    def shutdown(self) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.trace_encode", description=__doc__.splitlines()[0])
    p.add_argument("--traces", type=int, default=2000, help="traces per round")
    p.add_argument("--rounds", type=int, default=12, help="rounds of each way, alternating")
    p.add_argument("--streamed", action="store_true", help="streamed traces, with a receipt")
    args = p.parse_args(argv)
    tracing = Tracing(
        TracingConfig(exporter="otlp_http", endpoint="http://127.0.0.1:9"), environ={}
    )
    sink = tracing.sink
    assert isinstance(sink, OtlpHttpSink)
    enc = sink.encoder

    def two_passes(rt: RequestTrace) -> bytes:
        rt.build()
        return enc.built(rt)

    ways: dict[str, Callable[[RequestTrace], bytes]] = {
        "two passes": two_passes,
        "one pass": enc.encode,
    }
    best = dict.fromkeys(ways, float("inf"))
    for _ in range(args.rounds):
        for name, way in ways.items():
            batch = traces(tracing, args.traces, args.streamed)
            t0 = time.perf_counter()
            for rt in batch:
                way(rt)
            best[name] = min(best[name], (time.perf_counter() - t0) / len(batch) * 1e6)
    tracing.shutdown()
    shape = "streamed" if args.streamed else "non-streamed"
    print(f"bench.trace_encode: {shape} traces, best of {args.rounds} rounds of {args.traces}")
    for name, us in best.items():
        print(f"  {name:11s} {us:6.2f} us per trace")
    print(f"  one pass / two passes  {best['one pass'] / best['two passes']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
