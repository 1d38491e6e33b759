"""A local Hugging Face tokenizer directory's chat template, rendered the way vLLM renders it.

Tokens mode hashes a chat prompt as the token ids of the engine's rendered template, so the
gateway finds the template where transformers does and renders messages as vLLM passes them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from prefix_index.chat import media_digest

__all__ = [
    "CHATML",
    "ChatTemplate",
    "chatml_template",
    "engine_messages",
    "load_chat_template",
    "parsed_tool_call",
    "responses_messages",
    "special_tokens",
]

TEMPLATE_FILE = "chat_template.jinja"  # where recent transformers versions save the template
CONFIG_FILE = "tokenizer_config.json"
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# ChatML as Qwen2.5 renders a chat without a default system message: what tokens mode uses when
# the tokenizer has no template of its own (and for chats a template rejects). A request's tools
# go into the system message after its content, in Qwen's shape (the simulator's built-in ChatML
# renders the same text).
CHATML = (  # every output is an expression: trim_blocks / lstrip_blocks never touch it
    "{%- set lead = messages and messages[0].role in ('system', 'developer') %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}{%- if lead %}{{- messages[0].content ~ '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call functions. Their signatures:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' ~ (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nCall one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>."
    "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- set role = 'system' if m.role == 'developer' else m.role %}"
    "{%- if tools and lead and loop.first %}"
    "{%- elif role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' ~ m.content ~ '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif role == 'assistant' and m.tool_calls %}"
    "{{- '<|im_start|>assistant' }}{%- if m.content %}{{- '\\n' ~ m.content }}{%- endif %}"
    "{%- for call in m.tool_calls %}"
    "{%- set f = call.function if call.function is defined else call %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' ~ (f.name or '') ~ '\", \"arguments\": ' ~"
    " ((f.arguments if f.arguments is defined else {}) | tojson) ~ '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' ~ role ~ '\\n' ~ m.content ~ '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_CHATML: list[ChatTemplate] = []  # compiled on first use


class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with.

    Compiles once (construction); `render` is what runs per request. The environment is the
    one transformers builds: a sandbox with trim_blocks and lstrip_blocks, loop controls, a
    `{% generation %}` block, the `raise_exception` and `strftime_now` globals and a `tojson`
    filter that keeps non-ASCII text and sorts no keys.
    """

    def __init__(
        self, source: str, *, origin: str, special: Mapping[str, str] | None = None
    ) -> None:
        import jinja2  # optional dependency (the `tokens` extra)

        self.origin = origin
        self.special = dict(special or {})
        try:
            env = _environment()
            self._template = env.from_string(source)
            # as vLLM decides per template: a template that loops over a message's content gets
            # the content as OpenAI parts, any other the text parts joined into one string
            self.content_format = content_format(env.parse(source))
        except jinja2.TemplateError as exc:
            raise ValueError(f"{origin}: the chat template does not compile: {exc}") from None
        # a template that never names the developer role gets developer messages as system ones
        self.developer = "'developer'" in source or '"developer"' in source

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Any] | None = None,
    ) -> str:
        """The prompt text the engine builds for `messages` and the request's `tools` (raises
        jinja2.TemplateError when the template rejects them, as templates do for a bad role
        order). Tools go to the template as the request sent them, as vLLM passes them."""
        engine = engine_messages(messages, parts=self.content_format == "openai")
        if not self.developer and any(m.get("role") == "developer" for m in engine):
            engine = system_for_developer(engine)
        text: str = self._template.render(
            messages=engine,
            add_generation_prompt=add_generation_prompt,
            tools=tools or None,
            documents=None,
            **self.special,
        )
        return text


def chatml_template() -> ChatTemplate:
    """The built-in ChatML template (compiled once per process)."""
    if not _CHATML:
        _CHATML.append(ChatTemplate(CHATML, origin="built-in ChatML"))
    return _CHATML[0]


def load_chat_template(
    tokenizer: str | os.PathLike[str], override: str | os.PathLike[str] | None = None
) -> ChatTemplate | None:
    """The chat template for `tokenizer` (a tokenizer directory or a `tokenizer.json` file).

    `override` (a template file) wins; else a directory's `chat_template.jinja`; else its
    `tokenizer_config.json`'s `chat_template` (a string, or a list of named templates of which
    "default" is used). None when there is none (a bare `tokenizer.json` has none). Special
    tokens come from the `tokenizer_config.json` beside the tokenizer. A missing or broken
    template raises ValueError naming the file.
    """
    path = Path(tokenizer)
    folder = path if path.is_dir() else path.parent
    config_file = folder / CONFIG_FILE
    if override is not None:
        source, origin = _read(Path(override)), str(override)
    elif not path.is_dir():
        return None
    elif (folder / TEMPLATE_FILE).is_file():
        source, origin = _read(folder / TEMPLATE_FILE), str(folder / TEMPLATE_FILE)
    else:
        found = _config_template(config_file)
        if found is None:
            return None
        source, origin = found, f"{config_file} (chat_template)"
    return ChatTemplate(source, origin=origin, special=special_tokens(config_file))


