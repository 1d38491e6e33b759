"""Fault switches for chaos tests: a replica that errors, stalls, dies mid-stream or lies.

Set with `POST /sim/fault`; each completion request takes the fault in force, if any.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

Mode = Literal["none", "error_503", "error_500", "stall", "die_midstream", "garbage_sse",
               "slow_first_byte", "error_midstream"]
MODES: tuple[str, ...] = Mode.__args__  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class Fault:
    """What to do to a request.

    - `error_503` / `error_500`: answer at once with a vLLM-shaped error body.
    - `stall`: send `after_chunks` chunks, then nothing, until the client goes away.
    - `die_midstream`: send `after_chunks` chunks, then abort the TCP connection (RST).
    - `garbage_sse`: send `after_chunks` chunks, then an event that is not JSON, then end.
    - `error_midstream`: send `after_chunks` chunks, then vLLM's error event and `[DONE]`.
    - `slow_first_byte`: wait `delay_s` wall seconds before the response starts.
    `count`: how many of the next requests it applies to (None: until switched off).
    """

    mode: Mode = "none"
    after_chunks: int = 0
    delay_s: float = 0.0
    count: int | None = None

    @classmethod
    def from_json(cls, body: Any) -> Fault:
        if not isinstance(body, dict):
            raise ValueError("the fault must be a JSON object")
        unknown = set(body) - {"mode", "after_chunks", "delay_s", "count"}
        if unknown:
            raise ValueError(f"unknown fault field(s) {sorted(unknown)}")
        mode = body.get("mode", "none")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}")
        after, delay, count = body.get("after_chunks", 0), body.get("delay_s", 0.0), \
            body.get("count")
        if isinstance(after, bool) or not isinstance(after, int) or after < 0:
            raise ValueError("after_chunks must be an integer >= 0")
        if isinstance(delay, bool) or not isinstance(delay, int | float) or delay < 0:
            raise ValueError("delay_s must be a number >= 0")
        if count is not None and (isinstance(count, bool) or not isinstance(count, int)
                                  or count < 1):
            raise ValueError("count must be an integer >= 1 or null")
        return cls(mode, after, float(delay), count)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class FaultSwitch:
    """The fault in force on one replica, with its remaining count."""

    def __init__(self) -> None:
        self.fault = Fault()
        self.remaining: int | None = None
        self.applied = 0

    def set(self, fault: Fault) -> None:
        self.fault = fault
        self.remaining = fault.count

    def take(self) -> Fault | None:
        """The fault for the next request (None: behave), counting it down."""
        if self.fault.mode == "none":
            return None
        fault = self.fault
        if self.remaining is not None:
            self.remaining -= 1
            if self.remaining <= 0:
                self.set(Fault())
        self.applied += 1
        return fault

    def state(self) -> dict[str, Any]:
        return {**self.fault.to_json(), "remaining": self.remaining, "applied": self.applied}
