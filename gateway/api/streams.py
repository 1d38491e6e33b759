"""Watch an SSE stream go by and keep what reaches the client well-formed: only the replica's
complete, valid events pass (an unfinished trailing event waits for its end; the first invalid one
stops the stream); note first/last chunk times, the event count and the final usage; optionally
strip the usage chunk the gateway asked for on the client's behalf.

Events may end in LF, CRLF or CR line ends (all valid SSE). Valid means what the `openai` SDK can
read: UTF-8 lines, and data that is a JSON object or `[DONE]` (or no data fields at all: comments).
A chunk of whole valid events (the common case) passes through as the same bytes object, uncopied;
each event's data is checked with one `orjson.loads` of a slice of it, nothing re-encoded.

A `/v1/responses` stream as it goes by: the events are checked and relayed as `StreamTap` does
(the same bytes, uncopied), and the tap notes the response's id (`response.created`), its usage
and its end (`response.completed`, `.incomplete` or `.failed`: such a stream has no `[DONE]`).
"""

from __future__ import annotations

import re
import time
from typing import Any

import orjson

MAX_EVENT_BYTES = 8 * 1024 * 1024  # an unfinished event larger than this is a broken replica

_LF2 = b"\n\n"
_CRLF2 = b"\r\n\r\n"
# the end of a blank line under any mix of SSE line ends; a CR followed by LF is one line end
_BLANK_LINE = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r|\n)")
_DATA = b"data: "
_DONE = b"[DONE]"
_NEXT = b"\n\ndata: "  # one event's end and the next one's data
_LAST_DONE = b"\n\ndata: [DONE]\n\n"
_KEEP, _DROP, _DONE_EVENT = 0, 1, 2


class InvalidEvent(Exception):
    """The replica sent an event the client could not read (the reason names no replica data)."""


def load_event(data: memoryview | bytes) -> dict[str, Any]:
    """One event's data as the JSON object it must be (InvalidEvent when it is not)."""
    try:
        obj = orjson.loads(data)  # validates UTF-8 too
    except orjson.JSONDecodeError:
        raise InvalidEvent("an event whose data is not UTF-8 JSON") from None
    if not isinstance(obj, dict):
        raise InvalidEvent("an event whose data is not a JSON object")
    return obj


