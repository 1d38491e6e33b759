"""A deterministic stand-in tokenizer, a local tokenizer.json, and a ChatML-like chat template.

`Tokenizer` is the seam: `ByteTokenizer` needs nothing; `TokenizerJson` reads a local file with
the `tokenizers` package (nothing is downloaded). Both render chat with the same template.
"""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

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
                    add_generation_prompt: bool = True) -> str: ...

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


def render_chatml(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """ChatML: `<|im_start|>role\\ncontent<|im_end|>\\n` per message, then the
    generation prompt `<|im_start|>assistant\\n`. `developer` is rendered as `system`."""
    out = []
    for m in messages:
        role = str(m.get("role", "user"))
        role = "system" if role == "developer" else role
        out.append(f"{IM_START}{role}\n{render_content(m.get('content'))}{IM_END}\n")
    if add_generation_prompt:
        out.append(f"{IM_START}assistant\n")
    return "".join(out)


class ByteTokenizer:
    """One token per 4 UTF-8 bytes, restarting at special markers and after each newline.

    Restarting at boundaries makes a message's tokens independent of what precedes it, as
    real pre-tokenizers do; so a generated reply, rendered back into the next turn's prompt,
    tokenizes to the ids that were generated and the next turn hits the cached blocks.
    Ids are `16 + crc32(piece) % (vocab_size - 16)`; specials are 1, 2, 3.
    """

    vocab_size = 151_936

    def __init__(self) -> None:
        self._special_ids = {s: i + 1 for i, s in enumerate(_SPECIALS)}
        pieces = [f" {w}"[:4].ljust(4, "_") for w in _WORDS]
        self._filler = {self._piece_id(p.encode()): p for p in dict.fromkeys(pieces)}

    def _piece_id(self, piece: bytes) -> int:
        return 16 + zlib.crc32(piece) % (self.vocab_size - 16)

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        pid = self._piece_id
        for part in _SPLIT.split(text):
            if not part:
                continue
            special = self._special_ids.get(part)
            if special is not None:
                out.append(special)
                continue
            raw = part.encode("utf-8")
            out.extend(pid(raw[i:i + 4]) for i in range(0, len(raw), 4))
        return out

    def render_chat(self, messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool = True) -> str:
        return render_chatml(messages, add_generation_prompt)

    @property
    def filler_ids(self) -> Sequence[int]:
        return tuple(self._filler)

    def decode_filler(self, token_id: int) -> str:
        return self._filler.get(token_id, "")


class TokenizerJson:
    """A local `tokenizer.json` read with the `tokenizers` package (the gateway's tokens mode
    reads the same file, so both cut a prompt into the same ids).

    `encode` adds the tokenizer's special tokens, as vLLM does for completion prompts (and as
    the gateway's TokenChunker does). Chat is rendered with the simulator's ChatML template,
    not the model's. Generated tokens are drawn from ids that decode to whole filler words;
    unlike the ByteTokenizer's, a reply sent back may tokenize to other ids (BPE merges across
    words), which only costs the next turn some cache hits in its last blocks.
    """

    def __init__(self, path: str | os.PathLike[str], *, add_special_tokens: bool = True) -> None:
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        from tokenizers import Tokenizer as HfTokenizer  # optional (the `tokens` extra)

        self.path = path
        self._tok = HfTokenizer.from_file(path)
        self._special = add_special_tokens
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
                    add_generation_prompt: bool = True) -> str:
        return render_chatml(messages, add_generation_prompt)

    @property
    def filler_ids(self) -> Sequence[int]:
        return tuple(self._filler)

    def decode_filler(self, token_id: int) -> str:
        return self._filler.get(token_id, "")
