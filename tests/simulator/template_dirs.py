"""Small Hugging Face tokenizer directories, built in a test: a tokenizer.json and a template.

The templates are written here in the shape of real models' templates (Llama 3, Qwen2.5,
Mistral, and a Gemma-like one saved as `chat_template.jinja`), not copied from them. One
byte-level BPE vocabulary holds every model's special tokens, so two directories differ only in
their template and their BOS post-processor.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",  # Qwen (ChatML)
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eot_id|>",  # Llama 3
    "<s>", "</s>", "[INST]", "[/INST]",  # Mistral
    "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>",  # Gemma-like
]
CORPUS = [
    "You are a helpful assistant. Answer briefly and cite the document.",
    "Summarise the document about routing requests to the replica that holds the prefix.",
    "What is the weather in Paris? It is sunny and 21 degrees.",
    '{"name": "get_weather", "arguments": {"city": "Paris"}} tool_call tool_response',
    "system user assistant model tool\n\n",
] * 10

LLAMA3 = (  # one line, as Llama 3's is
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

QWEN25 = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)

GEMMA_LIKE = """{{ bos_token }}
{%- for message in messages %}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}
    {{- '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<start_of_turn>model\\n' }}
{%- endif %}
"""

# name -> (template, how it is stored, bos, eos, the BOS the tokenizer adds to a completion)
MODELS: dict[str, tuple[str, str, str, str, str | None]] = {
    "llama3": (LLAMA3, "config", "<|begin_of_text|>", "<|eot_id|>", "<|begin_of_text|>"),
    "qwen2.5": (QWEN25, "config", "", "<|im_end|>", None),
    "mistral": (MISTRAL, "config-named", "<s>", "</s>", "<s>"),
    "gemma-like": (GEMMA_LIKE, "jinja", "<bos>", "<eos>", "<bos>"),
}


def train_tokenizer(bos: str | None = None) -> Any:
    """A byte-level BPE with every SPECIALS as an added token; `bos`: prepended to encodings
    that add special tokens (as Llama's and Mistral's tokenizer.json do)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    return tok


def make_tokenizer_dir(root: str | os.PathLike[str], model: str) -> str:
    """`root/model/` with tokenizer.json and the model's template stored as real ones are."""
    template, stored, bos, eos, post_bos = MODELS[model]
    folder = Path(root) / model
    folder.mkdir(parents=True, exist_ok=True)
    train_tokenizer(post_bos).save(str(folder / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": {"__type": "AddedToken", "content": bos, "special": True} if bos else None,
        "eos_token": eos,
    }
    if stored == "config":
        config["chat_template"] = template
    elif stored == "config-named":
        config["chat_template"] = [
            {"name": "default", "template": template},
            {"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
        ]
    else:  # saved beside the config, which then holds an older template that must lose
        (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
        config["chat_template"] = "{{ 'stale template' }}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return str(folder)

EXPECTED_GEMMA = "<bos><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n"
