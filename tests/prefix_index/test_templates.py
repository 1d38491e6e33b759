"""Tokens mode renders a chat with the model's own chat template, as the engine does.

Each tokenizer directory is built here (tests/simulator/template_dirs.py): a BPE tokenizer.json
trained in the test and a template in the shape of Llama 3, Qwen2.5, Mistral or a Gemma-like
model's. The simulator reads the same directory and stands in for vLLM: it renders templates with
the same code (prefix_index.templates), so here each template is held to its model's own format
(the texts expected below) and the two to the same tokenization; tests/engine holds the rendering
to real vLLM's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from gateway import ConfigError, create_app, parse_config  # noqa: E402
from gateway.fleet.kv_events import check_parity  # noqa: E402
from gateway.transport.control import open_control_client  # noqa: E402
from prefix_index.chunking import TokenChunker, make_chunker, scope_key  # noqa: E402
from prefix_index.templates import load_chat_template  # noqa: E402
from simulator import Fleet  # noqa: E402
from simulator.tokenizer import TokenizerJson  # noqa: E402
from tests.simulator.template_dirs import MODELS, make_tokenizer_dir, train_tokenizer  # noqa: E402
from tests.support import poll_until, start_server  # noqa: E402

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
OTHER_IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,R0lGODlh"}}
ALTERNATING = [
    {"role": "user", "content": "Summarise the document about routing."},
    {"role": "assistant", "content": "It routes requests to the replica holding the prefix."},
    {"role": "user", "content": [{"type": "text", "text": "And this picture?"}, IMAGE]},
]
WITH_SYSTEM = [{"role": "system", "content": "You are a helpful assistant."}, *ALTERNATING]
WITH_TOOLS = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    {"role": "assistant", "content": "It is 21 degrees."},
    {"role": "user", "content": "Thanks."},
]
# each model's conversation (what its template accepts) and where it may be cut append-only
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "llama3": WITH_SYSTEM,
    "qwen2.5": WITH_TOOLS,
    "mistral": ALTERNATING,
    "gemma-like": WITH_SYSTEM,
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {model: make_tokenizer_dir(root, model) for model in MODELS}


def plain_ids(folder: str, text: str) -> list[int]:
    from tokenizers import Tokenizer

    ids: list[int] = (
        Tokenizer.from_file(f"{folder}/tokenizer.json").encode(text, add_special_tokens=False).ids
    )
    return ids


SHORT = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Weather?"},
]
EXPECTED = {
    "llama3": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nWeather?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "qwen2.5": "<|im_start|>system\nYou are Qwen, a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
    "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n",
    "mistral": "<s>[INST] Hi there [/INST] Hello!</s>[INST] Weather? [/INST]",
    "gemma-like": "<bos><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n"
    "Hello!<end_of_turn>\n<start_of_turn>user\nWeather?<end_of_turn>\n<start_of_turn>model\n",
}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_each_template_renders_its_model_format(dirs: dict[str, str], model: str) -> None:
    template = load_chat_template(dirs[model])
    assert template is not None
    assert template.render(SHORT) == EXPECTED[model]
    chunker = TokenChunker(dirs[model])
    assert chunker.chat_prompt(SHORT) == plain_ids(dirs[model], EXPECTED[model])


def test_qwen_renders_tool_calls_with_parsed_arguments_and_a_default_system(
    dirs: dict[str, str],
) -> None:
    template = load_chat_template(dirs["qwen2.5"])
    assert template is not None
    text = template.render(WITH_TOOLS[1:4])
    assert text.startswith("<|im_start|>system\nYou are Qwen, a helpful assistant.<|im_end|>\n")
    # arguments arrive as JSON text and render as an object, non-ASCII kept (transformers' tojson)
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Zürich"}}\n</tool_call><|im_end|>\n'
    ) in text
    assert '<|im_start|>user\n<tool_response>\n{"temp_c": 21}\n</tool_response><|im_end|>\n' in text
    assert WITH_TOOLS[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Zürich"}'


def test_chats_add_no_special_tokens_completions_do(dirs: dict[str, str]) -> None:
    chunker = TokenChunker(dirs["llama3"])
    [bos] = plain_ids(dirs["llama3"], "<|begin_of_text|>")
    chat = chunker.chat_prompt(SHORT)
    assert chat[0] == bos and chat.count(bos) == 1  # the template's BOS, not a second one
    assert chunker.encode("Hi there")[0] == bos  # /v1/completions: the tokenizer adds it
    assert chunker.hash_text("s", "Hi there " * 40) == chunker.hash_tokens(
        "s", chunker.encode("Hi there " * 40)
    )


@pytest.mark.parametrize("model", sorted(MODELS))
def test_gateway_and_simulator_give_the_same_ids(dirs: dict[str, str], model: str) -> None:
    messages = CONVERSATIONS[model]
    gateway = TokenChunker(dirs[model], block_size=4)
    engine = TokenizerJson(dirs[model])
    ids = gateway.chat_prompt(messages)
    assert ids == engine.encode_chat(messages)
    assert gateway.chat_prompt(SHORT) == engine.encode_chat(SHORT)
    assert gateway.encode("a completion prompt") == engine.encode("a completion prompt")
    assert len(gateway.hash_tokens(scope_key("m"), ids)) == len(ids) // 4


@pytest.mark.parametrize("model", sorted(MODELS))
def test_an_earlier_turn_is_a_token_prefix_of_the_whole_chat(
    dirs: dict[str, str], model: str
) -> None:
    messages = CONVERSATIONS[model]
    template = load_chat_template(dirs[model])
    assert template is not None
    full = TokenChunker(dirs[model]).chat_prompt(messages)
    cuts = range(2, len(messages), 2) if model == "mistral" else range(1, len(messages))
    for k in cuts:
        head = plain_ids(dirs[model], template.render(messages[:k], add_generation_prompt=False))
        assert full[: len(head)] == head, (model, k)


def test_qwen_consecutive_tool_results_are_not_append_only(dirs: dict[str, str]) -> None:
    """Where a template looks ahead (Qwen closes a run of tool results only after the last),
    a cut inside the run is no prefix; the engine's cache shows the same."""
    template = load_chat_template(dirs["qwen2.5"])
    assert template is not None
    two = [*WITH_TOOLS[:4], {"role": "tool", "tool_call_id": "call_2", "content": "ok"}]
    head = template.render(two[:4], add_generation_prompt=False)
    assert not template.render(two).startswith(head)
    assert template.render(two).startswith(head.removesuffix("<|im_end|>\n"))


