"""Chat messages -> one string shaped like an engine's prompt, for hashing in bytes mode.

Like a chat template: a role marker, the content bytes, a separator, message after message. No
length prefixes, so equal leading content gives equal leading blocks whatever follows it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import orjson
import xxhash

# Marker bytes no text normally holds. A prompt that contains them can at worst make the gateway
# predict a hit the engine does not have (a mispredicted hit); tenants, models, adapters and
# salts are kept apart by the chain's scope, never by the rendering.
START = "\x1e"  # before each message: START role [":" name] "\n"
END = "\x1f\n"  # after each message's content and tool calls
PART_SEP = "\n"  # between the text parts of one content, as engines join them
_JSON_OPTS = orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS
_KNOWN = frozenset({"role", "name", "content", "tool_calls", "tool_call_id"})


def render_chat(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None
) -> str:
    """Render chat messages the way a chat template does in shape (append-only).

    `render_chat(m[:k])` is a prefix of `render_chat(m)`, and a message's content starts right
    after its role marker, so two prompts whose engine renderings share leading bytes share
    leading bytes here too. Text parts are joined by newlines (as vLLM joins them for string
    templates); an image, audio or file part becomes `<type:digest>` of its canonical JSON (the
    engine keys its KV by the media's content hash); tool calls follow the content as JSON.
    The request's `tools` (its tool definitions) come as one block after a leading system
    message, where the common templates (Qwen, Hermes) put them, else first: two requests with
    other tools share the system prompt and nothing after it. Each definition is one line of
    JSON as templates write it (`tojson`: the client's key order, `", "` and `": "`), so the
    block has about the engine's length and the predicted share of the prompt its share.
    """
    out: list[str] = []
    if tools:
        first = messages[0] if messages else None
        at = 1 if isinstance(first, Mapping) and first.get("role") in ("system", "developer") else 0
        block = f"{START}tools\n{_tools_json(tools)}{END}"
        for message in messages[:at]:
            _render_message(message, out)
        out.append(block)
        messages = messages[at:]
    for message in messages:
        _render_message(message, out)
    return "".join(out)



def _render_message(message: Any, out: list[str]) -> None:
    if type(message) is dict and len(message) == 2:  # the usual {"role", "content"} of text
        role, content = message.get("role"), message.get("content")
        if type(role) is str and type(content) is str:
            out += (f"{START}{role}\n", content, END)  # what the general path renders for it
            return
    if not isinstance(message, Mapping):
        out.append(f"{START}?\n{_canonical(message)}{END}")
        return
    role = _text(message.get("role", ""))
    name = message.get("name")
    out.append(f"{START}{role}:{_text(name)}\n" if name is not None else f"{START}{role}\n")
    call_id = message.get("tool_call_id")
    if call_id is not None:  # a tool result: which call it answers, before its content
        out.append(f"[{_text(call_id)}]")
    _render_content(message.get("content"), out)
    calls = message.get("tool_calls")
    if isinstance(calls, Sequence) and not isinstance(calls, str):
        for call in calls:
            out.append(f"\n<call>{_tool_call(call)}</call>")
    elif calls is not None:
        out.append(f"\n<call>{_canonical(calls)}</call>")
    other = {k: v for k, v in message.items() if k not in _KNOWN and v is not None}
    if other:
        out.append(f"\n{_canonical(other)}")
    out.append(END)


def _render_content(content: Any, out: list[str]) -> None:
    if content is None:
        return
    if isinstance(content, str):
        out.append(content)
        return
    if not isinstance(content, Sequence) or isinstance(content, bytes | bytearray):
        out.append(_canonical(content))
        return
    first = True
    for part in content:
        if not first:
            out.append(PART_SEP)
        first = False
        if isinstance(part, str):
            out.append(part)
        elif isinstance(part, Mapping) and part.get("type") == "text":
            out.append(_text(part.get("text", "")))
        else:
            kind = part.get("type", "") if isinstance(part, Mapping) else ""
            out.append(f"<{_text(kind)}:{media_digest(part)}>")


def _tools_json(tools: Sequence[Any]) -> str:
    try:
        return "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    except (TypeError, ValueError):  # not JSON-able as sent: its canonical form still hashes
        return _canonical(tools)


def _tool_call(call: Any) -> str:
    if not isinstance(call, Mapping):
        return _canonical(call)
    function = call.get("function")
    function = function if isinstance(function, Mapping) else {}
    arguments = function.get("arguments", "")
    args = arguments if isinstance(arguments, str) else _canonical(arguments)
    return f"{_text(function.get('name', ''))}({args})#{_text(call.get('id', ''))}"


def _text(value: Any) -> str:
    return value if isinstance(value, str) else _canonical(value)


def _canonical(value: Any) -> str:
    return orjson.dumps(value, option=_JSON_OPTS, default=str).decode()


def digest(value: Any) -> str:
    """A stable 128-bit digest (32 hex digits) of a JSON-like value, keys sorted."""
    return xxhash.xxh3_128_hexdigest(orjson.dumps(value, option=_JSON_OPTS, default=str))


def media_digest(part: Any) -> str:
    """The digest of a media part's content, what the engine keys its KV by (vLLM's mm_hash).

    An image sent by URL or as a data URL hashes by that URL string; a part's other fields
    (`detail`, ...) join the digest, since they may change what the engine encodes.
    """
    return digest(part)
