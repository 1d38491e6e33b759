"""A deterministic stand-in tokenizer, a local tokenizer.json, and chat templates.

`Tokenizer` is the seam: `ByteTokenizer` needs nothing and renders ChatML; `TokenizerJson` reads
a local file or tokenizer directory with the `tokenizers` package (nothing is downloaded) and
renders chat with the directory's own chat template, as vLLM would, else ChatML.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import orjson
import xxhash

IM_START, IM_END, EOT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
_SPECIALS = (EOT, IM_START, IM_END)
_SPLIT = re.compile("(" + "|".join(re.escape(s) for s in _SPECIALS) + r"|\n)")
_WORDS = (
    "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor incididunt "
    "ut labore et dolore magna aliqua enim ad minim veniam quis nostrud exercitation ullamco "
    "laboris nisi aliquip ex ea commodo consequat duis aute irure in reprehenderit voluptate"
).split()


class Tokenizer(Protocol):
    """What the simulator needs from a tokenizer."""

    def encode(self, text: str) -> list[int]: ...

    def render_chat(self, messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool = True,
                    tools: Sequence[Any] | None = None) -> str: ...

    def encode_chat(self, messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool = True,
                    tools: Sequence[Any] | None = None) -> list[int]:
        """A chat's prompt ids: its rendering, tokenized as the engine tokenizes chats."""
        ...

    @property
    def filler_ids(self) -> Sequence[int]: ...  # what generated tokens are drawn from

    def decode_filler(self, token_id: int) -> str: ...