def test_different_templates_give_different_ids(dirs: dict[str, str]) -> None:
    ids = {model: tuple(TokenChunker(dirs[model]).chat_prompt(SHORT)) for model in MODELS}
    assert len(set(ids.values())) == len(MODELS)
    chatml = TokenChunker(dirs["llama3"], chat_template="chatml").chat_prompt(SHORT)
    assert tuple(chatml) not in ids.values()


def test_media_parts_hash_by_content(dirs: dict[str, str]) -> None:
    chunker = TokenChunker(dirs["llama3"])

    def ask(*parts: Any) -> list[int]:
        return chunker.chat_prompt([{"role": "user", "content": list(parts)}])

    text = {"type": "text", "text": "Describe it."}
    assert ask(text, IMAGE) == ask(text, dict(IMAGE))
    assert ask(text, IMAGE) != ask(text, OTHER_IMAGE)
    template = load_chat_template(dirs["llama3"])
    assert template is not None
    rendered = template.render([{"role": "user", "content": [text, IMAGE, "more"]}])
    assert "\n\n<image_url:" in rendered and ">\nDescribe it.\nmore<|eot_id|>" in rendered


def test_where_the_template_is_found(dirs: dict[str, str], tmp_path: Path) -> None:
    gemma = TokenChunker(dirs["gemma-like"])  # chat_template.jinja beats tokenizer_config.json
    assert gemma.chat_template_origin.endswith("chat_template.jinja")
    assert "stale" not in (load_chat_template(dirs["gemma-like"]) or pytest.fail()).render(SHORT)
    mistral = load_chat_template(dirs["mistral"])  # a list of named templates: "default"
    assert mistral is not None and mistral.render(SHORT) == EXPECTED["mistral"]
    bare = tmp_path / "bare"
    bare.mkdir()
    train_tokenizer().save(str(bare / "tokenizer.json"))
    for path in (bare, bare / "tokenizer.json", Path(dirs["llama3"]) / "tokenizer.json"):
        chunker = TokenChunker(path)  # no template (or a bare file): ChatML, as before
        assert chunker.chat_template_origin == "chatml"
        assert chunker.chat_prompt(SHORT) == TokenizerJson(path).encode_chat(SHORT)
    override = tmp_path / "override.jinja"
    override.write_text("{% for m in messages %}{{ bos_token }}{{ m.content }}|{% endfor %}")
    chunker = TokenChunker(dirs["llama3"], chat_template=str(override))
    assert chunker.chat_prompt(SHORT) == plain_ids(
        dirs["llama3"],
        "<|begin_of_text|>Hi there|<|begin_of_text|>Hello!|<|begin_of_text|>Weather?|",
    )
    made = make_chunker("tokens", tokenizer=dirs["qwen2.5"], chat_template="chatml")
    assert isinstance(made, TokenChunker) and made.chat_template_origin == "chatml"


