"""routes.yaml's validation errors in an operator's words: each pydantic error becomes one
`key.path: what is wrong` line (never pydantic's phrasing), an unknown key gets a did-you-mean.

The key path and the keys valid at each level come from walking the config models along the
error's location, so union members and discriminator tags (`pools.chat.discovery.dns...`) never
show up as keys. Inputs are echoed only where they cannot be secrets (numbers, enum words).
"""

from __future__ import annotations

import difflib
import re
import types
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel

__all__ = ["describe_errors"]

# a message that names a path below its own location ("replicas: required ...", "[0]: empty")
_RELATIVE = re.compile(r"^[a-z_][a-z0-9_]*(\[\d+\])?(\.[a-z_][a-z0-9_]*(\[\d+\])?)*: ")
_INDEX = re.compile(r"^\[\d+\]: ")
_MAX_ECHO = 40

_EXPECTED = {  # pydantic error type -> what the key should have held
    "string_type": "a string",
    "int_type": "a whole number",
    "int_parsing": "a whole number",
    "int_from_float": "a whole number",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "dict_type": "a mapping (key: value)",
    "mapping_type": "a mapping (key: value)",
    "model_type": "a mapping (key: value)",
    "model_attributes_type": "a mapping (key: value)",
    "tuple_type": "a list",
    "list_type": "a list",
    "set_type": "a list",
    "frozen_set_type": "a list",
    "iterable_type": "a list",
    "none_required": "null",
}
_ECHOED = {
    "int_parsing",
    "int_from_float",
    "float_parsing",
    "bool_parsing",
    "literal_error",
    "enum",
}
_BOUNDS = {
    "greater_than": ("gt", "must be greater than"),
    "greater_than_equal": ("ge", "must be at least"),
    "less_than": ("lt", "must be less than"),
    "less_than_equal": ("le", "must be at most"),
    "multiple_of": ("multiple_of", "must be a multiple of"),
}


def describe_errors(errors: Sequence[Mapping[str, Any]], root: type[BaseModel]) -> list[str]:
    """One line per problem, in the order pydantic found them; the alternatives of a union that
    all failed on the same key (`str | dict`) are one line ("expected a string or a mapping")."""
    lines: list[str] = []
    unions: dict[str, tuple[int, list[str], Any]] = {}  # path -> (line index, expected, input)
    for err in errors:
        kind = str(err.get("type"))
        path, keys, node = _walk(root, tuple(err["loc"]), last_is_key=kind == "extra_forbidden")
        if kind in _EXPECTED:
            if path in unions:
                at, expected, given = unions[path]
                expected.append(_EXPECTED[kind])
                lines[at] = _at(path, _type_message(expected, given, kind))
                continue
            unions[path] = (len(lines), [_EXPECTED[kind]], err.get("input"))
        lines.append(_at(path, _message(err, keys, node)))
    return list(dict.fromkeys(lines))


def _at(path: str, msg: str) -> str:
    """`path: msg`, or the joined path when `msg` names a key below `path` itself."""
    if not path:
        return msg
    if _INDEX.match(msg):
        return f"{path}{msg}"
    if _RELATIVE.match(msg):
        parent, _, last = path.rpartition(".")
        if msg.startswith((last + ".", last + ":", last + "[")):  # the message repeats our key
            return f"{parent}.{msg}" if parent else msg
        return f"{path}.{msg}"
    return f"{path}: {msg}"


def _message(err: Mapping[str, Any], keys: Sequence[str], node: Sequence[Any]) -> str:
    """The words for one error; `keys` are those valid beside the failing one, `node` the types
    its value may have (for a discriminated union's tags)."""
    kind = str(err.get("type"))
    ctx: Mapping[str, Any] = err.get("ctx") or {}
    given = err.get("input")
    if kind == "missing":
        return "required"
    if kind == "extra_forbidden":
        return _unknown_key(err["loc"][-1] if err.get("loc") else "", keys)
    if kind in _EXPECTED:
        return _type_message([_EXPECTED[kind]], given, kind)
    if kind in ("literal_error", "enum"):
        return f"must be {_one_of(str(ctx.get('expected', '')))}, got {_shown(given, echo=True)}"
    if kind in _BOUNDS:
        key, words = _BOUNDS[kind]
        bound = ctx.get(key)
        shown = f"{bound:g}" if isinstance(bound, float) else bound  # 0, not 0.0
        return f"{words} {shown}, got {_shown(given, echo=True)}"
    if kind in ("too_short", "too_long"):
        bound = ctx.get("min_length") if kind == "too_short" else ctx.get("max_length")
        side = "least" if kind == "too_short" else "most"
        if isinstance(given, str):
            return _length(bound, side)
        what = ("entry", "entries") if isinstance(given, Mapping) else ("item", "items")
        return f"must hold at {side} {bound} {what[bound != 1]}"
    if kind in ("string_too_short", "string_too_long"):
        bound = ctx.get("min_length") if kind == "string_too_short" else ctx.get("max_length")
        return _length(bound, "least" if kind == "string_too_short" else "most")
    if kind == "finite_number":
        return "must be a finite number"
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        return _bad_tag(kind, ctx, node)
    msg = str(err.get("msg", "invalid"))
    if kind in ("value_error", "assertion_error"):
        return msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    return msg.replace("Input should be", "must be")  # a kind not seen yet: still not "Input"


