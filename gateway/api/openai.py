"""Parse and check OpenAI request bodies (chat and completions, and the pieces every JSON kind
shares: `load_object`, `model_field`, `stream_fields`, `common_fields`); pure, no I/O.

The raw bytes are kept and forwarded as they came: the gateway never re-encodes a body it did not
have to change. The other endpoint kinds' checks are in `gateway/api/bodies.py`, the table of kinds in
`gateway/api/kinds.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from gateway.errors import BadRequest

Kind = str  # an endpoint kind's name (gateway.kinds.KINDS): "chat", "completions", "embeddings", ...

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
MAX_TOKENS_CAP = 10_000_000
MAX_CHOICES = 128  # `n` and `best_of`
MAX_TOKEN_ID = 2**31 - 1  # token ids are hashed as 32-bit integers; no vocabulary comes close
MAX_DEPTH = 64  # nesting of arrays and objects; the gateway re-encodes bodies (orjson stops at 255)
_NUMBER_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty")


@dataclass(slots=True)
class ParsedRequest:
    kind: Kind
    raw: bytes
    body: dict[str, Any]
    model: str
    stream: bool = False
    include_usage: bool = False  # the client asked for a final usage chunk itself
    max_tokens: int | None = None
    user: str | None = None
    choices: int = 1  # answers generated, each up to max_tokens: n (or best_of) per prompt

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.body["messages"]  # type: ignore[no-any-return]

    @property
    def prompt(self) -> Any:
        return self.body.get("prompt")


def _bad(message: str, param: str | None = None, code: str | None = None) -> BadRequest:
    return BadRequest(message, param=param, code=code)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty array", "messages")
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"'{param}' must be an object", param)
        role = m.get("role")
        if not isinstance(role, str):
            raise _bad(f"'{param}.role' is required and must be a string", f"{param}.role")
        if role not in _ROLES:
            raise _bad(
                f"'{param}.role' must be one of {', '.join(sorted(_ROLES))}; got {role!r}",
                f"{param}.role",
            )
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise _bad(
                f"'{param}.content' must be a string or an array of parts", f"{param}.content"
            )
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise _bad(
                        f"'{param}.content[{j}]' must be an object with a string 'type'",
                        f"{param}.content[{j}]",
                    )


def _is_token(v: Any) -> bool:
    return _is_int(v) and 0 <= v <= MAX_TOKEN_ID


def check_prompt(prompt: Any) -> None:
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return
        if all(_is_token(p) for p in prompt):
            return
        if all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt):
            return
    raise _bad(
        "'prompt' must be a string, an array of strings, an array of token ids, "
        f"or an array of token-id arrays (non-empty; token ids in [0, {MAX_TOKEN_ID}])",
        "prompt",
    )


_COUNT_BYTES = 4096  # bodies up to this size count their brackets first (cheaper than a walk)
_WALK_VALUES = 256  # values the nesting check walks before it counts brackets first


def _too_deep(raw: bytes, body: Any) -> bool:
    """True when arrays and objects nest deeper than MAX_DEPTH (the body itself is level 1).

    A large body's walk visits values, not bytes, so a chat body's check does not grow with its
    text (counting the brackets of a 32 KB body took 16 us, the walk under 2). A body of more
    values than `_WALK_VALUES` (token-id arrays), or a small one, is counted in C first: too few
    brackets to nest that deep, and it is done."""
    found = _deeper(body, _WALK_VALUES) if len(raw) > _COUNT_BYTES else None
    if found is None:  # counted first; walked whole only when it could be deep
        if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
            return False
        found = _deeper(body, None)
    return bool(found)


def _deeper(body: Any, budget: int | None) -> bool | None:
    """Whether `body` nests deeper than MAX_DEPTH; None once more than `budget` values were
    seen (None: no budget)."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    left = budget
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if left is not None:
            left -= len(children)
            if left < 0:
                return None
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > MAX_DEPTH:
                    return True
                stack.append((child, depth + 1))
    return False


def optional_int(body: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not _is_int(v):
        raise _bad(f"'{key}' must be an integer", key)
    if not lo <= v <= hi:
        raise _bad(f"'{key}' must be between {lo} and {hi}; got {v}", key)
    return int(v)


def load_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object (400 `invalid_json` otherwise; 400 when nested too deep)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _bad(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise _bad("The request body must be a JSON object", code="invalid_json")
    if _too_deep(raw, body):
        raise _bad(f"The request body nests arrays and objects deeper than {MAX_DEPTH} levels")
    return body


def model_field(body: dict[str, Any], required: bool = True) -> str:
    """The `model`; "" when it may be left out and is (the default pool serves it)."""
    model = body.get("model")
    if model is None:
        if required:
            raise _bad("'model' is required", "model")
        return ""
    if not isinstance(model, str) or not model:
        raise _bad("'model' must be a non-empty string", "model")
    return model


def stream_fields(body: dict[str, Any]) -> tuple[bool, bool]:
    """`stream` and `stream_options.include_usage`, checked."""
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise _bad("'stream_options' must be an object", "stream_options")
        iu = opts.get("include_usage", False)
        if not isinstance(iu, bool):
            raise _bad(
                "'stream_options.include_usage' must be a boolean", "stream_options.include_usage"
            )
        include_usage = iu
    return stream, include_usage


def common_fields(body: dict[str, Any]) -> str | None:
    """Check the sampling numbers, `priority` and `user` every kind may carry; returns `user`."""
    for key in _NUMBER_FIELDS:
        v = body.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
            raise _bad(f"'{key}' must be a number", key)
    priority = body.get("priority")
    if priority is not None and not (isinstance(priority, str) or _is_int(priority)):
        raise _bad("'priority' must be a priority class name or an integer", "priority")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("'user' must be a string", "user")
    return user


def parse_body(kind: Kind, raw: bytes) -> ParsedRequest:
    """Check the fields the gateway relies on (chat or completions); the replica checks the rest."""
    body = load_object(raw)
    model = model_field(body)
    if kind == "chat":
        if "messages" not in body:
            raise _bad("'messages' is required", "messages")
        check_messages(body["messages"])
    else:
        if "prompt" not in body:
            raise _bad("'prompt' is required", "prompt")
        check_prompt(body["prompt"])
    stream, include_usage = stream_fields(body)
    max_tokens = optional_int(body, "max_tokens", 1, MAX_TOKENS_CAP)
    mct = optional_int(body, "max_completion_tokens", 1, MAX_TOKENS_CAP)
    if mct is not None:
        max_tokens = mct
    n = optional_int(body, "n", 1, MAX_CHOICES) or 1
    best_of = optional_int(body, "best_of", 1, MAX_CHOICES) or 1  # generated, n of them returned
    prompts = body.get("prompt")
    batch = len(prompts) if isinstance(prompts, list) and isinstance(prompts[0], str | list) else 1
    return ParsedRequest(kind, raw, body, model, stream, include_usage, max_tokens,
                         common_fields(body), max(n, best_of) * batch)  # fmt: skip
