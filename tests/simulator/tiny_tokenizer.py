"""A tiny byte-level BPE tokenizer.json, trained here in well under a second (no download).

`train_tokenizer(path)` writes it; the simulator (`--tokenizer`) and the gateway's tokens mode
can load the same file, so their token ids agree by construction.
"""

from __future__ import annotations

import os

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "You are a helpful assistant. Answer briefly and cite the document.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps.",
    "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor",
    "Routing requests to the replica that holds the prefix saves prefill time.",
    "KV cache blocks are stored, evicted and cleared by the engine.",
] * 20


def train_tokenizer(path: str | os.PathLike[str], vocab_size: int = 400) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    out = os.fspath(path)
    tok.save(out)
    return out
