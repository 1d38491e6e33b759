"""The stand-in tokenizer: deterministic, about 4 bytes a token, chat rendered like ChatML."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from simulator import ByteTokenizer, Engine, Fleet, build_config
from simulator.tokenizer import TokenizerJson


def test_same_text_same_tokens_four_bytes_each() -> None:
    tok = ByteTokenizer()
    text = "The quick brown fox jumps over the lazy dog"  # 43 bytes
    ids = tok.encode(text)
    assert ids == ByteTokenizer().encode(text)
    assert len(ids) == 11
    assert all(16 <= i < tok.vocab_size for i in ids)
    assert tok.encode(text + " again")[:10] == ids[:10]
    assert tok.encode("é" * 10) == ByteTokenizer().encode("é" * 10)  # bytes, not characters


def test_chat_rendering_is_append_only_and_marks_roles() -> None:
    tok = ByteTokenizer()
    one = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    two = [*one, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    text = tok.render_chat(one)
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.render_chat(two).startswith(tok.render_chat(one, add_generation_prompt=False))
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "a"},
                {"type": "image_url", "image_url": {"url": "x"}},
                {"type": "text", "text": "b"},
            ],
        }
    ]
    assert "a\nb" in tok.render_chat(parts)
    assert tok.encode(tok.render_chat(one))[0] == 2  # <|im_start|> is one special token


def test_a_generated_reply_tokenizes_back_to_the_generated_ids() -> None:
    tok = ByteTokenizer()
    e = Engine(build_config("qwen2.5-14b", "a100-80g"), filler_ids=tok.filler_ids)
    messages = [{"role": "user", "content": "tell me a story"}]
    seq = e.add_request("a", tok.encode(tok.render_chat(messages)), arrival_s=0.0, max_tokens=30)
    while e.has_work:
        e.begin_step(e.now_s)
        e.end_step()
    reply = "".join(tok.decode_filler(t) for t in seq.output)
    assert tok.encode(reply) == seq.output
    history = [
        *messages,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "go on"},
    ]
    ids = tok.encode(tok.render_chat(history))
    assert ids[: seq.num_tokens] == seq.prompt + seq.output  # the next turn extends this one


async def test_a_local_tokenizer_json_serves_tokenize_chat_and_replies(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    from tests.simulator.tiny_tokenizer import train_tokenizer

    path = train_tokenizer(tmp_path / "tokenizer.json")
    tok = TokenizerJson(path)
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1  # a special token, one id
    assert all(tok.decode_filler(i) for i in tok.filler_ids)
    messages = [{"role": "user", "content": "The quick brown fox"}]
    async with Fleet(n=1, speedup=1000.0, tokenizer=path) as fleet:
        async with httpx.AsyncClient(timeout=10.0) as http:
            r = await http.post(fleet.urls[0] + "/tokenize", json={"messages": messages})
            assert r.json()["tokens"] == tok.encode(tok.render_chat(messages))
            r = await http.post(fleet.urls[0] + "/v1/chat/completions",
                                json={"messages": messages, "max_tokens": 5})  # fmt: skip
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(tok.encode(tok.render_chat(messages)))
    assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["message"]["content"]
    with pytest.raises(FileNotFoundError):
        TokenizerJson(tmp_path / "missing.json")