def test_missing_or_broken_templates_fail_clearly(dirs: dict[str, str], tmp_path: Path) -> None:
    folder = tmp_path / "broken"
    folder.mkdir()
    train_tokenizer().save(str(folder / "tokenizer.json"))
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": "{% for m in messages %}{{ m.content }"}))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json.*does not compile"):
        TokenChunker(folder)
    config.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "x"}]}))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json.*'default'"):
        TokenChunker(folder)
    config.write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json"):
        TokenChunker(folder)
    with pytest.raises(ValueError, match=r"missing\.jinja"):
        TokenChunker(dirs["llama3"], chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        TokenChunker(tmp_path)


def test_a_template_that_rejects_the_chat_still_routes(dirs: dict[str, str]) -> None:
    bad = [{"role": "assistant", "content": "first"}, {"role": "user", "content": "hi"}]
    chunker = TokenChunker(dirs["mistral"])
    assert chunker.chat_prompt(bad)  # the engine answers the error; the gateway still routes
    with pytest.raises(ValueError, match="alternate"):
        TokenizerJson(dirs["mistral"]).encode_chat(bad)


async def test_parity_fails_when_the_gateway_renders_chats_with_another_template(
    dirs: dict[str, str],
) -> None:
    """Same tokenizer, other chat template: the completion probe agrees, the chat probe does not."""
    name = sorted(MODELS)[0]
    async with Fleet(n=1, speedup=1000.0, tokenizer=dirs[name]) as fleet:
        async with open_control_client(5.0) as client:
            wrong = TokenChunker(dirs[name], chat_template="chatml")
            assert await check_parity(client, fleet.urls[0], None, wrong) is False
            assert await check_parity(client, fleet.urls[0], None, TokenChunker(dirs[name])) is True


@pytest.mark.parametrize("model", sorted(MODELS))
async def test_tokenize_parity_against_a_simulated_replica(
    dirs: dict[str, str], model: str
) -> None:
    chunker = TokenChunker(dirs[model])
    messages = CONVERSATIONS[model]
    async with Fleet(n=1, speedup=1000.0, tokenizer=dirs[model]) as fleet:
        url = fleet.urls[0]
        async with open_control_client(5.0) as client:
            assert await check_parity(client, url, None, chunker) is True
        async with httpx.AsyncClient(timeout=10.0) as http:
            r = await http.post(url + "/tokenize", json={"messages": messages})
            assert r.status_code == 200 and r.json()["tokens"] == chunker.chat_prompt(messages)
            r = await http.post(
                url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2}
            )
            assert r.status_code == 200
            assert r.json()["usage"]["prompt_tokens"] == len(chunker.chat_prompt(messages))
            if model == "mistral":  # the engine refuses what the template refuses
                bad = [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
                r = await http.post(url + "/v1/chat/completions", json={"messages": bad})
                assert r.status_code == 400 and "alternate" in r.text


async def test_the_gateway_loads_a_tokenizer_directory_and_keeps_parity(
    dirs: dict[str, str],
) -> None:
    async with Fleet(n=1, speedup=1000.0, tokenizer=dirs["llama3"]) as fleet:
        config = parse_config(
            {
                "pools": {"chat": {"replicas": [{"url": fleet.urls[0], "name": "r0"}]}},
                "index": {"chunking": {"mode": "tokens", "tokenizer": dirs["llama3"]}},
            }
        )
        app = create_app(config)
        gw = await start_server(app, lifespan="on")
        try:
            await poll_until(lambda: app.gateway.parity.get("r0") == 1)
            chunker = app.gateway.chunker
            assert isinstance(chunker, TokenChunker)
            assert chunker.chat_template_origin.endswith("tokenizer_config.json (chat_template)")
            assert chunker.chat_prompt(SHORT) == TokenizerJson(dirs["llama3"]).encode_chat(SHORT)
        finally:
            await gw.stop()


def chunking_problems(**chunking: Any) -> list[str]:
    try:
        parse_config(
            {
                "pools": {"p": {"replicas": [{"url": "http://127.0.0.1:9"}]}},
                "index": {"chunking": {"mode": "tokens", **chunking}},
            }
        )
    except ConfigError as exc:
        return exc.problems
    return []


def test_config_accepts_a_directory_and_names_each_problem(
    dirs: dict[str, str], tmp_path: Path
) -> None:
    assert chunking_problems(tokenizer=dirs["qwen2.5"]) == []
    assert chunking_problems(tokenizer=dirs["qwen2.5"], chat_template="chatml") == []
    assert chunking_problems(tokenizer=f"{dirs['qwen2.5']}/tokenizer.json") == []
    (tmp_path / "empty").mkdir()
    [problem] = chunking_problems(tokenizer=str(tmp_path / "empty"))
    assert problem.startswith("index.chunking.tokenizer:") and "has no tokenizer.json" in problem
    [problem] = chunking_problems(tokenizer=str(tmp_path / "nowhere"))
    assert problem.startswith("index.chunking.tokenizer:")
    # the old name of the default is still accepted and means the default
    assert chunking_problems(tokenizer=dirs["qwen2.5"], chat_template="canonical") == []
    [problem] = chunking_problems(tokenizer=dirs["qwen2.5"], chat_template="nowhere.jinja")
    assert problem.startswith("index.chunking.chat_template: no such file 'nowhere.jinja'")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% if messages %}never closed")
    [problem] = chunking_problems(tokenizer=dirs["qwen2.5"], chat_template=str(broken))
    assert problem.startswith("index.chunking.chat_template:")
    assert "broken.jinja" in problem and "does not compile" in problem
    folder = tmp_path / "bad_config"
    folder.mkdir()
    train_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x"}))
    [problem] = chunking_problems(tokenizer=str(folder))
    assert problem.startswith("index.chunking.tokenizer:") and "tokenizer_config.json" in problem


