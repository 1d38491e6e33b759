"""What resume's stream tap costs a read: `IdsTap` (the ledger, ids cut out) beside the plain `StreamTap`.

Each read is vLLM's chat chunks, one token each, with the token ids the gateway asks for (cut out of
what the client gets) or without (an engine that sends none, as bench/zero_upstream.py); 1, 8 or 64
events a read (a paced stream reads one at a time, an unpaced one many). Prints microseconds a read,
best of the repeats, and the ratio to the plain tap in the same run. `--src` runs the gateway
package of another tree (e.g. a `git archive` of an older commit) for a before/after.

    .venv/bin/python -m bench.tap_cost
    .venv/bin/python -m bench.tap_cost --src /tmp/old-tree
"""

from __future__ import annotations

import argparse
import sys
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson


def chunk(events: int, ids: bool) -> bytes:
    """`events` SSE events of one token each (the first with the prompt's ids when `ids`)."""
    out = []
    for i in range(events):
        obj: dict[str, Any] = {"id": "chatcmpl-0123456789abcdef", "object": "chat.completion.chunk",
                               "created": 1700000000, "model": "bench-model"}  # fmt: skip
        choice: dict[str, Any] = {"index": 0, "delta": {"content": " token"}, "logprobs": None,
                                  "finish_reason": None}  # fmt: skip
        if ids:
            if i == 0:
                obj["prompt_token_ids"] = list(range(1000, 1512))
            choice["token_ids"] = [4000 + i]
        obj["choices"] = [choice]
        out.append(b"data: " + orjson.dumps(obj) + b"\n\n")
    return b"".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.tap_cost", description=__doc__.splitlines()[0])
    p.add_argument("--src", type=Path, help="import the gateway package from this tree")
    p.add_argument("--number", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    if args.src is not None:
        sys.path.insert(0, str(args.src.resolve()))
    from gateway.api.streams import StreamTap
    from gateway.api.token_tap import IdsTap, Ledger

    def best(fn: Callable[[], object]) -> float:
        return min(timeit.repeat(fn, number=args.number, repeat=args.repeats)) / args.number * 1e6

    import gateway

    print(f"bench.tap_cost: gateway from {Path(gateway.__file__).parent.parent}; us a read, best of "
          f"{args.repeats} x {args.number}")  # fmt: skip
    print(f"{'read':<22} {'StreamTap':>10} {'IdsTap':>10} {'ratio':>7}")
    for ids in (False, True):
        for n in (1, 8, 64):
            data = chunk(n, ids)
            plain = best(lambda data=data: StreamTap(True).feed(data))  # type: ignore[misc]
            tap = best(lambda data=data: IdsTap(True, Ledger(True, False, False), True).feed(data))  # type: ignore[misc]
            name = f"{n} event{'s' if n > 1 else ''}, {'ids' if ids else 'no ids'}"
            print(f"{name:<22} {plain:>10.2f} {tap:>10.2f} {tap / plain:>6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
