"""Chunking: block-aligned chained xxhash in bytes mode and in tokens mode (a tiny local BPE)."""

from __future__ import annotations

from pathlib import Path

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from prefix_index.chunking import (
    ByteChunker,
    Chunker,
    TokenChunker,
    make_chunker,
    scope_key,
    token_bytes,
)

SCOPE = scope_key("llama-3-8b")
CORPUS = [
    "You are a helpful assistant. Answer briefly and cite your sources.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps.",
    "KV caches hold keys and values of attention for every prefilled token.",
    "Routing a request to the replica that already holds its prefix skips prefill.",
] * 8


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny byte-level BPE trained here: no download, about 300 tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_scope_key_is_stable_and_keeps_models_adapters_and_salts_apart() -> None:
    assert scope_key("m") == scope_key("m", None, None) == scope_key("m", "", "")
    keys = {
        scope_key("m"),
        scope_key("m", "lora1"),
        scope_key("m", salt="s"),
        scope_key("m", "lora1", "s"),
        scope_key("m2"),
        scope_key("ml5:lora1"),  # a model name cannot imitate model + adapter
    }
    assert len(keys) == 6


def test_only_full_blocks_are_hashed() -> None:
    chunker = ByteChunker(64)
    assert chunker.hash_text(SCOPE, "x" * 63) == []
    assert len(chunker.hash_text(SCOPE, "x" * 64)) == 1
    assert len(chunker.hash_text(SCOPE, "x" * 200)) == 3
    assert chunker.hash_text(SCOPE, "") == []


def test_each_hash_covers_its_parent_and_its_own_bytes() -> None:
    chunker = ByteChunker(16)
    text = "é" * 40  # 80 UTF-8 bytes: blocks are bytes, not characters
    data = text.encode()
    hashes = chunker.hash_text(SCOPE, text)
    assert len(hashes) == 5
    parent = xxhash.xxh3_64_intdigest(f"text\x00{SCOPE}".encode())
    for i, h in enumerate(hashes):
        parent = xxhash.xxh3_64_intdigest(data[16 * i : 16 * i + 16], parent)
        assert h == parent


@settings(max_examples=150, deadline=None)
@given(head=st.text(max_size=300), tail=st.text(max_size=300), block=st.sampled_from([4, 16, 64]))
def test_a_prompt_and_its_continuation_share_the_full_blocks_of_the_prompt(
    head: str, tail: str, block: int
) -> None:
    chunker = ByteChunker(block)
    short = chunker.hash_text(SCOPE, head)
    long = chunker.hash_text(SCOPE, head + tail)
    assert long[: len(short)] == short
    assert len(short) == len(head.encode()) // block


def test_a_changed_byte_changes_its_block_and_every_later_one() -> None:
    chunker = ByteChunker(64)
    text = "".join(chr(ord("a") + i % 26) for i in range(64 * 8))
    edited = text[: 64 * 3 + 5] + "!" + text[64 * 3 + 6 :]
    a, b = chunker.hash_text(SCOPE, text), chunker.hash_text(SCOPE, edited)
    assert a[:3] == b[:3]
    assert all(x != y for x, y in zip(a[3:], b[3:], strict=True))


def test_scopes_and_domains_share_no_block() -> None:
    chunker = ByteChunker(64)
    text = "shared system prompt " * 40
    base = set(chunker.hash_text(SCOPE, text))
    assert not base & set(chunker.hash_text(scope_key("other-model"), text))
    assert not base & set(chunker.hash_text(scope_key("llama-3-8b", "adapter"), text))
    ids = list(text.encode())  # token ids whose bytes could mimic the text's
    assert not base & set(chunker.hash_tokens(SCOPE, ids))


def test_bytes_mode_hashes_token_ids_in_blocks_of_a_quarter_of_block_bytes() -> None:
    ids = list(range(1000, 1100))
    hashes = ByteChunker(64).hash_tokens(SCOPE, ids)
    assert len(hashes) == 100 // 16
    assert ByteChunker(64).hash_tokens(SCOPE, ids[:16]) == hashes[:1]
    with pytest.raises(ValueError, match="token ids"):
        ByteChunker(64).hash_tokens(SCOPE, [-1] * 16)
    assert token_bytes([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"


def test_estimate_tokens_is_a_quarter_of_the_utf8_bytes() -> None:
    chunker = ByteChunker()
    assert chunker.tokens_per_block == 16.0
    assert chunker.estimate_tokens("abcd" * 10) == 10
    assert chunker.estimate_tokens("abcde") == 2
    assert chunker.estimate_tokens("") == 0


def test_tokens_mode_chunks_token_ids_from_a_local_tokenizer(tokenizer_path: Path) -> None:
    chunker = TokenChunker(tokenizer_path, block_size=4)
    assert isinstance(chunker, Chunker)
    assert chunker.mode == "tokens" and chunker.tokens_per_block == 4.0
    text = " ".join(CORPUS[:4])
    ids = chunker.encode(text)
    assert len(ids) > 20
    assert chunker.estimate_tokens(text) == len(ids)
    hashes = chunker.hash_text(SCOPE, text)
    assert hashes == chunker.hash_tokens(SCOPE, ids)
    assert len(hashes) == len(ids) // 4
    # One chain for text and token-id prompts, and the same blocks as bytes mode's token path.
    assert TokenChunker(tokenizer_path, 16).hash_tokens(SCOPE, ids) == ByteChunker(64).hash_tokens(
        SCOPE, ids
    )


def test_a_token_chain_continues_after_a_parent_hash(tokenizer_path: Path) -> None:
    chunker = TokenChunker(tokenizer_path, block_size=4)
    ids = list(range(100, 124))
    whole = chunker.hash_tokens(SCOPE, ids)
    assert chunker.hash_tokens_after(SCOPE, whole[2], ids[12:]) == whole[3:]
    assert chunker.hash_tokens_after(SCOPE, None, ids) == whole


def test_tokens_mode_never_downloads(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer file not found"):
        TokenChunker(tmp_path / "missing.json")
    with pytest.raises(FileNotFoundError):
        TokenChunker("meta-llama/Llama-3-8B")  # a hub name is not a local file


def test_make_chunker_builds_each_mode_by_name(tokenizer_path: Path) -> None:
    assert isinstance(make_chunker("bytes"), ByteChunker)
    assert make_chunker("bytes", block_bytes=128).tokens_per_block == 32.0
    tokens = make_chunker("tokens", tokenizer=str(tokenizer_path), block_size=8)
    assert isinstance(tokens, TokenChunker) and tokens.block_size == 8
    with pytest.raises(ValueError, match="index.chunking.tokenizer is required"):
        make_chunker("tokens")
    with pytest.raises(ValueError, match="index.chunking.mode must be one of bytes, tokens"):
        make_chunker("words")
    with pytest.raises(ValueError, match="block_bytes"):
        make_chunker("bytes", block_bytes=2)


def test_a_long_chain_is_block_aligned_across_internal_batches() -> None:
    chunker = ByteChunker(8)
    text = "0123456789abcdef" * 700  # 1,400 blocks: whole batches plus a remainder
    hashes = chunker.hash_text(SCOPE, text + "xyz")
    assert len(hashes) == 1400
    assert chunker.hash_text(SCOPE, text[: 8 * 130]) == hashes[:130]