@pytest.mark.parametrize("shape", ["agent", "multi_turn", "system", "text_parts"])
def test_builtin_chatml_matches_the_simulators_for_every_chat_shape(tmp_path: Path, shape: str) -> None:
    """A bare tokenizer.json (no template): both sides render ChatML, tool calls and results
    included, and cut the same ids."""
    from bench.shapes import SHAPES

    path = tmp_path / "tokenizer.json"
    train_tokenizer().save(str(path))
    gateway, engine = TokenChunker(path), TokenizerJson(path)
    for r in SHAPES[shape](12, 5.0, 0):
        messages, tools = r.body["messages"], r.body.get("tools")
        assert gateway.chat_prompt(messages, tools) == engine.encode_chat(messages, True, tools)
        if tools:  # rendered into the system message: the chat without them differs there
            assert gateway.chat_prompt(messages) != gateway.chat_prompt(messages, tools)


# vLLM's content formats (vllm/renderers/hf.py): a template that loops over a message's content
# gets OpenAI parts, any other the text joined by newlines; names bound to the messages, slices,
# filters and macros count as vLLM counts them
LOOPS = {
    "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}|{% endfor %}{% endfor %}":
        "openai",
    "{% for m in messages[1:] %}{% for p in m.content | list %}{{ p.text }}|{% endfor %}"
    "{% endfor %}": "openai",
    "{% set msgs = messages %}{% for m in msgs %}{% for p in m.content %}{{ p.text }}{% endfor %}"
    "{% endfor %}": "openai",
    "{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ show(m.content) }}{% endfor %}": "openai",
    "{% for m in messages %}{{ m.content }}|{% endfor %}": "string",
    "{% for m in messages %}{% for c in m.tool_calls %}{{ c }}{% endfor %}{{ m.content }}"
    "{% endfor %}": "string",
}  # fmt: skip


@pytest.mark.parametrize("source", list(LOOPS))
def test_content_format_is_vllms(source: str) -> None:
    from prefix_index.templates import ChatTemplate

    ours = ChatTemplate(source, origin="t")
    assert ours.content_format == LOOPS[source]
    chat = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    rendered = ours.render(chat, add_generation_prompt=False)
    # parts: "a|b|" (or "ab"); one string: "a\nb|"
    assert ("\n" in rendered) == (LOOPS[source] == "string")


def test_a_developer_message_is_a_system_one_where_the_template_has_no_developer() -> None:
    from prefix_index.templates import ChatTemplate

    plain = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    knows = plain + "{% if false %}'developer'{% endif %}"
    chat = [{"role": "developer", "content": "D"}, {"role": "user", "content": "U"},
            {"role": "system", "content": "S"}]  # fmt: skip
    for source, want in ((plain, "<system>D\n\nS<user>U"), (knows, "<developer>D<user>U<system>S")):
        assert ChatTemplate(source, origin="t").render(chat, add_generation_prompt=False) == want