class StreamTap:
    __slots__ = (
        "strip_usage",
        "first_ns",
        "last_ns",
        "events",
        "usage",
        "done",
        "broken",
        "_pending",
    )

    # an engine's error event (`error`, no `choices`) breaks the stream (IdsTap: a resume's
    # trigger); the plain tap relays it as the event it is
    error_breaks = False

    def __init__(self, strip_usage: bool) -> None:
        self.strip_usage = strip_usage
        self.first_ns = 0
        self.last_ns = 0
        self.events = 0
        self.usage: dict[str, Any] | None = None
        self.done = False  # the stream's `data: [DONE]` went by: it ended properly
        self.broken: str | None = None  # why the replica's stream is unusable from here on
        self._pending = bytearray()  # the start of an event whose end has not arrived

    def feed(self, chunk: bytes) -> bytes:
        """Returns what to send on: `chunk` itself, or its whole valid events (empty when none).

        After `[DONE]` or an invalid event nothing more is returned; check `broken` after each feed.
        """
        now = time.time_ns()
        if not self.first_ns:
            self.first_ns = now
        self.last_ns = now
        if self.done or self.broken is not None:
            return b""
        pending = self._pending
        sep: bytes | None
        if pending:
            start = max(0, len(pending) - 3)  # a blank line may straddle the two reads
            pending += chunk
            sep = _blank_line(pending)
            cut = _last_end(pending, start, sep)
            if cut < 0:
                if len(pending) > MAX_EVENT_BYTES:
                    self._break(f"an event over {MAX_EVENT_BYTES} bytes")
                return b""
            buf = bytes(pending)  # one copy per event cut across reads
            del pending[:cut]
            return self._events(buf, cut, sep)
        if chunk.find(b"\r") >= 0:  # find, not `in`: memchr, twice as fast
            sep = _blank_line(chunk)
        elif chunk.find(b"\n") == len(chunk) - 2 and chunk[-1] == 10 and chunk.startswith(_DATA):
            # the usual chunk: one event of one line
            if chunk == b"data: [DONE]\n\n":
                self.done = True
                self.events += 1
                return chunk
            try:  # a bytes slice: cheaper than a memoryview at this size
                verdict = self._json(chunk[6:])
            except InvalidEvent as exc:
                self._break(str(exc))
                return b""
            return chunk if verdict == _KEEP else b""
        else:
            whole = self._lf_events(chunk)
            if whole is not None:
                return whole
            sep = _LF2
        cut = _last_end(chunk, 0, sep)
        if cut != len(chunk):
            pending += memoryview(chunk)[max(cut, 0) :]
            if cut < 0:
                return b""
        return self._events(chunk, cut, sep)

    def _lf_events(self, chunk: bytes) -> bytes | None:
        """What goes on of `chunk` when it is whole one-line `data:` events ending in LF LF (an
        unpaced read of many tokens), each a JSON object, perhaps then `[DONE]`: each checked
        with one `orjson.loads` in one tight loop. None: the general path decides."""
        if not chunk.endswith(_LF2) or not chunk.startswith(_DATA):
            return None
        n = chunk.count(_NEXT) + 1
        if chunk.count(b"\n") != 2 * n:  # then every LF is in an event's end: one line each
            return None
        done = chunk.endswith(_LAST_DONE)
        datas = chunk[6 : -len(_LAST_DONE) if done else -2].split(_NEXT)
        loads = orjson.loads
        odd = self.error_breaks  # an event without `choices` is one for `_json` to read
        drops: list[tuple[int, int]] = []
        try:
            if chunk.find(b'"usage"') < 0:
                for data in datas:
                    obj = loads(data)
                    if type(obj) is not dict or (odd and "choices" not in obj):
                        return None  # not an object, or [DONE] before the read's end
            else:  # the usage is noted, and its chunk dropped when the client did not ask
                pos = 0
                for data in datas:
                    obj = loads(data)
                    if type(obj) is not dict or (odd and "choices" not in obj):
                        return None
                    end = pos + len(data) + 8  # `data: ` and LF LF
                    usage = obj.get("usage")
                    if type(usage) is dict:
                        self.usage = usage
                        if self.strip_usage and obj.get("choices") == []:
                            drops.append((pos, end))
                    pos = end
        except orjson.JSONDecodeError:
            return None
        if not self._took(chunk, datas):
            return None
        self.events += n - len(drops)
        if done:
            self.done = True
        return _cut_out(chunk, drops, len(chunk)) if drops else chunk

    def _took(self, chunk: bytes, datas: list[bytes]) -> bool:
        """`_lf_events` read `chunk`'s events (`datas`, each a JSON object, with `choices` when
        `error_breaks`): what a tap that keeps more of its events (`_json`) notes of them all at
        once; False: each goes through `_json` instead."""
        return True

    def discard(self) -> bool:
        """Drop what is held back (the stream ended); True when that was part of an event."""
        held = bytes(self._pending).strip(b"\r\n")
        self._pending.clear()
        return bool(held)

    def _break(self, why: str) -> None:
        self.broken = why
        self._pending.clear()

    def _events(self, buf: bytes, cut: int, sep: bytes | None) -> bytes:
        """The events in buf[:cut] that go on: up to `[DONE]` or an invalid event, less a usage
        chunk to strip. What may follow the last blank line found here, up to `cut`, is only
        more line ends (kept: harmless)."""
        ends = _BLANK_LINE.finditer(buf, 0, cut) if sep is None else None
        eol = b"\n" if sep == _LF2 else b"\r"
        drops: list[tuple[int, int]] = []
        pos = 0
        end = cut
        while True:
            if sep is not None:
                nl = buf.find(eol, pos, cut)
                if nl < 0:
                    break
                one_line = buf.startswith(sep, nl)
                if one_line:
                    stop = nl
                else:
                    stop = buf.find(sep, nl, cut)
                    if stop < 0:
                        break
                after = stop + len(sep)
            else:
                assert ends is not None
                m = next(ends, None)
                if m is None:
                    break
                stop, after = m.span()
                one_line = buf.find(b"\n", pos, stop) < 0 and buf.find(b"\r", pos, stop) < 0
            try:
                if stop == pos:
                    verdict = _KEEP  # an extra blank line
                elif one_line and buf.startswith(_DATA, pos):  # the usual event
                    if stop - pos == 12 and buf.startswith(_DONE, pos + 6):
                        verdict = _DONE_EVENT
                        self.events += 1
                    else:
                        verdict = self._json(buf[pos + 6 : stop])
                else:
                    verdict = self._general(buf[pos:stop])
            except InvalidEvent as exc:
                self._break(str(exc))
                end = pos
                break
            if verdict == _DROP:
                drops.append((pos, after))
            elif verdict == _DONE_EVENT:
                self.done = True
                self._pending.clear()
                end = after  # nothing after [DONE] reaches the client
                break
            pos = after
        if not drops and end == len(buf):
            return buf
        return _cut_out(buf, drops, end)

    def _general(self, block: bytes) -> int:
        """Any other event: more lines, comments, other fields, `data:` without its space."""
        data: list[bytes] = []
        fields = False
        for line in block.splitlines():  # LF, CRLF, CR: as the SDK splits them
            try:
                line.decode()  # the SDK decodes every line, comments too
            except UnicodeDecodeError:
                raise InvalidEvent("an event that is not UTF-8") from None
            if not line or line.startswith(b":"):
                continue
            name, _, value = line.partition(b":")
            if name == b"data":
                data.append(value[1:] if value.startswith(b" ") else value)
            elif name in (b"event", b"id", b"retry"):
                fields = True
        if not data:
            if fields:  # the SDK would hand it on with empty data, which is not JSON
                raise InvalidEvent("an event without data")
            return _KEEP
        joined = b"\n".join(data)
        if joined == _DONE:
            self.events += 1
            return _DONE_EVENT
        return self._json(joined)

    def _json(self, data: memoryview | bytes) -> int:
        obj = load_event(data)
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
            if self.strip_usage and obj.get("choices") == []:
                return _DROP  # the usage chunk the gateway asked for: the client did not
        if self.error_breaks and "error" in obj and "choices" not in obj:
            raise InvalidEvent("an error event")
        self.events += 1
        return _KEEP

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


