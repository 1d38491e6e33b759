"""Watch an SSE stream go by: first/last chunk times, event count, the final usage; optionally strip
the usage chunk the gateway asked for on the client's behalf.

The common chunk (whole events, no usage) passes through as the same bytes object, uncopied.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

_USAGE = b'"usage"'
_DONE = b"data: [DONE]\n\n"


class StreamTap:
    __slots__ = ("strip_usage", "first_ns", "last_ns", "events", "usage", "done", "_pending")

    def __init__(self, strip_usage: bool) -> None:
        self.strip_usage = strip_usage
        self.first_ns = 0
        self.last_ns = 0
        self.events = 0
        self.usage: dict[str, Any] | None = None
        self.done = False  # the stream's `data: [DONE]` went by: it ended properly
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        """Returns what to send on (often `chunk` itself; may be empty when all of it was held)."""
        now = time.time_ns()
        if not self.first_ns:
            self.first_ns = now
        self.last_ns = now
        if chunk.endswith(_DONE) or (self._pending and (self._pending + chunk).endswith(_DONE)):
            self.done = True
        if (
            not self._pending
            and _USAGE not in chunk
            and (not self.strip_usage or chunk.endswith(b"\n\n"))
        ):
            self.events += chunk.count(b"data:")
            return chunk
        return self._careful(self._pending + chunk)

    def flush(self) -> bytes:
        """Whatever was held back when the stream ends."""
        rest, self._pending = self._pending, b""
        return rest

    def _careful(self, data: bytes) -> bytes:
        if not self.strip_usage:
            self.events += data.count(b"data:")
            for event in data.split(b"\n\n"):
                if _USAGE in event:
                    self._usage_of(event)
            return data
        cut = data.rfind(b"\n\n")
        complete, self._pending = (data[: cut + 2], data[cut + 2 :]) if cut >= 0 else (b"", data)
        kept = []
        for event in complete.split(b"\n\n"):
            if not event:
                continue
            if _USAGE in event:
                obj = self._usage_of(event)
                if obj is not None and obj.get("choices") == []:
                    continue  # the usage chunk the gateway asked for: the client did not
            self.events += 1
            kept.append(event + b"\n\n")
        return b"".join(kept)

    def _usage_of(self, event: bytes) -> dict[str, Any] | None:
        start = event.find(b"{")
        if start < 0:
            return None
        try:
            obj = orjson.loads(event[start:])
        except orjson.JSONDecodeError:
            return None
        if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
            return obj
        return None

    @property
    def output_tokens(self) -> int | None:
        if self.usage is not None and isinstance(self.usage.get("completion_tokens"), int):
            return int(self.usage["completion_tokens"])
        return None

    @property
    def prompt_tokens(self) -> int | None:
        if self.usage is not None and isinstance(self.usage.get("prompt_tokens"), int):
            return int(self.usage["prompt_tokens"])
        return None

    @property
    def cached_tokens(self) -> int | None:
        details = (self.usage or {}).get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            return int(details["cached_tokens"])
        return None
