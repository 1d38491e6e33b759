"""Prompt -> block-aligned chain of 64-bit xxhash values, seeded by a scope (model, LoRA, salt).

Block i's hash is xxh3_64(block i's bytes, seed=hash of block i-1), so equal hashes mean equal prefixes.
"""

from __future__ import annotations

import os
import struct
import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import xxhash

from prefix_index.chat import render_chat
from prefix_index.constants import DEFAULT_BLOCK_BYTES, DEFAULT_BLOCK_SIZE

__all__ = [
    "ByteChunker",
    "Chunker",
    "TokenChunker",
    "ChainHasher",
    "make_chunker",
    "render_chat",
    "scope_key",
]

MODES = ("bytes", "tokens")
# Seed domains: text bytes and token-id bytes of the same scope never share a chain.
_DOMAIN_TEXT = "text"
_DOMAIN_TOKENS = "tokens"
_BATCH = 64  # blocks split per struct call
_SEED_CACHE_MAX = 4096

_xxh3 = xxhash.xxh3_64_intdigest


def scope_key(model: str, lora: str | None = None, salt: str | None = None) -> str:
    """A stable scope string; the chain's seed derives from it, so two scopes share no block.

    Fields are length-prefixed (`m<len>:<model>`, then `l…` and `s…` when given), so no model
    name can imitate another model plus an adapter.
    """
    parts = [f"m{len(model)}:{model}"]
    if lora:
        parts.append(f"l{len(lora)}:{lora}")
    if salt:
        parts.append(f"s{len(salt)}:{salt}")
    return "".join(parts)


@runtime_checkable
class Chunker(Protocol):
    """Turns a prompt into the chain of block hashes the index speaks."""

    mode: str
    tokens_per_block: float  # converts blocks to (estimated) tokens

    def chat_prompt(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None
    ) -> str | list[int]:
        """What a chat request's prompt is hashed as: text (bytes mode) or token ids; `tools`:
        the request's tool definitions, which templates render into the prompt."""
        ...

    def hash_text(self, scope: str, text: str) -> list[int]: ...

    def hash_tokens(self, scope: str, token_ids: Sequence[int]) -> list[int]: ...

    def estimate_tokens(self, text: str) -> int: ...