def _blank_line(buf: bytes | bytearray) -> bytes | None:
    """The blank line events in `buf` end with when its line ends are all LF or all CRLF (found
    with a byte search); None for CRs or a mix (found with the regex)."""
    cr = buf.count(b"\r")
    if not cr:
        return _LF2
    return _CRLF2 if buf.count(b"\r\n") == cr == buf.count(b"\n") else None


def _last_end(buf: bytes | bytearray, start: int, sep: bytes | None) -> int:
    """Where the last complete event in `buf` ends (after its blank line), or -1."""
    if sep is not None:
        i = buf.rfind(sep, start)
        return i + len(sep) if i >= 0 else -1
    end = -1
    for m in _BLANK_LINE.finditer(buf, start):
        end = m.end()
    return end


def _cut_out(buf: bytes, drops: list[tuple[int, int]], end: int) -> bytes:
    """buf[:end] without the dropped ranges."""
    if not drops:
        return buf[:end]
    mv = memoryview(buf)
    parts = []
    pos = 0
    for s, e in drops:
        parts.append(mv[pos:s])
        pos = e
    parts.append(mv[pos:end])
    return b"".join(parts)


_KEEP = 0  # streams._KEEP: the event goes on
ENDS = frozenset({"response.completed", "response.incomplete", "response.failed"})


class ResponsesTap(StreamTap):
    __slots__ = ("answer_id",)

    def __init__(self, strip_usage: bool) -> None:
        super().__init__(strip_usage=False)  # nothing was asked for on the client's behalf
        self.answer_id: str | None = None

    def _took(self, chunk: bytes, datas: list[bytes]) -> bool:
        return False  # each event is read for the response's id and end (`_json`)

    def _json(self, data: memoryview | bytes) -> int:
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise InvalidEvent("an event whose data is not UTF-8 JSON") from None
        if not isinstance(obj, dict):
            raise InvalidEvent("an event whose data is not a JSON object")
        self.events += 1
        kind = obj.get("type")
        if kind == "response.created" or kind in ENDS:
            response: Any = obj.get("response")
            if isinstance(response, dict):
                rid = response.get("id")
                if self.answer_id is None and isinstance(rid, str):
                    self.answer_id = rid
                if kind in ENDS:
                    usage = response.get("usage")
                    if isinstance(usage, dict):
                        self.usage = usage
            if kind in ENDS:
                self.done = True  # the stream's last event: what follows is not relayed
        return _KEEP
