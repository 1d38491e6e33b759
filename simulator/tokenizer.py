"""A deterministic stand-in tokenizer and a ChatML-like chat template; no download needed.

`Tokenizer` is the seam: a later `--tokenizer tokenizer.json` backend implements the same four
members with the `tokenizers` package.
"""

from __future__ import annotations

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

    @property
    def filler_ids(self) -> Sequence[int]:
        return tuple(self._filler)

    def decode_filler(self, token_id: int) -> str:
        return self._filler.get(token_id, "")
