"""What tracing every request costs, measured the way an operator runs it: two gateways, one core.

Two gateways are started through the CLI (`gateway --config ...`, as `gateway serve` runs) and
pinned to the same core (`taskset`): the same config as bench.overhead's, with the request log on
as shipped (log_level info, text), one untraced and one with `tracing: {exporter: otlp_http,
sampling_ratio: 1.0}` exporting to a collector that is a process of its own
(bench.zero_upstream's `/v1/traces` sink, on the other core, as are the replicas and this load
generator). The load is bench.overhead's closed-loop generator (wrk-like: 32 keep-alive
connections, 2 KB chat bodies, non-streamed), aimed at one gateway at a time, window after
window, A B A B ... Each gateway's CPU (every thread: the event loop, the export thread) is read
at every window's start, so a gateway's period runs from the start of its window to the start
of its next one, and counts the export work its window left behind (a batch of spans, the
schedule's 5 s flush) wherever it ran. The ratio of CPU per request, traced over untraced, is
taken between neighbouring periods and its median printed: the issue's goal is <= 1.15x.

    .venv/bin/python -m bench.trace_cost                    # 16 windows of 3 s, about 60 s
    .venv/bin/python -m bench.trace_cost --policy prefix_aware --windows 20
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import orjson

GOAL_TRACED_X = 1.15


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (utime + stime) of a process's event-loop thread (`loop`: the main one) and
    of its other threads together (`threads`: the request log's flush, the OTLP export)."""
    from bench.overhead import TICK_S

    out = {"loop": 0.0, "threads": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
            key = "loop" if int(tid) == pid else "threads"
            out[key] += (int(fields[11]) + int(fields[12])) * TICK_S
    return out


def _metric(port: int, name: str) -> float:
    """A counter's value on a gateway's /metrics (summed over its series), or NaN."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return float("nan")
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    return total if seen else float("nan")


async def window(port: int, requests: list[bytes], seconds: float) -> int:
    """32 keep-alive connections to `port`, closed loop, for `seconds`; the answers counted."""
    from bench.overhead import Run, _Conn

    loop = asyncio.get_running_loop()
    run = Run(requests, stream=False, closed_loop=True)
    conns: list[Any] = []
    for _ in range(32):
        _, c = await loop.create_connection(lambda: _Conn(run), "127.0.0.1", port)
        conns.append(c)
    for c in conns:
        run.send(c)
    await asyncio.sleep(seconds)
    run.stopping = True
    if run.inflight:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(run.drained.wait(), 30)
    for c in conns:
        c.t.close()
    if run.errors:
        print(f"bench.trace_cost: {run.errors} errors against :{port}", file=sys.stderr)
    return len(run.ends)


_WRK_LUA = """wrk.method = "POST"
wrk.headers["content-type"] = "application/json"
bodies = {}
for line in io.lines("%s") do bodies[#bodies + 1] = line end
local i = 0
request = function()
  i = i %% #bodies + 1
  return wrk.format(nil, "/v1/chat/completions", nil, bodies[i])
end
"""


async def wrk_window(port: int, script: str, seconds: float) -> int:
    """wrk (1 thread, 32 connections) against `port` for `seconds`; the answers it counted."""
    proc = await asyncio.create_subprocess_exec(
        "wrk", "-t1", "-c32", f"-d{max(1, round(seconds))}s", "-s", script,
        f"http://127.0.0.1:{port}", stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await proc.communicate()
    text = out.decode()
    for line in text.splitlines():
        if "requests in" in line:
            return int(line.split()[0])
    raise RuntimeError(f"wrk said:\n{text}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.trace_cost", description=__doc__.splitlines()[0])
    p.add_argument("--policy", default="round_robin")
    p.add_argument("--windows", type=int, default=16, help="windows, half of them traced")
    p.add_argument("--window-s", type=float, default=3.0)
    p.add_argument("--warmup-s", type=float, default=1.0, help="each gateway's, before")
    p.add_argument("--check", action="store_true", help="exit 1 when the goal is not met")
    p.add_argument(
        "--control",
        action="store_true",
        help="A/A: the second gateway untraced too (what two processes differ by alone)",
    )
    p.add_argument(
        "--wrk",
        action="store_true",
        help="load with wrk (-t1 -c32, the same 256 bodies) instead of the generator",
    )
    p.add_argument(
        "--profile",
        metavar="PATH",
        help="py-spy the traced gateway (all threads, "
        "its windows and the periods' rest) into PATH, collapsed stacks",
    )
    args = p.parse_args(argv)

    import uvloop

    from bench.harness import free_port, stop_processes
    from bench.overhead import (
        MODEL,
        Variant,
        _pin,
        chat_bodies,
        gateway_config,
        http_requests,
        policy_variant,
        proc_cpu_s,
        traced,
        wait_ready,
    )  # fmt: skip

    gw_cpu, load_cpu = sorted(os.sched_getaffinity(0))[:2]
    os.sched_setaffinity(0, {load_cpu})  # this process: the load generator
    root = Path(__file__).resolve().parent.parent
    gateway_bin = Path(sys.executable).parent / "gateway"
    taskset = shutil.which("taskset")
    procs: list[subprocess.Popen[bytes]] = []
    workdir = Path(tempfile.mkdtemp(prefix="trace-cost-"))

    def spawn(cmd: list[str], cpu: int, **kw: Any) -> subprocess.Popen[bytes]:
        pinned = [taskset, "-c", str(cpu), *cmd] if taskset else cmd
        proc = subprocess.Popen(pinned, **kw)
        procs.append(proc)
        if not taskset:
            _pin(proc.pid, cpu, 0)
        return proc

    try:
        zero = [sys.executable, "-m", "bench.zero_upstream"]
        up = spawn([*zero, "--ports", "3", "--paced-ports", "1"], load_cpu, cwd=root,
                   stdout=subprocess.PIPE)  # fmt: skip
        collector = spawn([*zero, "--ports", "1"], load_cpu, cwd=root, stdout=subprocess.PIPE)
        assert up.stdout is not None and collector.stdout is not None
        ports = orjson.loads(up.stdout.readline())
        sink = orjson.loads(collector.stdout.readline())["ports"][0]
        plain = policy_variant(args.policy)  # the request log as shipped: info, text
        gws: list[tuple[str, int, int]] = []  # name, port, pid
        env = {k: x for k, x in os.environ.items() if not k.startswith("OTEL_")}
        second = traced(plain, f"http://127.0.0.1:{sink}")
        if args.control:
            second = Variant(plain.name + "-control", plain.overrides)
        for v in (plain, second):
            port = free_port()
            cfg = gateway_config(
                port, ports["ports"], ports["paced_ports"], Variant(v.name, v.overrides)
            )
            import yaml

            path = workdir / f"{v.name}.yaml"
            path.write_text(yaml.safe_dump(cfg, sort_keys=False))
            log = open(workdir / f"{v.name}.log", "wb")  # noqa: SIM115 - lives with the process
            g = spawn([str(gateway_bin), "--config", str(path)], gw_cpu, stdout=log, stderr=log,
                      env=env, cwd="/")  # fmt: skip
            wait_ready(port, g)
            gws.append((v.name, port, g.pid))
        bodies = chat_bodies(256, False, MODEL)
        reqs = {port: http_requests(port, bodies) for _, port, _ in gws}
        script = str(workdir / "post.lua")
        if args.wrk:
            if shutil.which("wrk") is None:
                print("bench.trace_cost: --wrk needs wrk (apt-get install wrk)", file=sys.stderr)
                return 2
            (workdir / "bodies.jsonl").write_bytes(b"\n".join(bodies) + b"\n")
            Path(script).write_text(_WRK_LUA % (workdir / "bodies.jsonl"))

        async def load(port: int, seconds: float) -> int:
            if args.wrk:
                return await wrk_window(port, script, seconds)
            return await window(port, reqs[port], seconds)

        async def run() -> list[tuple[int, float, int]]:
            for _, port, _ in gws:  # warm-up: imports, first routes, connection pools
                await load(port, args.warmup_s)
            out: list[tuple[int, float, int]] = []  # gateway, CPU at the window's start, answers
            for i in range(args.windows + 2):  # the last two only close the periods
                k = i % 2
                cpu = proc_cpu_s(gws[k][2], True)
                n = await load(gws[k][1], args.window_s)
                out.append((k, cpu, n))
            return out

        spy = None
        if args.profile:  # sampling from outside: the gateway runs as operated
            seconds = int((args.windows + 2) * args.window_s + 2)
            spy = subprocess.Popen(
                [str(gateway_bin.parent / "py-spy"), "record", "--pid", str(gws[1][2]),
                 "--duration", str(seconds), "--format", "raw", "--threads", "--nonblocking",
                 "--rate", "250", "-o", args.profile], stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL)  # fmt: skip
            procs.append(spy)
        threads0 = [thread_cpu_s(pid) for _, _, pid in gws]
        marks = uvloop.run(run())
        threads1 = [thread_cpu_s(pid) for _, _, pid in gws]
        if spy is not None:
            spy.wait(60)
        per: list[tuple[bool, float]] = []  # traced, CPU µs per request over its period
        for i, (k, cpu, n) in enumerate(marks[:-2]):
            nxt = marks[i + 2]
            per.append((k == 1, (nxt[1] - cpu) / max(1, n) * 1e6))
        ratios = [b[1] / a[1] if b[0] else a[1] / b[1] for a, b in zip(per, per[1:], strict=False)]
        on = statistics.median(us for t, us in per if t)
        off = statistics.median(us for t, us in per if not t)
        x = statistics.median(ratios)
        tport = gws[1][1]
        exported = _metric(tport, "gateway_trace_spans_exported_total")
        dropped = _metric(tport, "gateway_trace_spans_dropped_total")
        waiting = _metric(tport, "gateway_trace_export_queue_spans")
        answered = sum(n for _, _, n in marks)
        if args.control:
            print(
                "bench.trace_cost --control: both gateways untraced; the ratio is two processes' own"
            )
        print(f"bench.trace_cost: policy {args.policy}, load {'wrk' if args.wrk else 'generator'}, two gateways from the CLI on CPU {gw_cpu} "
              f"(request log on), collector, replicas and load on CPU {load_cpu}; "
              f"{args.windows} windows of {args.window_s:g} s, {answered} requests")  # fmt: skip
        print(f"  gateway CPU per request (all threads, over each period): traced {on:.0f} us, "
              f"untraced {off:.0f} us, +{on - off:.0f} us; {exported:.0f} spans exported, {waiting:.0f} waiting, "
              f"{dropped:.0f} dropped")  # fmt: skip
        split = []
        for k, label in ((0, "untraced"), (1, "traced")):
            n = max(1, sum(m for g, _, m in marks if g == k))
            us = {t: (threads1[k][t] - threads0[k][t]) / n * 1e6 for t in threads1[k]}
            split.append(f"{label}: loop {us['loop']:.0f}, other threads {us['threads']:.0f}")
        print(f"  by thread, us per request over the whole run: {'; '.join(split)}")
        ok = x <= GOAL_TRACED_X
        print(f"  traced CPU per request <= {GOAL_TRACED_X:g} x untraced (neighbouring periods, "
              f"median of {len(ratios)})  {x:.2f}  {'PASS' if ok else 'FAIL'}")  # fmt: skip
        return 1 if args.check and not ok else 0
    finally:
        stop_processes(procs)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
