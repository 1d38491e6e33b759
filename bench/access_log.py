"""The gateway's request log, read back by a benchmark that runs the gateway in its own process:
each finished request's fields (`gateway.access`, written by `Recorder.record`), the route
receipt among them."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gateway.telemetry.logs import ACCESS


@contextmanager
def access_lines() -> Iterator[list[dict[str, Any]]]:
    """The request log's fields, line by line, while the block runs (the logger on at info)."""
    lines: list[dict[str, Any]] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            fields = getattr(record.msg, "fields", None)
            if isinstance(fields, dict):
                lines.append(dict(fields))

    handler, level = Capture(), ACCESS.level
    ACCESS.addHandler(handler)
    ACCESS.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        ACCESS.removeHandler(handler)
        ACCESS.setLevel(level)