class ChainHasher:
    """Chained xxh3_64 over full blocks: h[i] = xxh3_64(block i, seed=h[i-1]), h[-1] = seed.

    Holds the struct formats that split a buffer into blocks in C (at most `_BATCH` per block
    size), which is what keeps a 2,048-block chain near 0.2 ms in CPython.
    """

    __slots__ = ("_splitters",)

    def __init__(self) -> None:
        self._splitters: dict[tuple[int, int], struct.Struct] = {}

    def chain(self, data: bytes, block: int, seed: int) -> list[int]:
        """Hashes of the full `block`-byte blocks of `data`; a partial tail is ignored."""
        n = len(data) // block
        out: list[int] = []
        if n == 0:
            return out
        append = out.append
        h = seed
        whole = n - n % _BATCH
        view = memoryview(data)
        if whole:
            for group in self._splitter(block, _BATCH).iter_unpack(view[: whole * block]):
                for piece in group:
                    h = _xxh3(piece, h)
                    append(h)
        if n > whole:
            for piece in self._splitter(block, n - whole).unpack_from(view, whole * block):
                h = _xxh3(piece, h)
                append(h)
        return out

    def _splitter(self, block: int, count: int) -> struct.Struct:
        key = (block, count)
        found = self._splitters.get(key)
        if found is None:
            found = self._splitters[key] = struct.Struct(f"{block}s" * count)
        return found


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian unsigned 32-bit integers (the same bytes on every host)."""
    try:
        packed = array("I", token_ids)
    except OverflowError as exc:
        raise ValueError("token ids must be integers in [0, 2**32)") from exc
    if packed.itemsize != 4:  # pragma: no cover - platforms with 16-bit int
        packed = array("L", token_ids)
    if sys.byteorder == "big":  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


class _Seeds:
    """Per-scope seeds, memoised (bounded) because scopes repeat on every request."""

    __slots__ = ("_cache",)

    def __init__(self) -> None:
        self._cache: dict[tuple[str, str], int] = {}

    def get(self, scope: str, domain: str) -> int:
        key = (scope, domain)
        seed = self._cache.get(key)
        if seed is None:
            if len(self._cache) >= _SEED_CACHE_MAX:
                self._cache.clear()
            seed = self._cache[key] = _xxh3(f"{domain}\x00{scope}".encode())
        return seed


class ByteChunker:
    """Bytes mode (the default, no tokenizer): blocks of `block_bytes` UTF-8 bytes.

    Token-id prompts are hashed in blocks of `block_bytes // 4` tokens, so with the defaults
    (64 bytes, 16 tokens) `hash_tokens` agrees with `TokenChunker(block_size=16).hash_tokens`.
    """

    mode = "bytes"

    def __init__(self, block_bytes: int = DEFAULT_BLOCK_BYTES) -> None:
        if block_bytes < 4:
            raise ValueError(f"block_bytes must be at least 4, got {block_bytes}")
        self.block_bytes = block_bytes
        self.tokens_per_block = block_bytes / 4
        self._token_block = block_bytes // 4
        self._seeds = _Seeds()
        self._hasher = ChainHasher()

    def chat_prompt(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None
    ) -> str:
        return render_chat(messages, tools)

    def hash_text(self, scope: str, text: str) -> list[int]:
        seed = self._seeds.get(scope, _DOMAIN_TEXT)
        return self._hasher.chain(text.encode("utf-8"), self.block_bytes, seed)

    def hash_tokens(self, scope: str, token_ids: Sequence[int]) -> list[int]:
        return self.hash_tokens_after(scope, None, token_ids)

    def hash_tokens_after(
        self, scope: str, parent: int | None, token_ids: Sequence[int]
    ) -> list[int]:
        """Continue a token chain after block hash `parent` (None: from the scope's seed)."""
        seed = self._seeds.get(scope, _DOMAIN_TOKENS) if parent is None else parent
        return self._hasher.chain(token_bytes(token_ids), self._token_block * 4, seed)

    def estimate_tokens(self, text: str) -> int:
        return -(-len(text.encode("utf-8")) // 4)


class TokenChunker:
    """Tokens mode: a local tokenizer gives token ids, chunked into `block_size` tokens.

    `tokenizer_path` is a `tokenizer.json` file or a Hugging Face tokenizer directory holding
    one (and `tokenizer_config.json` / `chat_template.jinja`). A chat renders with the
    directory's own chat template and tokenizes without adding special tokens (the template
    holds them; vLLM does the same), else as ChatML like a completion prompt. `chat_template`:
    None for that default, "chatml" to force ChatML, or a template file to use instead.
    Completion text (`hash_text`) gets the tokenizer's special tokens, as vLLM adds them.

    Nothing is ever downloaded. Construction reads the files and compiles the template
    (blocking): build it at startup, not on the request path.
    """

    mode = "tokens"

    def __init__(
        self,
        tokenizer_path: str | os.PathLike[str],
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        add_special_tokens: bool = True,
        chat_template: str | os.PathLike[str] | None = None,
    ) -> None:
        from prefix_index.templates import chatml_template, load_chat_template

        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        path = os.fspath(tokenizer_path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"tokenizer file not found: {file}")
        from tokenizers import Tokenizer  # optional dependency (the `tokens` extra)

        self._tokenizer = Tokenizer.from_file(file)
        self._template = (
            None if chat_template == "chatml" else load_chat_template(path, chat_template)
        )
        self._chatml = chatml_template()
        self.chat_template_origin = "chatml" if self._template is None else self._template.origin
        self.block_size = block_size
        self.tokens_per_block = float(block_size)
        self._special = add_special_tokens
        self._seeds = _Seeds()
        self._hasher = ChainHasher()
        self._last: tuple[str, list[int]] | None = None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; the last answer is memoised (hash_text and estimate_tokens of
        one prompt tokenize once)."""
        last = self._last
        if last is not None and last[0] == text:
            return last[1]
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=self._special).ids
        self._last = (text, ids)
        return ids

    def chat_prompt(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None
    ) -> list[int]:
        """The token ids the engine prefills for a chat (with its generation prompt)."""
        template = self._template
        if template is not None:
            try:
                text = template.render(messages, tools=tools)
            except Exception:  # noqa: BLE001 - hashing never fails a request
                # The template rejects these messages (a bad role order, say): the engine
                # answers the client's error; the gateway still routes, as ChatML.
                pass
            else:
                ids: list[int] = self._tokenizer.encode(text, add_special_tokens=False).ids
                return ids
        try:
            return self.encode(self._chatml.render(messages, tools=tools))
        except Exception:  # noqa: BLE001 - odd messages: hash their bytes rendering
            return self.encode(render_chat(messages, tools))

    def hash_text(self, scope: str, text: str) -> list[int]:
        return self.hash_tokens(scope, self.encode(text))

    def hash_tokens(self, scope: str, token_ids: Sequence[int]) -> list[int]:
        return self.hash_tokens_after(scope, None, token_ids)

    def hash_tokens_after(
        self, scope: str, parent: int | None, token_ids: Sequence[int]
    ) -> list[int]:
        """Continue a token chain after block hash `parent` (None: from the scope's seed).

        This is the seam for engine KV events: a BlockStored's tokens, hashed after the router
        hash of its parent, give the router hashes of the stored blocks.
        """
        seed = self._seeds.get(scope, _DOMAIN_TOKENS) if parent is None else parent
        return self._hasher.chain(token_bytes(token_ids), self.block_size * 4, seed)

    def estimate_tokens(self, text: str) -> int:
        return len(self.encode(text))


def make_chunker(
    mode: str,
    *,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    tokenizer: str | os.PathLike[str] | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    chat_template: str | os.PathLike[str] | None = None,
) -> Chunker:
    """Build the chunker that `index.chunking` names (`mode: bytes` or `mode: tokens`).

    `chat_template` (tokens mode only): None for the tokenizer directory's own template,
    "chatml", or a template file; see TokenChunker."""
    if mode == "bytes":
        return ByteChunker(block_bytes)
    if mode == "tokens":
        if tokenizer is None:
            raise ValueError(
                "index.chunking.tokenizer is required when index.chunking.mode is tokens"
            )
        return TokenChunker(tokenizer, block_size, chat_template=chat_template)
    raise ValueError(f"index.chunking.mode must be one of {', '.join(MODES)}, got {mode!r}")
