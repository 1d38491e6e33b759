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
from typing import Any, Protocol

from prefix_index import templates
from prefix_index.templates import load_chat_template, parsed_tool_call

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
    check_messages(messages)
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
    call = parsed_tool_call(call)
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
    """A tokenizer directory's chat template as the engine applies it: rendered by
    `prefix_index.templates` (transformers' sandbox, vLLM's messages and content formats, the
    one rendering in the project, held to real vLLM's by tests/engine), after the checks vLLM
    makes before rendering, so what vLLM refuses raises ValueError (a 400) here too."""

    def __init__(self, template: templates.ChatTemplate) -> None:
        self._template = template
        self.origin = template.origin

    def render(self, messages: Sequence[Mapping[str, Any]],
               add_generation_prompt: bool = True, tools: Sequence[Any] | None = None) -> str:
        """The prompt text (`tools`: the request's tool definitions, as vLLM passes them); a
        template that rejects the messages raises ValueError (vLLM answers 400)."""
        import jinja2

        check_messages(messages)
        try:
            text: str = self._template.render(messages, add_generation_prompt, tools)
        except (jinja2.TemplateError, TypeError) as exc:
            raise ValueError(f"the chat template rejects these messages: {exc}") from None
        return text


def _load_template(path: str, override: str | os.PathLike[str] | None) -> ChatTemplate | None:
    """vLLM's template lookup (`override`, else the directory's `chat_template.jinja`, else
    `tokenizer_config.json`'s), as the gateway's tokens mode finds it."""
    template = load_chat_template(path, override)
    return None if template is None else ChatTemplate(template)


def check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    """What vLLM refuses before it renders a chat: content that is not a string, a list of
    parts or null; tool-call arguments that are not JSON."""
    for m in messages:
        if not isinstance(m.get("content"), str | list | None):
            raise ValueError("message content must be a string, a list of parts or null")
        calls = m.get("tool_calls")
        for call in calls if m.get("role") == "assistant" and isinstance(calls, list) else ():
            function = call.get("function") if isinstance(call, Mapping) else None
            arguments = function.get("arguments") if isinstance(function, Mapping) else None
            if isinstance(arguments, str) and arguments:
                try:
                    json.loads(arguments)
                except ValueError:
                    raise ValueError("tool call arguments must be JSON") from None
