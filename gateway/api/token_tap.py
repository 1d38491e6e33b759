"""A streamed chat or completions answer as it goes by, kept in token ids: what a resume needs.

The gateway asks the engine for token ids on every streamed request it may resume
(`return_token_ids: true`: vLLM's chat and completions, SGLang's completions): the prompt's ids
come in the first chunk (`prompt_token_ids`, at the top of a vLLM chat chunk, in the choice of a
completions chunk), each chunk's new ids in its choice (`token_ids`). `IdsTap` checks and relays
the events as `StreamTap` does and notes in its `Ledger`: the prompt's ids, the ids and text
relayed, the chunk's id/created/model, the finish reason, and anything that makes the answer one
that cannot be continued exactly (docs/resume.md). The ids are cut out of the relayed bytes when
the client did not ask for them (a byte search and one regex substitution over the chunk: an
untouched chunk is never re-encoded).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.api.streams import StreamTap

# `,"token_ids":[1,2]` or `,"prompt_token_ids":null` as an engine's compact JSON writes them (a
# comma before a quote never occurs inside a JSON string: its quotes are escaped)
_IDS = re.compile(rb',\s*"(?:prompt_)?token_ids"\s*:\s*(?:\[[0-9,\s]*\]|null)')
_IDS_KEY = b'token_ids"'


@dataclass(slots=True)
class Ledger:
    """One streamed answer as relayed so far (choice 0), and how it is framed."""

    chat: bool
    asked_ids: bool  # the client asked for token ids itself (they are relayed)
    include_usage: bool  # the client asked for the usage chunk
    prompt_ids: list[int] | None = None
    ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)  # content (chat) or text (completions) relayed
    chunks: int = 0  # content chunks relayed (each one token or more)
    ids_lost: bool = False  # a chunk with content came without its ids
    finish: str | None = None  # choice 0's finish_reason, once relayed
    stop_reason: Any = None
    template: dict[str, Any] = field(default_factory=dict)  # id, created, model (+ object)
    role_sent: bool = False  # a chat stream's first chunk (the assistant role) was relayed
    unresumable: str | None = None  # why this answer cannot be continued exactly
    usage: dict[str, Any] | None = None
    # the data of the events relayed and not yet read: each one JSON object, as the engine sent
    # it (bytes: the event's objects are not kept alive, so they cost the collector nothing)
    seen: list[bytes] = field(default_factory=list)

    def settle(self) -> Ledger:
        """Read the events noted since the last call into the fields above: a stream's events are
        only kept as they go (their bytes, one reference each, on the hot path), and parsed again
        when a resume, a drain or a whole answer needs the ledger. Call before reading any field."""
        if self.seen:
            seen, self.seen = self.seen, []
            for data in seen:
                self._take(orjson.loads(data))
        return self

    @property
    def offset(self) -> int:
        """Tokens relayed so far."""
        return len(self.ids)

    @property
    def exact(self) -> bool:
        """The ids of the prompt and of everything relayed are known."""
        return self.prompt_ids is not None and not self.ids_lost

    def _take(self, obj: dict[str, Any]) -> None:
        usage = obj.get("usage")
        choices = obj.get("choices")
        if type(usage) is dict and choices == []:  # the usage chunk
            self.usage = usage
        if not self.template:
            for key in ("id", "created", "model", "object", "system_fingerprint"):
                if key in obj:
                    self.template[key] = obj[key]
        top = obj.get("prompt_token_ids")
        if type(top) is list and self.prompt_ids is None:
            self.prompt_ids = top
        if type(choices) is not list:
            return
        for choice in choices:
            if type(choice) is not dict:
                continue
            if choice.get("index", 0) != 0:
                self.unresumable = self.unresumable or "n"
                continue
            self._choice(choice)

    def _choice(self, choice: dict[str, Any]) -> None:
        prompt = choice.get("prompt_token_ids")
        if type(prompt) is list and self.prompt_ids is None:
            self.prompt_ids = prompt
        if choice.get("logprobs") is not None:
            self.unresumable = self.unresumable or "logprobs"
        if self.chat:
            delta = choice.get("delta")
            piece = None
            if type(delta) is dict:
                if "role" in delta:
                    self.role_sent = True
                if delta.get("tool_calls"):
                    self.unresumable = self.unresumable or "tool_calls"
                if delta.get("reasoning_content") or delta.get("reasoning"):
                    self.unresumable = self.unresumable or "reasoning"
                piece = delta.get("content")
        else:
            piece = choice.get("text")
        self.add(piece, choice.get("token_ids"), choice)

    def add(self, piece: Any, ids: Any, choice: dict[str, Any]) -> None:
        """One relayed chunk of choice 0: its content or text `piece`, its `ids`, its finish (the
        engine's chunks, and a resume's continuation rewritten into them)."""
        if type(ids) is list:
            self.ids.extend(ids)
        elif piece:
            self.ids_lost = True
        if type(piece) is str and piece:
            self.text.append(piece)
            self.chunks += 1
        reason = choice.get("finish_reason")
        if reason is not None:
            self.finish = reason
            self.stop_reason = choice.get("stop_reason")


class IdsTap(StreamTap):
    """`StreamTap` keeping a `Ledger` of a chat or completions stream; with `strip_ids` the
    engine's `token_ids`/`prompt_token_ids` are cut out of what the client gets."""

    __slots__ = ("ledger", "strip_ids")
    error_breaks = True  # an engine's error event mid-stream: a resume's trigger

    def __init__(self, strip_usage: bool, ledger: Ledger, strip_ids: bool) -> None:
        super().__init__(strip_usage)
        self.ledger = ledger
        self.strip_ids = strip_ids

    def feed(self, chunk: bytes) -> bytes:
        out = super().feed(chunk)
        if self.strip_ids and out and out.find(_IDS_KEY) >= 0:
            return strip_ids(out)
        return out

    def _took(self, chunk: bytes, datas: list[bytes]) -> bool:
        self.ledger.seen += datas
        return True

    def _json(self, data: memoryview | bytes) -> int:
        verdict = super()._json(data)  # InvalidEvent: not noted
        self.ledger.seen.append(bytes(data))  # a dropped usage chunk too: the answer's usage
        return verdict


def strip_ids(out: bytes) -> bytes:
    """`out` without the engine's token id fields."""
    return _IDS.sub(b"", out)
