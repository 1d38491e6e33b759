"""Logging setup: readable text by default, one JSON object a line with `--log-format json`.

The request log (`gateway.access`, one line per finished request, written by `Recorder.record`)
logs an `AccessLine`: `request key=value ...` in text, its fields as the object's keys in JSON.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import Mapping

import orjson

# LogRecord attributes that are no `extra`; uvicorn's `color_message` is its msg with ANSI colours
_STD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "color_message"}
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_BARE = re.compile(r"[\w.:/@+-]+")  # a text value shown without quotes

ACCESS = logging.getLogger("gateway.access")


class AccessLine:
    """One request log line: its fields, rendered only when a handler formats the record."""

    __slots__ = ("fields",)

    def __init__(self, fields: Mapping[str, object]) -> None:
        self.fields = fields

    def __str__(self) -> str:
        return "request " + " ".join(f"{k}={_text(v)}" for k, v in self.fields.items())


def _text(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return str(v)
    s = str(v)
    # quoted and escaped (JSON string rules) when it could split or forge a line
    return s if _BARE.fullmatch(s) else orjson.dumps(s).decode()


def log_access(line: AccessLine) -> None:
    """`ACCESS.info(line)` without looking for the caller up the stack (no format shows it)."""
    ACCESS.handle(ACCESS.makeRecord(ACCESS.name, logging.INFO, "", 0, line, (), None))


class JsonFormatter(logging.Formatter):
    _second = -1
    _stamp = ""

    def format(self, record: logging.LogRecord) -> str:
        second = int(record.created)
        if second != self._second:  # one strftime a second, not one a line
            self._second = second
            self._stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        out: dict[str, object] = {
            "ts": f"{self._stamp}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        if isinstance(record.msg, AccessLine):
            out["msg"] = "request"
            out.update(record.msg.fields)
        else:
            msg = record.getMessage()
            out["msg"] = _ANSI.sub("", msg) if "\x1b" in msg else msg
        for k, v in record.__dict__.items():
            if k not in _STD:
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    # neither format shows them: a record need not look up its thread and process names
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
