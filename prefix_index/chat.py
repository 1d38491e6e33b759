"""Canonical, append-only rendering of OpenAI chat messages into one string for hashing.

Fields are length-prefixed, so no content can forge a boundary; earlier turns render to a prefix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson
import xxhash

# One message starts with MESSAGE; every field is `<tag><length in characters>:<value>`. A value
# is read by its length, never scanned for a separator, so content cannot end a field early.
MESSAGE = "\x1e"
TAG_ROLE = "r"
TAG_NAME = "n"
TAG_TEXT = "t"  # a text part (a string `content` is one text part)
TAG_MEDIA = "m"  # a non-text part: "<type>:<digest of the part>"
TAG_TOOL_CALL = "c"  # nested fields: id, name, arguments
TAG_TOOL_CALL_ID = "k"
TAG_OTHER = "x"  # any other key of the message, as canonical JSON

_KNOWN = frozenset({"role", "name", "content", "tool_calls", "tool_call_id"})
_JSON_OPTS = orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS


def render_chat(messages: Sequence[Mapping[str, Any]]) -> str:
    """Render chat messages so that equal strings mean equal conversations.

    Rendering is append-only: `render_chat(m[:k])` is a prefix of `render_chat(m)`. A string
    `content` and a list holding one text part with the same text render alike; images, audio
    and other parts become a digest of their canonical JSON.
    """
    out: list[str] = []
    for message in messages:
        out.append(MESSAGE)
        _render_message(message, out)
    return "".join(out)


def _field(out: list[str], tag: str, value: str) -> None:
    out.append(f"{tag}{len(value)}:")
    out.append(value)


def _render_message(message: Mapping[str, Any], out: list[str]) -> None:
    if not isinstance(message, Mapping):
        _field(out, TAG_OTHER, _canonical(message))
        return
    _field(out, TAG_ROLE, _text(message.get("role", "")))
    name = message.get("name")
    if name is not None:
        _field(out, TAG_NAME, _text(name))
    _render_content(message.get("content"), out)
    calls = message.get("tool_calls")
    if isinstance(calls, Sequence) and not isinstance(calls, str):
        for call in calls:
            _field(out, TAG_TOOL_CALL, _tool_call(call))
    elif calls is not None:
        _field(out, TAG_TOOL_CALL, _canonical(calls))
    call_id = message.get("tool_call_id")
    if call_id is not None:
        _field(out, TAG_TOOL_CALL_ID, _text(call_id))
    other = {k: v for k, v in message.items() if k not in _KNOWN and v is not None}
    if other:
        _field(out, TAG_OTHER, _canonical(other))


def _render_content(content: Any, out: list[str]) -> None:
    if content is None:
        return
    if isinstance(content, str):
        _field(out, TAG_TEXT, content)
        return
    if not isinstance(content, Sequence) or isinstance(content, bytes | bytearray):
        _field(out, TAG_OTHER, _canonical(content))
        return
    for part in content:
        if isinstance(part, str):
            _field(out, TAG_TEXT, part)
        elif isinstance(part, Mapping) and part.get("type") == "text":
            _field(out, TAG_TEXT, _text(part.get("text", "")))
        else:
            kind = part.get("type", "") if isinstance(part, Mapping) else ""
            _field(out, TAG_MEDIA, f"{_text(kind)}:{digest(part)}")


def _tool_call(call: Any) -> str:
    if not isinstance(call, Mapping):
        return _canonical(call)
    function = call.get("function")
    function = function if isinstance(function, Mapping) else {}
    arguments = function.get("arguments", "")
    inner: list[str] = []
    _field(inner, "i", _text(call.get("id", "")))
    _field(inner, "f", _text(function.get("name", "")))
    _field(inner, "a", arguments if isinstance(arguments, str) else _canonical(arguments))
    return "".join(inner)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else _canonical(value)


def _canonical(value: Any) -> str:
    return orjson.dumps(value, option=_JSON_OPTS, default=str).decode()


def digest(value: Any) -> str:
    """A stable 128-bit digest (32 hex digits) of a JSON-like value, keys sorted."""
    return xxhash.xxh3_128_hexdigest(orjson.dumps(value, option=_JSON_OPTS, default=str))


def render_chatml(messages: Sequence[Mapping[str, Any]]) -> str:
    """Messages as the ChatML template renders them (Qwen's and the simulator's format), so that in
    tokens mode a chat prompt tokenizes to the ids the engine prefills: `<|im_start|>role\\n
    content<|im_end|>\\n` per message, then `<|im_start|>assistant\\n`. Text parts of a list content
    are joined by newlines; `developer` renders as `system`."""
    out = []
    for m in messages:
        role = str(m.get("role", "user"))
        role = "system" if role == "developer" else role
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(
                str(p.get("text", "")) for p in content if isinstance(p, Mapping) and p.get("type") == "text"
            )
        out.append(f"<|im_start|>{role}\n{content or ''}<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    return "".join(out)
