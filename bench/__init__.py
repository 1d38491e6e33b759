"""Benchmarks and load runs, `python -m bench.<name>` from a checkout (not part of the wheel)."""

from __future__ import annotations

from collections.abc import Sequence


def verdict(problems: Sequence[str], label: str, ok: str) -> int:
    """Print each problem after `label`, then `ok` or FAILED; the exit status (1 on a problem)."""
    for line in problems:
        print(f"{label}:", line)
    print(ok if not problems else "FAILED")
    return 1 if problems else 0
