"""A tiny model directory real vLLM serves on a CPU: made here, nothing from a hub.

`make_model_dir(dir, template)` trains a byte-level BPE with `tokenizers` on text shaped like the
benchmarks' prompts (`simulator.workloads.text` pieces, English words, tool-call JSON), then the
engine's own interpreter saves it with `transformers` (`bench/engine/save.py`: tokenizer.json,
tokenizer_config.json, the chat template) beside a `config.json` of a 2-layer Qwen2 or Llama.
vLLM starts it with `--load-format dummy` (random weights): the answers are noise, the prompt
processing (template, tokens, KV blocks, prefix cache) is the real engine's.
"""

from __future__ import annotations

import json
import random
import struct
import subprocess
from pathlib import Path

from simulator.workloads import text

TEMPLATES = ("chatml", "llama3")
VOCAB = 4096
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIALS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eot_id|>",
]  # fmt: skip
_WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an have not "
    "which but all were when we there can more if will one about their has would what so up "
    "document question answer routing replica prefix cache block token model request engine "
    "system user assistant tool search read file run tests fetch url query limit result"
).split()

# ChatML as Qwen2.5 renders a chat, written here in that shape: a request's `tools` go into the
# system message after its content, tool calls and results as Qwen's; the gateway's tokens mode
# renders the directory's template as vLLM does.
CHATML = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call functions. Their signatures:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nCall one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "system" and loop.first %}
    {%- elif message.role == "user" or message.role == "system" or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
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
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
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

# Llama 3's shape: BOS from the template, a header per message, content trimmed
LLAMA3 = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] | trim }}"
    "{%- elif message['content'] is iterable %}{%- for part in message['content'] %}{%- if part['type'] == 'text' %}"
    "{{- part['text'] | trim }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def corpus(seed: int = 0, lines: int = 3000) -> list[str]:
    """Training text shaped like what the benchmarks send: 4-byte pieces, words, tool JSON."""
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        out.append(text(f"corpus-{seed}-{i}", rng.randint(20, 80)))
        out.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(10, 40))))
        if i % 10 == 0:
            args = json.dumps({"query": text(f"q-{i}", 4).strip(), "limit": rng.randint(1, 50)})
            out.append(f'<tool_call>\n{{"name": "search", "arguments": {args}}}\n</tool_call>')
    return out


def train_tokenizer(path: Path, seed: int = 0) -> None:
    """A byte-level BPE of VOCAB ids (both templates' special tokens first) to `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=CHATML_SPECIALS + LLAMA3_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer)
    tok.save(str(path))


def tokenizer_dir(out: str | Path, template: str = "chatml", seed: int = 0) -> Path:
    """The tokenizer alone, without transformers (the simulator's `--tokenizer`): tokenizer.json
    and the template as chat_template.jinja. The ids are the model directory's (same training),
    its pre-tokenizer the one tokenizers trained, not what transformers loads for a Qwen2."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out / "tokenizer.json", seed)
    (out / "chat_template.jinja").write_text(CHATML if template == "chatml" else LLAMA3)
    return out


def lora_dir(out: str | Path, rank: int = 8, seed: int = 0) -> Path:
    """A LoRA adapter for the tiny model (q_proj and v_proj of both layers), as PEFT saves one:
    adapter_config.json and adapter_model.safetensors in bfloat16, written here without torch.
    A is small noise and B zero, so the adapter loads and serves the base model's answers."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    hidden, kv_out = 256, 2 * 64
    tensors: dict[str, tuple[list[int], bytes]] = {}
    for layer in range(2):
        for proj, rows in (("q_proj", hidden), ("v_proj", kv_out)):
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            a = [rng.gauss(0.0, 0.01) for _ in range(rank * hidden)]
            tensors[f"{name}.lora_A.weight"] = ([rank, hidden], _bf16(a))
            tensors[f"{name}.lora_B.weight"] = ([rows, rank], bytes(2 * rows * rank))
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset, data = 0, []
    for name, (shape, raw) in tensors.items():
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        data.append(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    (out / "adapter_model.safetensors").write_bytes(
        struct.pack("<Q", len(head)) + head + b"".join(data)
    )
    config = {
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"], "bias": "none", "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "tiny",
    }  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def _bf16(values: list[float]) -> bytes:
    """float32 values cut to bfloat16 (their high 16 bits), little-endian."""
    raw = struct.pack(f"<{len(values)}f", *values)
    return b"".join(raw[i + 2 : i + 4] for i in range(0, len(raw), 4))


def model_config(template: str, special: dict[str, int]) -> dict[str, object]:
    """config.json of a 2-layer model: Qwen2 for ChatML, Llama for the Llama-3 template.
    head_dim 64: vLLM's CPU attention refuses 16."""
    arch, kind = ("Qwen2ForCausalLM", "qwen2") if template == "chatml" else ("LlamaForCausalLM", "llama")
    bos, eos = ("<|endoftext|>", "<|im_end|>") if template == "chatml" else ("<|begin_of_text|>", "<|eot_id|>")
    return {
        "architectures": [arch],
        "model_type": kind,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "vocab_size": VOCAB,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": special[bos],
        "eos_token_id": special[eos],
    }


def make_model_dir(
    out: str | Path, template: str = "chatml", *, engine_python: str | Path, seed: int = 0
) -> Path:
    """The model directory for `template` ("chatml": a Qwen2, "llama3": a Llama) at `out`,
    its tokenizer saved by `engine_python`'s transformers. Returns the directory."""
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {TEMPLATES}, got {template!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "bpe.json"
    train_tokenizer(raw, seed)
    vocab = json.loads(raw.read_text())["added_tokens"]
    special = {t["content"]: t["id"] for t in vocab}
    spec = {
        "tokenizer_file": str(raw),
        "template": CHATML if template == "chatml" else LLAMA3,
        "bos": "<|endoftext|>" if template == "chatml" else "<|begin_of_text|>",
        "eos": "<|im_end|>" if template == "chatml" else "<|eot_id|>",
        "pad": "<|endoftext|>",
        "out": str(out),
    }
    (out / "config.json").write_text(json.dumps(model_config(template, special), indent=1))
    save = Path(__file__).with_name("save.py")
    done = subprocess.run([str(engine_python), str(save), json.dumps(spec)],
                          capture_output=True, timeout=300)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"saving the tokenizer failed:\n{done.stderr.decode()[-2000:]}")
    raw.unlink()
    return out
