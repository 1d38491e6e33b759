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


LLAMA_CHAT = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nbe brief<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)


async def test_a_tokenizer_directory_renders_chat_with_its_own_template(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from tests.simulator.template_dirs import make_tokenizer_dir

    folder = make_tokenizer_dir(tmp_path, "llama3")
    tok = TokenizerJson(folder)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tok.render_chat(messages) == LLAMA_CHAT
    assert tok.render_chat(messages, add_generation_prompt=False) == LLAMA_CHAT.removesuffix(
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    bos = tok.encode("")[0]  # the tokenizer adds <|begin_of_text|> to a completion...
    chat = tok.encode_chat(messages)
    assert chat[0] == bos and chat.count(bos) == 1  # ...and the template adds it to a chat
    assert tok.encode_chat(messages) == tok.encode(LLAMA_CHAT)[1:]
    async with Fleet(n=1, speedup=1000.0, tokenizer=folder) as fleet:
        async with httpx.AsyncClient(timeout=10.0) as http:
            url = fleet.urls[0]
            r = await http.post(url + "/tokenize", json={"messages": messages})
            assert r.json()["tokens"] == chat
            r = await http.post(url + "/tokenize", json={"prompt": "hi"})
            assert r.json()["tokens"] == tok.encode("hi") and r.json()["tokens"][0] == bos
            r = await http.post(url + "/v1/chat/completions",
                                json={"messages": messages, "max_tokens": 3})  # fmt: skip
            assert r.json()["usage"]["prompt_tokens"] == len(chat)


async def test_a_template_that_rejects_a_chat_gets_a_400(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from tests.simulator.template_dirs import make_tokenizer_dir

    folder = make_tokenizer_dir(tmp_path, "mistral")
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ValueError, match="roles must alternate"):
        TokenizerJson(folder).encode_chat(bad)
    async with Fleet(n=1, speedup=1000.0, tokenizer=folder) as fleet:
        async with httpx.AsyncClient(timeout=10.0) as http:
            for path in ("/tokenize", "/v1/chat/completions"):
                r = await http.post(fleet.urls[0] + path, json={"messages": bad})
                assert r.status_code == 400 and "alternate" in r.text, path


def test_template_lookup_override_and_errors(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from simulator.cli import fleet_from_args, parser
    from tests.simulator.template_dirs import EXPECTED_GEMMA, make_tokenizer_dir, train_tokenizer

    short = [{"role": "user", "content": "Hi there"}]
    gemma = make_tokenizer_dir(tmp_path, "gemma-like")  # chat_template.jinja beats the config
    assert TokenizerJson(gemma).render_chat(short) == EXPECTED_GEMMA
    mistral = make_tokenizer_dir(tmp_path, "mistral")  # named templates: "default"
    assert TokenizerJson(mistral).render_chat(short) == "<s>[INST] Hi there [/INST]"
    bare = tmp_path / "bare"
    bare.mkdir()
    train_tokenizer().save(str(bare / "tokenizer.json"))
    assert TokenizerJson(bare).render_chat(short) == "<|im_start|>user\nHi there<|im_end|>\n" \
        "<|im_start|>assistant\n"  # no template: ChatML
    override = tmp_path / "mine.jinja"
    override.write_text("{{ bos_token }}{% for m in messages %}{{ m.content }};{% endfor %}")
    assert TokenizerJson(mistral, chat_template=override).render_chat(short) == "<s>Hi there;"
    args = parser().parse_args(["--tokenizer", mistral, "--chat-template", str(override)])
    fleet = fleet_from_args(args)
    assert fleet.tokenizer is not None and fleet.tokenizer.render_chat(short) == "<s>Hi there;"
    with pytest.raises(ValueError, match="needs --tokenizer"):
        fleet_from_args(parser().parse_args(["--chat-template", str(override)]))
    with pytest.raises(ValueError, match="missing.jinja"):
        TokenizerJson(mistral, chat_template=tmp_path / "missing.jinja")
    override.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="mine.jinja.*does not compile"):
        TokenizerJson(mistral, chat_template=override)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        TokenizerJson(tmp_path)