def special_tokens(config_file: Path) -> dict[str, str]:
    """`bos_token`, `eos_token` (and `unk_token`, `pad_token`) from a tokenizer_config.json:
    each a string or an AddedToken object with "content". {} when the file is absent."""
    config = _read_config(config_file)
    out: dict[str, str] = {}
    for key in _SPECIAL_KEYS:
        value = config.get(key)
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def engine_messages(
    messages: Sequence[Mapping[str, Any]], parts: bool = False
) -> list[dict[str, Any]]:
    """Messages as vLLM hands them to a template with its "string" content format, or with
    `parts`, its "openai" one (`content_format`).

    String format: a list content becomes its text parts joined by "\\n". OpenAI format: every
    content a list of parts (a string one text part, no content none), text parts as
    `{"type": "text", "text": ...}`, media as `{"type": <its type>}` (vLLM's placeholder dicts;
    the media's digest goes with it here, as `digest`, so two images differ); but a tool
    message's text parts are joined into a string, as vLLM joins them. vLLM replaces an image or audio part
    with the model's placeholder tokens (expanded to the media's length) and keys their KV by
    the media's hash; here it becomes `<type:digest>` text, so two images differ and the same
    image matches, and like vLLM's placeholders these go before the text. An assistant's tool
    calls keep their shape, their JSON `arguments` parsed into objects (as vLLM does, since
    templates render them with `tojson`); a tool message keeps its `tool_call_id`.
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, Mapping):
            out.append({"role": "", "content": _json(message)})
            continue
        role = message.get("role")
        content = message.get("content")
        msg: dict[str, Any] = {
            "role": role,
            "content": content_parts(content)
            if parts and not (role == "tool" and _text_only(content))
            else content_text(content),
        }
        calls = message.get("tool_calls")
        if role == "assistant" and isinstance(calls, list):
            msg["tool_calls"] = [parsed_tool_call(call) for call in calls]
        if role == "tool" and "tool_call_id" in message:
            msg["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            msg["name"] = message["name"]
        out.append(msg)
    return out


def content_text(content: Any) -> str:
    """A message's content as one string (see `engine_messages`)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return _json(content)
    texts: list[str] = []
    media: list[str] = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and _is_text(part):
            texts.append(str(part.get("text", "")))
        else:
            kind = part.get("type", "") if isinstance(part, Mapping) else ""
            media.append(f"<{kind}:{media_digest(part)}>")
    text = "\n".join(texts)
    return "\n".join([*media, text]) if media else text


_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})  # vLLM parses all three as text


def content_parts(content: Any) -> list[dict[str, Any]]:
    """A message's content as the OpenAI parts vLLM gives an "openai"-format template."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        return [{"type": "text", "text": _json(content)}]
    out: list[dict[str, Any]] = []
    for part in content:
        if isinstance(part, str):
            out.append({"type": "text", "text": part})
        elif isinstance(part, Mapping) and _is_text(part):
            out.append({"type": "text", "text": str(part.get("text", ""))})
        else:
            kind = part.get("type", "") if isinstance(part, Mapping) else ""
            out.append({"type": kind, "digest": media_digest(part)})
    return out


def _text_only(content: Any) -> bool:
    return not isinstance(content, list) or all(
        isinstance(p, str) or (isinstance(p, Mapping) and _is_text(p)) for p in content
    )


def system_for_developer(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's handling of a developer message for a template that does not know the role: it
    becomes a system message, and when that leaves a system message anywhere but first (or
    several), all system messages are merged, in order, into one first ("\\n\\n" between)."""
    converted = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
    systems = [i for i, m in enumerate(converted) if m.get("role") == "system"]
    if not systems or systems == [0]:
        return converted
    texts = []
    for i in systems:
        content = converted[i].get("content")
        text = content if isinstance(content, str) else "\n".join(
            str(p.get("text", "")) for p in content or () if isinstance(p, Mapping) and "text" in p
        )
        if text:
            texts.append(text)
    rest = [m for m in converted if m.get("role") != "system"]
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest]