def render_content(content: Any) -> str:
    """Message content as text: a string, or the text parts of a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content
                 if isinstance(p, Mapping) and p.get("type") == "text"]
        return "\n".join(str(p) for p in parts)
    raise ValueError("message content must be a string, a list of parts or null")


def render_chatml(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                  tools: Sequence[Any] | None = None) -> str:
    """ChatML as Qwen2.5's template renders it: `<|im_start|>role\\ncontent<|im_end|>\\n` per
    message, then the generation prompt `<|im_start|>assistant\\n`; `developer` renders as
    `system`.

    A request's `tools` go into the system message, after its content (a leading system message
    is folded in), as Qwen2.5 renders them: a tools header, one JSON definition a line inside
    `<tools>`, how to call one (`tools_block`; the wording is the project's, the shape Qwen's).

    An assistant's `tool_calls` follow its content, one `\\n<tool_call>\\n{"name": ...,
    "arguments": ...}\\n</tool_call>` each (arguments parsed from their JSON string, as vLLM
    passes them, then dumped as the template's `tojson` does). A `tool` message's content is
    wrapped in `\\n<tool_response>\\n...\\n</tool_response>` inside a `user` block, and
    consecutive tool messages share one block, as in Qwen. So the rendering is append-only except
    there: a prompt that ends with a tool message, extended by another tool message, differs
    from its old rendering from that message's `<|im_end|>` on (a few tokens, not the result).
    """
    out = []
    last = len(messages) - 1
    skip = -1
    if tools:
        first = messages[0] if messages else None
        lead = (first if isinstance(first, Mapping) and first.get("role") in ("system", "developer")
                else None)
        out.append(tools_block(None if lead is None else render_content(lead.get("content")),
                               tools))
        skip = -1 if lead is None else 0
    for i, m in enumerate(messages):
        if i == skip:
            continue
        role = str(m.get("role", "user"))
        role = "system" if role == "developer" else role
        content = render_content(m.get("content"))
        if role == "tool":
            if i == 0 or messages[i - 1].get("role") != "tool":
                out.append(f"{IM_START}user")
            out.append(f"\n<tool_response>\n{content}\n</tool_response>")
            if i == last or messages[i + 1].get("role") != "tool":
                out.append(f"{IM_END}\n")
            continue
        calls = m.get("tool_calls") if role == "assistant" else None
        if calls:
            out.append(f"{IM_START}assistant\n{content}" if content else f"{IM_START}assistant")
            out.extend(f"\n<tool_call>\n{_tool_call_json(c)}\n</tool_call>" for c in calls)
            out.append(f"{IM_END}\n")
            continue
        out.append(f"{IM_START}{role}\n{content}{IM_END}\n")
    if add_generation_prompt:
        out.append(f"{IM_START}assistant\n")
    return "".join(out)


def tools_block(system: str | None, tools: Sequence[Any]) -> str:
    """The system message that holds a request's tool definitions (after `system`'s text)."""
    head = f"{IM_START}system\n" + (f"{system}\n\n" if system is not None else "")
    lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return (f"{head}# Tools\n\nYou may call functions. Their signatures:\n<tools>{lines}\n"
            f'</tools>\n\nCall one as <tool_call>{{"name": ..., "arguments": ...}}</tool_call>.'
            f"{IM_END}\n")


def _tool_call_json(call: Any) -> str:
    """Qwen2.5's `{"name": "<name>", "arguments": <arguments | tojson>}` for one tool call."""
    call = _parsed_call(call)
    function = call.get("function", call) if isinstance(call, Mapping) else {}
    function = function if isinstance(function, Mapping) else {}
    name = function.get("name", "")
    arguments = json.dumps(function.get("arguments", {}), ensure_ascii=False)
    return f'{{"name": "{name}", "arguments": {arguments}}}'


class _FillerVocab:
    """What both tokenizers share: ChatML unless told otherwise, and generated tokens drawn
    from `_filler` (id -> the text it decodes to)."""

    _filler: dict[int, str]

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def render_chat(self, messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool = True, tools: Sequence[Any] | None = None) -> str:
        return render_chatml(messages, add_generation_prompt, tools)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool = True,
                    tools: Sequence[Any] | None = None) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt, tools))

    @property
    def filler_ids(self) -> Sequence[int]:
        return tuple(self._filler)

    def decode_filler(self, token_id: int) -> str:
        return self._filler.get(token_id, "")


class ByteTokenizer(_FillerVocab):
    """One token per 4 UTF-8 bytes, restarting at special markers and after each newline.

    Restarting at boundaries makes a message's tokens independent of what precedes it, as
    real pre-tokenizers do; so a generated reply, rendered back into the next turn's prompt,
    tokenizes to the ids that were generated and the next turn hits the cached blocks.
    Ids are `16 + crc32(4 bytes) % (vocab_size - 16)`; specials are 1, 2, 3.

    The ids of each text run between boundaries are memoised (least recently used first out,
    up to `memo_tokens` ids in all), so a document, system prompt or history resent by many
    requests is cut once; the ids are the same either way.
    """

    vocab_size = 151_936
    MEMO_TOKENS = 1 << 22  # ~50 MB of runs and their ids

    def __init__(self, *, memo_tokens: int = MEMO_TOKENS) -> None:
        self._special_ids = {s: i + 1 for i, s in enumerate(_SPECIALS)}
        pieces = [f" {w}"[:4].ljust(4, "_") for w in _WORDS]
        self._filler = {self._piece_id(p.encode()): p for p in dict.fromkeys(pieces)}
        # one int object per id, shared: a memoised run costs 8 bytes an id, not 36
        self._ids = tuple(range(16, self.vocab_size))
        self._memo: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._memo_size = 0  # ids held in _memo
        self._memo_budget = memo_tokens

    def _piece_id(self, piece: bytes) -> int:
        return 16 + zlib.crc32(piece) % (self.vocab_size - 16)

    def _run(self, part: str) -> tuple[int, ...]:
        """The ids of one text run with no boundary in it, memoised."""
        memo = self._memo
        ids = memo.get(part)
        if ids is not None:
            try:
                memo.move_to_end(part)
            except KeyError:  # evicted meanwhile (another thread); the ids are still right
                pass
            return ids
        raw, table, crc, m = part.encode("utf-8"), self._ids, zlib.crc32, len(self._ids)
        ids = tuple([table[crc(raw[i:i + 4]) % m] for i in range(0, len(raw), 4)])
        if len(ids) <= self._memo_budget // 8:  # one huge run must not flush the rest
            memo[part] = ids
            self._memo_size += len(ids)
            while self._memo_size > self._memo_budget and memo:
                self._memo_size -= len(memo.popitem(last=False)[1])
        return ids

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        specials, run = self._special_ids, self._run
        for part in _SPLIT.split(text):
            if not part:
                continue
            special = specials.get(part)
            if special is not None:
                out.append(special)
            else:
                out.extend(run(part))
        return out


class TokenizerJson(_FillerVocab):
    """A local `tokenizer.json`, or a tokenizer directory holding one, read with the
    `tokenizers` package (the gateway's tokens mode reads the same files, so both cut a prompt
    into the same ids).

    `encode` adds the tokenizer's special tokens, as vLLM does for completion prompts (and as
    the gateway's TokenChunker does). Chat renders with the directory's chat template
    (`chat_template.jinja`, else `tokenizer_config.json`'s) or `chat_template` (a template
    file), tokenized without special tokens as vLLM tokenizes chats; with no template (a bare
    tokenizer.json) it renders as ChatML and tokenizes like a completion. Generated tokens are
    drawn from ids that decode to whole filler words; unlike the ByteTokenizer's, a reply sent
    back may tokenize to other ids (BPE merges across words), which only costs the next turn
    some cache hits in its last blocks.
    """

    def __init__(self, path: str | os.PathLike[str], *, add_special_tokens: bool = True,
                 chat_template: str | os.PathLike[str] | None = None) -> None:
        path = os.fspath(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"tokenizer file not found: {file}")
        from tokenizers import Tokenizer as HfTokenizer  # optional (the `tokens` extra)

        self.path = path
        self._tok = HfTokenizer.from_file(file)
        self._special = add_special_tokens
        self._template = _load_template(path, chat_template)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._filler = self._pick_filler()

    def _pick_filler(self) -> dict[int, str]:
        tok = self._tok
        filler: dict[int, str] = {}
        for w in _WORDS:
            ids = tok.encode(f" {w}", add_special_tokens=False).ids
            if len(ids) == 1:
                filler.setdefault(ids[0], tok.decode(ids))
        if len(filler) < 8:  # a small vocabulary: any ids that decode to visible text
            special = set(tok.get_added_tokens_decoder())
            for i in range(min(self.vocab_size, 4096)):
                text = tok.decode([i])
                if i not in special and text.strip() and "\ufffd" not in text:
                    filler.setdefault(i, text)
                if len(filler) >= 64:
                    break
        if not filler:
            raise ValueError(f"{self.path}: no token decodes to text")
        return filler

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=self._special).ids
        return ids

    def render_chat(self, messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool = True, tools: Sequence[Any] | None = None) -> str:
        if self._template is None:
            return render_chatml(messages, add_generation_prompt, tools)
        return self._template.render(messages, add_generation_prompt, tools)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool = True,
                    tools: Sequence[Any] | None = None) -> list[int]:
        if self._template is None:  # ChatML, tokenized like a completion
            return super().encode_chat(messages, add_generation_prompt, tools)
        text = self._template.render(messages, add_generation_prompt, tools)
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        return ids


class ChatTemplate:
    """A Hugging Face chat template compiled as transformers compiles it (a jinja2 sandbox with
    trim_blocks and lstrip_blocks, loop controls, `{% generation %}`, `raise_exception`,
    `strftime_now`, a `tojson` that keeps non-ASCII text) and rendered with vLLM's messages.

    The simulator keeps its own copy of this (it imports nothing from the gateway's packages);
    the gateway's tokens mode must render the same text, which the tests check.
    """

    def __init__(self, source: str, origin: str, special: Mapping[str, str]) -> None:
        import jinja2  # optional (the `tokens` extra)

        self.origin = origin
        self.special = dict(special)
        try:
            env = _jinja_env()
            self._template = env.from_string(source)
            self._parts = _loops_over_content(env.parse(source))  # vLLM's "openai" format
        except jinja2.TemplateError as exc:
            raise ValueError(f"{origin}: the chat template does not compile: {exc}") from None
        self._developer = "'developer'" in source or '"developer"' in source

    def render(self, messages: Sequence[Mapping[str, Any]],
               add_generation_prompt: bool = True, tools: Sequence[Any] | None = None) -> str:
        """The prompt text (`tools`: the request's tool definitions, as vLLM passes them); a
        template that rejects the messages raises ValueError (vLLM answers 400)."""
        import jinja2

        try:
            engine = _engine_messages(messages, self._parts)
            if not self._developer and any(m.get("role") == "developer" for m in engine):
                engine = _developer_as_system(engine)
            text: str = self._template.render(
                messages=engine, add_generation_prompt=add_generation_prompt,
                tools=tools or None, documents=None, **self.special)
        except (jinja2.TemplateError, TypeError) as exc:
            raise ValueError(f"the chat template rejects these messages: {exc}") from None
        return text


def _load_template(path: str, override: str | os.PathLike[str] | None) -> ChatTemplate | None:
    """vLLM's template lookup: `override`, else the directory's `chat_template.jinja`, else
    `tokenizer_config.json`'s `chat_template` (a string, or named templates: "default")."""
    folder = Path(path) if os.path.isdir(path) else Path(path).parent
    config_file = folder / "tokenizer_config.json"
    if override is not None:
        source, origin = _read_text(Path(override)), os.fspath(override)
    elif not os.path.isdir(path):
        return None
    elif (folder / "chat_template.jinja").is_file():
        source, origin = _read_text(folder / "chat_template.jinja"), str(folder / "chat_template.jinja")
    else:
        found = _read_config(config_file).get("chat_template")
        if isinstance(found, list):
            named = {t.get("name"): t.get("template") for t in found if isinstance(t, Mapping)}
            found = named.get("default")
            if found is None:
                raise ValueError(f"{config_file}: no chat template named 'default'")
        if found is None:
            return None
        if not isinstance(found, str):
            raise ValueError(f"{config_file}: chat_template must be a string or a list")
        source, origin = found, f"{config_file} (chat_template)"
    special: dict[str, str] = {}
    config = _read_config(config_file)
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = config.get(key)
        value = value.get("content") if isinstance(value, Mapping) else value
        if isinstance(value, str):
            special[key] = value
    return ChatTemplate(source, origin, special)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the chat template ({exc})") from None


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return config


def _engine_messages(messages: Sequence[Mapping[str, Any]],
                     parts: bool = False) -> list[dict[str, Any]]:
    """What vLLM passes a template. Its "string" content format: content as one string (text
    parts joined by newlines, media as `<type:digest>` placeholders before them); its "openai"
    one (`parts`, a template that loops over content): a list of `{"type": "text", "text"}`
    parts (media `{"type", "digest"}`), but a tool message's text joined. An assistant's tool
    calls with JSON arguments parsed, a tool message's tool_call_id."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        content = m.get("content")
        as_parts = parts and not (role == "tool" and all(
            isinstance(p, str) or (isinstance(p, Mapping) and p.get("type", "text") == "text")
            for p in (content if isinstance(content, list) else ())))
        msg: dict[str, Any] = {"role": role, "content": _content_parts(content) if as_parts
                               else _content_text(content)}
        calls = m.get("tool_calls")
        if role == "assistant" and isinstance(calls, list):
            msg["tool_calls"] = [_parsed_call(c) for c in calls]
        if role == "tool" and "tool_call_id" in m:
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError("message content must be a string, a list of parts or null")
    texts, media = [], []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and (
                part.get("type") == "text" or ("type" not in part and "text" in part)):
            texts.append(str(part.get("text", "")))
        else:
            kind = part.get("type", "") if isinstance(part, Mapping) else ""
            media.append(f"<{kind}:{_media_digest(part)}>")
    text = "\n".join(texts)
    return "\n".join([*media, text]) if media else text


def _content_parts(content: Any) -> list[dict[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ValueError("message content must be a string, a list of parts or null")
    out: list[dict[str, Any]] = []
    for p in content:
        if isinstance(p, str) or (isinstance(p, Mapping) and p.get("type", "text") == "text"):
            out.append({"type": "text", "text": p if isinstance(p, str) else str(p.get("text", ""))})
        else:
            out.append({"type": p.get("type", "") if isinstance(p, Mapping) else "",
                        "digest": _media_digest(p)})
    return out


def _developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM, for a template that never names the developer role: developer messages become
    system ones, and system messages not all first are merged, in order, into one first."""
    msgs = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
    at = [i for i, m in enumerate(msgs) if m.get("role") == "system"]
    if at in ([], [0]):
        return msgs
    texts = [c if isinstance(c, str) else "\n".join(str(p.get("text", "")) for p in c)
             for c in (msgs[i]["content"] for i in at)]  # _engine_messages sets every one
    return [{"role": "system", "content": "\n\n".join(t for t in texts if t)},
            *(m for m in msgs if m.get("role") != "system")]


def _loops_over_content(ast: Any) -> bool:
    """Whether a template iterates over a message's content (vLLM then hands it OpenAI parts):
    a loop over `m.content` / `m['content']` where `m` runs over the messages (or a name bound
    to them), over a bare `content` outside macros, or inside a macro over a parameter that a
    call fills with a message's content."""
    from jinja2 import nodes as n

    def base(x: Any) -> Any:
        while (isinstance(x, n.Filter | n.Test) and x.node is not None) or (
                isinstance(x, n.Getitem) and isinstance(x.arg, n.Slice)):
            x = x.node
        return x

    def named(x: Any, names: set[str]) -> bool:
        x = base(x)
        return isinstance(x, n.Name) and x.ctx == "load" and x.name in names

    def content(x: Any, of: set[str]) -> bool:
        x = base(x)
        return (isinstance(x, n.Getattr) and x.attr == "content" and named(x.node, of)) or (
            isinstance(x, n.Getitem) and isinstance(x.arg, n.Const)
            and x.arg.value == "content" and named(x.node, of))

    lists = {"messages"}
    for _ in range(8):  # names bound to the messages, to a fixed point
        lists |= {a.target.name for a in ast.find_all(n.Assign)
                  if isinstance(a.target, n.Name) and named(a.node, lists)}
    fors = list(ast.find_all(n.For))
    items = {f.target.name for f in fors if isinstance(f.target, n.Name) and named(f.iter, lists)}
    given: set[str] = set()
    in_macro: set[int] = set()
    for macro in ast.find_all(n.Macro):
        args = [a.name for a in macro.args]
        for call in ast.find_all(n.Call):
            if isinstance(call.node, n.Name) and call.node.name == macro.name:
                given |= {args[i] for i, a in enumerate(call.args[:len(args)]) if content(a, items)}
                given |= {k.key for k in call.kwargs if k.key in args and content(k.value, items)}
        in_macro |= {id(f) for f in macro.find_all(n.For)}
    return any(
        content(f.iter, items) or (isinstance(f.iter, n.Name) and (
            f.iter.name in given if id(f) in in_macro else f.iter.name == "content"))
        for f in fors)


def _media_digest(part: Any) -> str:
    """The media's content hash (vLLM keys the KV of its placeholder tokens by it): xxh3-128 of
    the part's canonical JSON, keys sorted; the gateway's digest is the same."""
    opts = orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS
    return xxhash.xxh3_128_hexdigest(orjson.dumps(part, option=opts, default=str))


def _parsed_call(call: Any) -> Any:
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
            raise ValueError("tool call arguments must be JSON") from None
    return {**call, "function": function}


def _jinja_env() -> Any:
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}  # marks assistant text for training masks; render the body

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
