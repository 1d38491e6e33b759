"""Logging setup: readable text by default, one JSON object a line with `--log-format json`.

The request log (`gateway.access`, one line per finished request, written by `Recorder.record`)
logs an `AccessLine`: `request key=value ...` in text, its fields as the object's keys in JSON.
It is on by default, so it is cheap: a line is a tuple of values in `ACCESS_FIELDS` order (no
dict unless a JSON formatter or a handler asks for `fields`), a text value is checked for
quoting once per distinct string (names repeat), the time stamp is built once a second, and the
handler writes lines in batches (`BatchedStreamHandler`: at 256 lines, 0.2 s after the first
waiting one, or at once for a warning), not one write and flush per request.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from typing import TextIO

import orjson

# LogRecord attributes that are no `extra`; uvicorn's `color_message` is its msg with ANSI colours
_STD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "color_message"}
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_BARE = re.compile(r"[\w.:/@+-]+")  # a text value shown without quotes

ACCESS = logging.getLogger("gateway.access")


# the request log's fields, in the order of an AccessLine's values (docs/operations.md, Request log)
ACCESS_FIELDS = (
    "request_id", "tenant", "model", "pool", "replica", "status", "outcome", "error_type",
    "stream", "priority", "prompt_tokens", "predicted_cached_tokens", "cached_tokens",
    "output_tokens", "queue_s", "ttft_s", "total_s", "retries", "policy", "reason", "resumes",
    "resumed_at", "resume_gap_s",
)  # fmt: skip
_SHOWN: dict[str, str] = {}  # a text value -> how it shows (bare or quoted); names repeat
_SHOWN_MAX = 4096


class AccessLine:
    """One request log line: its values in ACCESS_FIELDS order, rendered only when a handler
    formats the record (`__str__`: text; `fields`: the mapping a JSON line holds)."""

    __slots__ = ("values",)

    def __init__(self, values: tuple[object, ...]) -> None:
        self.values = values

    @property
    def fields(self) -> dict[str, object]:
        return dict(zip(ACCESS_FIELDS, self.values, strict=True))

    def __str__(self) -> str:
        (rid, tenant, model, pool, replica, status, outcome, error_type, stream, priority, prompt,
         predicted, cached, output, queue_s, ttft_s, total_s, retries, policy, reason, resumes,
         resumed_at, resume_gap_s) = self.values
        rid = str(rid)  # new for every request: not memoised like the names        # one f-string in ACCESS_FIELDS order: each value as `_text` shows it, fast paths inlined
        return (
            f"request request_id={rid if rid.isascii() and rid.isalnum() else _quoted(rid)} "
            f"tenant={_text(tenant)} model={_text(model)} "
            f"pool={_text(pool)} replica={_text(replica)} status={status} "
            f"outcome={_text(outcome)} error_type={_text(error_type)} "
            f"stream={'true' if stream else 'false'} priority={_text(priority)} "
            f"prompt_tokens={_num(prompt)} predicted_cached_tokens={_num(predicted)} "
            f"cached_tokens={_num(cached)} output_tokens={_num(output)} queue_s={_num(queue_s)} "
            f"ttft_s={_num(ttft_s)} total_s={_num(total_s)} retries={retries} "
            f"policy={_text(policy)} reason={_text(reason)} resumes={resumes} "
            f"resumed_at={_num(resumed_at)} resume_gap_s={_num(resume_gap_s)}"
        )


def _num(v: object) -> str:
    return "-" if v is None else str(v)


def _text(v: object) -> str:
    if type(v) is str:  # the usual value: a name seen before
        shown = _SHOWN.get(v)
        if shown is not None:
            return shown
    if v is None:
        return "-"
    if v is True:
        return "true"
    if v is False:
        return "false"
    if type(v) is int or type(v) is float:
        return str(v)
    s = v if type(v) is str else str(v)
    shown = _SHOWN.get(s)
    if shown is None:
        shown = _quoted(s)
        if len(_SHOWN) >= _SHOWN_MAX:
            _SHOWN.clear()
        _SHOWN[s] = shown
    return shown


def _quoted(s: str) -> str:
    """`s` bare, or quoted and escaped (JSON string rules) when it could split or forge a line."""
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
        if isinstance(record.msg, AccessLine):  # log_access: no extras, no exception
            out["msg"] = "request"
            out.update(zip(ACCESS_FIELDS, record.msg.values, strict=True))
            return orjson.dumps(out, default=str).decode()
        msg = record.getMessage()
        out["msg"] = _ANSI.sub("", msg) if "\x1b" in msg else msg
        for k, v in record.__dict__.items():
            if k not in _STD:
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


class TextFormatter(logging.Formatter):
    """`asctime levelname name: message`, as logging's default format with its `asctime`, the
    date and time built once a second."""

    _second = -1
    _stamp = ""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        second = int(record.created)
        if second != self._second:
            self._second = second
            self._stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))
        return f"{self._stamp},{int(record.msecs):03d}"


class BatchedStreamHandler(logging.StreamHandler[TextIO]):
    """A stream handler that writes lines in batches: when 256 are waiting, `delay_s` after the
    first of them (a daemon thread's timer), or at once with a record at warning or above, and
    at close. A line per request otherwise costs a write and a flush each."""

    MAX_LINES = 256

    def __init__(self, stream: TextIO, delay_s: float = 0.2) -> None:
        super().__init__(stream)
        self.delay_s = delay_s
        self._lines: list[str] = []
        self._wake = threading.Event()
        self._closed = False
        threading.Thread(target=self._timer, name="log-flush", daemon=True).start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:  # noqa: BLE001 - logging's rule: a bad record never raises
            self.handleError(record)
            return
        lines = self._lines
        lines.append(line)
        if len(lines) >= self.MAX_LINES or record.levelno >= logging.WARNING:
            self.flush()
        elif len(lines) == 1:
            self._wake.set()

    def flush(self) -> None:
        with self.lock:  # type: ignore[union-attr]  # Handler.createLock made it
            lines, self._lines = self._lines, []
            if lines:
                self.stream.write("\n".join(lines) + "\n")
            self.stream.flush()

    def _timer(self) -> None:
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            time.sleep(self.delay_s)
            if self._lines:
                self.flush()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self.flush()
        super().close()


def setup_logging(level: str, fmt: str) -> None:
    handler = BatchedStreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    # neither format shows them: a record need not look up its thread and process names
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