def content_format(ast: Any) -> str:
    """"openai" when a template loops over a message's content, else "string": vLLM's rule. A
    message is a loop variable over `messages` (or a name set from it); its content is `m.content`
    or `m['content']` (through filters, tests and slices), a name `content` looped over outside a
    macro, or a macro's parameter that a call passes a message's content to."""
    from jinja2 import nodes

    def unwrap(node: Any) -> Any:
        while True:
            if isinstance(node, nodes.Filter | nodes.Test) and node.node is not None:
                node = node.node
            elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
                node = node.node
            else:
                return node

    def is_name(node: Any, names: set[str]) -> bool:
        node = unwrap(node)
        return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names

    def is_content_of(node: Any, names: set[str]) -> bool:
        node = unwrap(node)
        if isinstance(node, nodes.Getitem):
            return is_name(node.node, names) and isinstance(node.arg, nodes.Const) \
                and node.arg.value == "content"
        if isinstance(node, nodes.Getattr):
            return is_name(node.node, names) and node.attr == "content"
        return False

    lists = {"messages"}  # names that hold the messages (or a slice of them)
    changed = True
    while changed:
        changed = False
        for assign in ast.find_all(nodes.Assign):
            if isinstance(assign.target, nodes.Name) and assign.target.name not in lists \
                    and is_name(assign.node, lists):
                lists.add(assign.target.name)
                changed = True
    loops = list(ast.find_all(nodes.For))
    items = {f.target.name for f in loops if isinstance(f.target, nodes.Name) and is_name(f.iter, lists)}
    params: set[str] = set()  # macro parameters given a message's content
    in_macros: set[int] = set()
    for macro in ast.find_all(nodes.Macro):
        names = [a.name for a in macro.args]
        for call in ast.find_all(nodes.Call):
            if isinstance(call.node, nodes.Name) and call.node.name == macro.name:
                params |= {names[i] for i, a in enumerate(call.args[: len(names)])
                           if is_content_of(a, items)}
                params |= {k.key for k in call.kwargs if k.key in names and is_content_of(k.value, items)}
        in_macros |= {id(f) for f in macro.find_all(nodes.For)}
    for loop in loops:
        it = loop.iter
        if is_content_of(it, items):
            return "openai"
        if isinstance(it, nodes.Name) and (
            (id(loop) in in_macros and it.name in params)
            or (id(loop) not in in_macros and it.name == "content")
        ):
            return "openai"
    return "string"


def _is_text(part: Mapping[str, Any]) -> bool:
    kind = part.get("type")
    return kind in _TEXT_PARTS or (kind is None and "text" in part)


def responses_messages(instructions: Any, items: Any) -> list[dict[str, Any]]:
    """A `/v1/responses` request's `instructions` and `input` as the chat messages vLLM renders
    for it (its `construct_input_messages`): the instructions as a system message, a string input
    as a user message; of the items, a `function_call` joins the previous assistant message's
    tool calls (else starts one), a `function_call_output` is a tool message, an assistant message
    keeps its first part's text, and other messages keep their role and content (`input_text` and
    `output_text` parts are text parts). Only role, content, name and tool calls are kept, so the
    rendering is a chat's with the same messages. A stored conversation named by
    `previous_response_id` goes between the two on the engine; the gateway does not know it.
    """
    out: list[dict[str, Any]] = []
    if isinstance(instructions, str) and instructions:
        out.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        out.append({"role": "user", "content": items})
        return out
    for item in items if isinstance(items, list) else ():
        if isinstance(item, Mapping):
            _responses_item(item, out)
    return out


def _responses_item(item: Mapping[str, Any], out: list[dict[str, Any]]) -> None:
    kind, role = item.get("type"), item.get("role")
    prev = out[-1] if out and out[-1].get("role") == "assistant" else None
    if kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments")},
        }
        if prev is not None:
            prev.setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        out.append({"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")})
    elif kind == "reasoning":
        if prev is None:
            out.append({"role": "assistant", "content": None})
    elif role == "assistant":
        content = item.get("content")
        if isinstance(content, list):
            first = content[0] if content else ""
            content = first.get("text", "") if isinstance(first, Mapping) else first
        if prev is not None and prev.get("content") is None:
            prev["content"] = content
        else:
            out.append({"role": "assistant", "content": content})
    elif isinstance(role, str):
        msg: dict[str, Any] = {"role": role, "content": _text_parts(item.get("content"))}
        if isinstance(item.get("name"), str):
            msg["name"] = item["name"]
        out.append(msg)


def _text_parts(content: Any) -> Any:
    """Content with `input_text` / `output_text` parts as `text` parts (so bytes mode, which
    knows chat's part types, renders them as text too)."""
    if not isinstance(content, list):
        return content
    return [
        {"type": "text", "text": p.get("text", "")}
        if isinstance(p, Mapping) and p.get("type") in _TEXT_PARTS
        else p
        for p in content
    ]


def parsed_tool_call(call: Any) -> Any:
    """A tool call as vLLM hands it to a template: its JSON `arguments` parsed (none: {})."""
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    function = dict(call["function"])
    arguments = function.get("arguments")
    if not arguments:
        function["arguments"] = {}
    elif isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            pass  # vLLM rejects the request; keep the text so the prompt still hashes
    return {**call, "function": function}


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the chat template ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: the chat template is not UTF-8 text") from None


def _read_config(config_file: Path) -> dict[str, Any]:
    if not config_file.is_file():
        return {}
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{config_file}: not a readable JSON file ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_file}: expected a JSON object")
    return config


def _config_template(config_file: Path) -> str | None:
    value = _read_config(config_file).get("chat_template")
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        default = named.get("default")
        if isinstance(default, str):
            return default
        raise ValueError(
            f"{config_file}: chat_template lists named templates but none named 'default'"
        )
    raise ValueError(f"{config_file}: chat_template must be a string or a list of templates")


def _environment() -> Any:
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}…{% endgeneration %}` marks assistant text for training masks;
        rendering only needs its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> list[nodes.Node]:
            next(parser.stream)
            body: list[nodes.Node] = parser.parse_statements(
                ("name:endgeneration",), drop_needle=True
            )
            return body

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env