def _length(bound: Any, side: str) -> str:
    if bound == 1 and side == "least":
        return "must not be empty"
    return f"must be at {side} {bound} character{'' if bound == 1 else 's'}"


def _type_message(expected: Sequence[str], given: Any, kind: str) -> str:
    return f"expected {' or '.join(dict.fromkeys(expected))}, got {_shown(given, kind in _ECHOED)}"


def _unknown_key(key: Any, keys: Sequence[str]) -> str:
    if not keys:
        return "unknown key"
    close = difflib.get_close_matches(str(key), keys, n=1, cutoff=0.6)
    if close:
        return f"unknown key (did you mean {close[0]!r}?)"
    return f"unknown key (known here: {', '.join(sorted(keys))})"


def _bad_tag(kind: str, ctx: Mapping[str, Any], node: Sequence[Any]) -> str:
    field = str(ctx.get("discriminator", "kind")).strip("'\"")
    tags = [
        str(tag)
        for t in node
        if _is_model(t) and field in t.model_fields
        for tag in get_args(t.model_fields[field].annotation)
    ]
    if kind == "union_tag_not_found":
        return f"{field}: required (one of {', '.join(tags)})"
    tag = str(ctx.get("tag", ""))
    close = difflib.get_close_matches(tag, tags, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{field}: {tag[:_MAX_ECHO]!r} is not one of {', '.join(tags)}{hint}"


def _one_of(expected: str) -> str:
    return f"one of {expected}" if "," in expected else expected


def _shown(value: Any, echo: bool = False) -> str:
    """What the file held, in YAML's words; a string is repeated only where echo is safe."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        if echo:
            return repr(value[:_MAX_ECHO] + ("..." if len(value) > _MAX_ECHO else ""))
        return "a string"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return type(value).__name__


# --- the key path, walked along the models -------------------------------------------------------


def _members(annotation: Any) -> list[Any]:
    """The types an annotation may hold: Annotated, Optional and unions flattened."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _members(get_args(annotation)[0])
    if origin is Union or isinstance(annotation, types.UnionType):
        return [m for a in get_args(annotation) for m in _members(a)]
    return [annotation]


def _is_model(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, BaseModel)


def _tagged(model: type[BaseModel], tag: str) -> bool:
    return any(
        get_origin(f.annotation) is Literal and tag in get_args(f.annotation)
        for f in model.model_fields.values()
    )


def _step(node: list[Any], part: int | str) -> list[Any] | None:
    """What `part` leads to from the types in `node`; None when it is not a key (a union
    member's label such as `str` or `function-after[...]`, which pydantic puts in locations)."""
    out: list[Any] = []
    for t in node:
        origin, args = get_origin(t), get_args(t)
        if _is_model(t) and isinstance(part, str):
            field = t.model_fields.get(part)
            if field is not None:
                out += _members(field.annotation)
        elif origin in (dict, Mapping) and isinstance(part, str) and len(args) == 2:
            out += _members(args[1])
        elif origin in (tuple, list) and isinstance(part, int) and args:
            out += _members(args[0])
    return out or None


def _walk(
    root: type[BaseModel], loc: tuple[int | str, ...], last_is_key: bool = False
) -> tuple[str, list[str], list[Any]]:
    """The error's key path as the file spells it, the keys valid where its last part is, and the
    types the value there may have. `last_is_key`: the last part is a key of the file even if no
    model has it (an unknown key)."""
    node: list[Any] = [root]
    path = ""
    keys: list[str] = []
    for i, part in enumerate(loc):
        keys = sorted({k for t in node if _is_model(t) for k in t.model_fields})
        nxt = _step(node, part)
        if nxt is None and isinstance(part, str) and not (last_is_key and i == len(loc) - 1):
            tagged = [t for t in node if _is_model(t) and _tagged(t, part)]
            if tagged:  # a discriminator tag
                node = tagged
                continue
        if isinstance(part, str) and _is_label(part, node):
            continue  # a union member's or a validator's label: pydantic's, not the file's
        node = nxt or []
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else part)
    return path, keys, node


def _is_label(part: str, node: list[Any]) -> bool:
    """Whether `part` of a location is pydantic's label for a validator or (where the value may
    have several types) for one union member, rather than a key of the file."""
    if part.startswith(("function-", "tagged-union[")):
        return True
    return len(node) > 1 and (
        "[" in part
        or part in ("str", "int", "float", "bool", "none", "bytes")
        or any(_is_model(t) and t.__name__ == part for t in node)
    )
