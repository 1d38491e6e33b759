"""A `/v1/responses` stream as it goes by: the events are checked and relayed as `StreamTap` does
(the same bytes, uncopied), and the tap notes the response's id (`response.created`), its usage
and its end (`response.completed`, `.incomplete` or `.failed`: such a stream has no `[DONE]`).
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.api.streams import InvalidEvent, StreamTap

_KEEP = 0  # streams._KEEP: the event goes on
ENDS = frozenset({"response.completed", "response.incomplete", "response.failed"})


class ResponsesTap(StreamTap):
    __slots__ = ("answer_id",)

    def __init__(self, strip_usage: bool) -> None:
        super().__init__(strip_usage=False)  # nothing was asked for on the client's behalf
        self.answer_id: str | None = None

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
