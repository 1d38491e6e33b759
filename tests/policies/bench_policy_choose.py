"""Micro benchmark of Policy.choose (not a test): microseconds per call for each preset.

PYTHONPATH=. .venv/bin/python tests/policies/bench_policy_choose.py [--calls 2000 --repeat 25]
"""

from __future__ import annotations

import argparse
import random
import time
import timeit

from policies import POLICY_NAMES, Outcome, ReplicaView, RoutedRequest, build_policy


def _fleet(n: int, rng: random.Random) -> list[ReplicaView]:
    return [
        ReplicaView(
            name=f"r{i}",
            inflight=rng.randrange(0, 20),
            inflight_prompt_tokens=rng.randrange(0, 40_000),
            waiting=rng.randrange(0, 10),
            running=rng.randrange(0, 20),
            kv_usage=rng.random(),
            hit_blocks=rng.randrange(0, 64),
        )
        for i in range(n)
    ]


def _request(i: int) -> RoutedRequest:
    return RoutedRequest(
        request_id=str(i),
        model="m",
        scope="m",
        pool="default",
        prompt_tokens=4096,
        block_hashes=range(64),
        tokens_per_block=64.0,
        session_key=f"s{i % 50}",
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2_000)
    parser.add_argument("--repeat", type=int, default=25)
    args = parser.parse_args()
    rng = random.Random(0)
    requests = [_request(i) for i in range(64)]
    print(f"{'policy':<20}{'8 replicas':>14}{'64 replicas':>14}   (µs per choose)")
    reference = min(timeit.repeat("sum(range(1000))", number=2000, repeat=25)) / 2000 * 1e6
    print(f"machine reference: sum(range(1000)) = {reference:.1f} µs")
    specs: list[object] = list(POLICY_NAMES)
    specs.append({"scorers": {"prefix": 3, "queue": 2, "kv_pressure": 2, "session": 1}})
    for spec in specs:
        label = spec if isinstance(spec, str) else "blend+session"
        row = []
        for n in (8, 64):
            policy = build_policy(spec, seed=1)  # type: ignore[arg-type]
            fleets = [_fleet(n, rng) for _ in range(16)]
            for view in fleets[0]:  # give the learners something to hold
                policy.observe(Outcome(view.name, 4096, 2048, 3, 8000, 0.4, session_key="s1"))
            best = float("inf")
            for _ in range(args.repeat):  # best of many short runs: shared CPUs are noisy
                t0 = time.perf_counter()
                for i in range(args.calls):
                    policy.choose(requests[i & 63], fleets[i & 15])
                best = min(best, (time.perf_counter() - t0) / args.calls * 1e6)
            row.append(best)
        print(f"{label:<20}{row[0]:>14.1f}{row[1]:>14.1f}")


if __name__ == "__main__":
    main()
