"""Routing workloads as the OpenAI request bodies clients send, one generator per prompt shape.

The routing benchmark routes these bodies through the gateway's own parser and hashing, so a
shape the gateway hashes wrongly shows up; `to_sim_requests` renders them as the engine would.
"""

from __future__ import annotations

import functools
import json
import random
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench.routing_workloads import TRACE, TRACE_BLOCK_TOKENS, trace_arrivals
from simulator.des import SimRequest
from simulator.tokenizer import ByteTokenizer, Tokenizer
from simulator.workloads import WorkItem, arrivals, shared_prompts, text
from simulator.workloads import multi_turn as multi_turn_chats

MODEL = "bench-model"
VOCAB = ByteTokenizer.vocab_size  # completion_ids draws ids from [16, VOCAB), as ByteTokenizer


@dataclass(frozen=True, slots=True)
class ShapedRequest:
    """One client request: when it arrives, which endpoint, the exact JSON body it sends.

    Requests of one conversation share their history's message dicts: read bodies, or parse
    `raw`, but do not change them.
    """

    arrival_s: float
    kind: str  # "chat" or "completions" (the endpoint; gateway.openai.Kind)
    body: dict[str, Any]
    group: str  # which shared prefix it belongs to ("doc17", "conv3", ...)
    first: bool  # the first request of its group (a cold prefix); False for repeats

    @property
    def raw(self) -> bytes:
        """The body as sent on the wire (encoded on each access)."""
        return orjson.dumps(self.body)


# --- helpers -------------------------------------------------------------------------------------
def _stream(body: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    body["max_tokens"] = max_tokens
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    return body


def _chat(model: str, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    return _stream({"model": model, "messages": messages}, max_tokens)


def _completion(model: str, prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
    return _stream({"model": model, "prompt": prompt}, max_tokens)


def _finish(items: list[tuple[float, str, dict[str, Any], str]], n: int) -> list[ShapedRequest]:
    """(arrival, kind, body, group) in arrival order, the first n, with `first` flags set."""
    items.sort(key=lambda x: x[0])
    seen: set[str] = set()
    out = []
    for t, kind, body, group in items[:n]:
        out.append(ShapedRequest(t, kind, body, group, group not in seen))
        seen.add(group)
    return out


@functools.lru_cache(maxsize=4096)
def _ids(key: str, n: int, vocab: int = VOCAB) -> tuple[int, ...]:
    """`n` deterministic token ids in [16, vocab); the same key always gives the same ids."""
    raw = array("I")
    raw.frombytes(random.Random(key).randbytes(4 * n))
    return tuple(16 + x % (vocab - 16) for x in raw)


# --- the shapes: (n, rate, seed, model, **params) -> requests in arrival order -------------------
def system(
    n: int,
    rate: float,
    seed: int,
    model: str = MODEL,
    *,
    k: int = 24,
    system_tokens: tuple[int, int] = (1000, 6000),
    user_tokens: tuple[int, int] = (20, 120),
    max_tokens: int = 64,
    hot_weight: float = 1.0,
) -> list[ShapedRequest]:
    """K shared system messages of 1-6K tokens, then a short unique user question; with
    `hot_weight` > 1 system prompt 0 gets that many times the traffic of each other one
    (`simulator.workloads.shared_prompts` as bodies)."""
    chats = shared_prompts(n, k=k, rate=rate, prompt_tokens=system_tokens, user_tokens=user_tokens,
                           max_tokens=max_tokens, hot_weight=hot_weight, seed=seed)  # fmt: skip
    return _bodies(chats, model, n)


def _bodies(chats: Sequence[WorkItem], model: str, n: int) -> list[ShapedRequest]:
    items = [(w.arrival_s, "chat", _chat(model, list(w.messages), w.max_tokens), w.group)
             for w in chats]  # fmt: skip
    return _finish(items, n)


def _documents(
    n: int,
    rate: float,
    seed: int,
    model: str,
    parts: bool,
    docs: int,
    doc_tokens: tuple[int, int],
    zipf_s: float,
    question_tokens: tuple[int, int],
    max_tokens: int,
) -> list[ShapedRequest]:
    rng = random.Random(seed)
    lengths = [rng.randint(*doc_tokens) for _ in range(docs)]
    weights = [1.0 / (r + 1) ** zipf_s for r in range(docs)]
    items = []
    for i, t in enumerate(arrivals(rng, n, rate)):
        d = rng.choices(range(docs), weights)[0]
        doc = text(f"doc-{seed}-{d}", lengths[d])
        question = "Question:" + text(f"q-{seed}-{i}", rng.randint(*question_tokens))
        # the newline ends the document's line: the engine's pre-tokenizer (and the simulator's
        # tokenizer memo) see the same document piece in every request
        content: str | list[dict[str, str]] = (
            [{"type": "text", "text": doc}, {"type": "text", "text": question}]
            if parts
            else f"{doc}\n\n{question}"
        )
        messages = [{"role": "user", "content": content}]
        items.append((t, "chat", _chat(model, messages, max_tokens), f"doc{d}"))
    return _finish(items, n)


def doc_question(
    n: int,
    rate: float,
    seed: int,
    model: str = MODEL,
    *,
    docs: int = 200,
    doc_tokens: tuple[int, int] = (2000, 4000),
    zipf_s: float = 1.1,
    question_tokens: tuple[int, int] = (20, 80),
    max_tokens: int = 64,
    parts: bool = False,
) -> list[ShapedRequest]:
    """RAG in one user message: a shared document (Zipf(s) popular), a blank line, a question;
    with `parts`, the content as two text parts (engines join text parts with a newline)."""
    return _documents(
        n, rate, seed, model, parts, docs, doc_tokens, zipf_s, question_tokens, max_tokens
    )


def text_parts(n: int, rate: float, seed: int, model: str = MODEL, **params: Any
               ) -> list[ShapedRequest]:  # fmt: skip
    """doc_question with the user content as two text parts: the document, then the question."""
    return doc_question(n, rate, seed, model, parts=True, **params)


def multi_turn(
    n: int,
    rate: float,
    seed: int,
    model: str = MODEL,
    *,
    turns: int = 8,
    systems: int = 4,
    system_tokens: int = 500,
    user_tokens: tuple[int, int] = (50, 200),
    reply_tokens: int = 100,
    think_s: tuple[float, float] = (2.0, 10.0),
) -> list[ShapedRequest]:
    """Growing chats: each turn resends the system message and the whole history (assistant
    turns are fixed text, not what the engine generated) plus a new user turn. Turns of one
    conversation arrive `think_s` apart, conversations interleave; `rate` is requests/s in steady
    state (conversations start at rate / turns). `simulator.workloads.multi_turn` as bodies."""
    chats = multi_turn_chats(-(-n // turns), turns=turns, rate=rate / turns, systems=systems,
                             system_tokens=system_tokens, user_tokens=user_tokens,
                             reply_tokens=reply_tokens, think_s=think_s, seed=seed)  # fmt: skip
    return _bodies(chats, model, n)


_TOOLS = ("search", "read_file", "run_tests", "fetch_url")
_TOOL_DEFS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} (a benchmark tool)",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["query"],
            },
        },
    }
    for name in _TOOLS
]


def agent(
    n: int,
    rate: float,
    seed: int,
    model: str = MODEL,
    *,
    turns: int = 6,
    systems: int = 4,
    system_tokens: int = 800,
    task_tokens: tuple[int, int] = (50, 200),
    result_tokens: tuple[int, int] = (200, 800),
    parallel: float = 0.3,
    think_s: tuple[float, float] = (0.5, 3.0),
    max_tokens: int = 64,
) -> list[ShapedRequest]:
    """Agent transcripts: system + user task, then per turn an assistant message with
    `tool_calls` (two parallel calls with probability `parallel`) and one `tool` message per
    call with its result, resent whole each turn. A turn follows the last after the tools ran
    (`think_s`); `rate` is requests/s in steady state. Bodies carry `tools` definitions (which
    the simulator's template does not render)."""
    rng = random.Random(seed)
    items = []
    for c, start in enumerate(arrivals(rng, -(-n // turns), rate / turns)):
        history: list[dict[str, Any]] = [
            {"role": "system", "content": text(f"ag-sys-{seed}-{c % systems}", system_tokens)},
            {"role": "user", "content": text(f"ag-task-{seed}-{c}", rng.randint(*task_tokens))},
        ]
        t = start
        for turn in range(turns):
            body = _chat(model, list(history), max_tokens)
            body["tools"] = _TOOL_DEFS
            items.append((t, "chat", body, f"agent{c}"))
            calls = []
            for j in range(2 if rng.random() < parallel else 1):
                args = {"query": text(f"ag-arg-{seed}-{c}-{turn}-{j}", 6).strip(), "limit": 10}
                calls.append(
                    {
                        "id": f"call_{c}_{turn}_{j}",
                        "type": "function",
                        "function": {"name": rng.choice(_TOOLS), "arguments": json.dumps(args)},
                    }
                )
            thought = text(f"ag-a-{seed}-{c}-{turn}", 12) if rng.random() < 0.5 else None
            history.append({"role": "assistant", "content": thought, "tool_calls": calls})
            for call in calls:
                result = text(f"ag-r-{seed}-{c}-{turn}-{call['id']}", rng.randint(*result_tokens))
                history.append({"role": "tool", "tool_call_id": call["id"], "content": result})
            t += rng.uniform(*think_s)
    return _finish(items, n)


def completion_text(
    n: int,
    rate: float,
    seed: int,
    model: str = MODEL,
    *,
    k: int = 24,
    prefix_tokens: tuple[int, int] = (1000, 6000),
    suffix_tokens: tuple[int, int] = (20, 120),
    max_tokens: int = 64,
    ids: bool = False,
    vocab: int = VOCAB,
) -> list[ShapedRequest]:
    """/v1/completions with a string prompt: one of K shared prefixes, a newline, a unique
    suffix; with `ids`, a token-id prompt: one of K shared runs of ids in [16, `vocab`), then
    unique ids."""
    rng = random.Random(seed)
    lengths = [rng.randint(*prefix_tokens) for _ in range(k)]
    items = []
    for i, t in enumerate(arrivals(rng, n, rate)):
        g = rng.randrange(k)
        tail = rng.randint(*suffix_tokens)
        prompt: str | list[int]
        if ids:
            prompt = [*_ids(f"pid-{seed}-{g}", lengths[g], vocab),
                      *_ids(f"sid-{seed}-{i}", tail, vocab)]
        else:
            prompt = text(f"pre-{seed}-{g}", lengths[g]) + "\n" + text(f"suf-{seed}-{i}", tail)
        items.append((t, "completions", _completion(model, prompt, max_tokens),
                      f"{'ids' if ids else 'pre'}{g}"))  # fmt: skip
    return _finish(items, n)


def completion_ids(n: int, rate: float, seed: int, model: str = MODEL, **params: Any
                   ) -> list[ShapedRequest]:  # fmt: skip
    """/v1/completions with a token-id prompt (completion_text with `ids`)."""
    return completion_text(n, rate, seed, model, ids=True, **params)


def trace(
    n: int,
    rate: float,
    seed: int,
    model: str = MODEL,
    *,
    path: Path = TRACE,
    block_tokens: int = TRACE_BLOCK_TOKENS,
    max_output: int | None = None,
) -> list[ShapedRequest]:
    """The public Mooncake trace, one user message per record.

    Each hash id is one line of `block_tokens` simulator tokens (`block_tokens - 1` text pieces
    and its newline), equal ids equal lines; the last line is cut so the content is
    `input_length` tokens. Arrivals are rescaled to a mean of `rate`/s (0: as recorded), as
    `routing_workloads.trace` does; output lengths are capped at `max_output`. `seed` is unused.
    """
    items = []
    for t, rec, out_len in trace_arrivals(n, rate, path, max_output):
        ids = rec["hash_ids"]
        tail = max(1, rec["input_length"] - block_tokens * (len(ids) - 1))
        lines = [_trace_line(h, block_tokens) for h in ids]
        lines[-1] = lines[-1][: 4 * tail] if tail < block_tokens else lines[-1]
        messages = [{"role": "user", "content": "".join(lines)}]
        items.append((t, "chat", _chat(model, messages, out_len), f"h{ids[0]}"))
    return _finish(items, n)


def _trace_line(h: int, block_tokens: int) -> str:
    return text(f"trace-{h}", block_tokens - 1) + "\n"


Shape = Callable[..., list[ShapedRequest]]
SHAPES: dict[str, Shape] = {
    "system": system,
    "doc_question": doc_question,
    "text_parts": text_parts,
    "multi_turn": multi_turn,
    "agent": agent,
    "completion_text": completion_text,
    "completion_ids": completion_ids,
    "trace": trace,
}


# --- what the engine sees ------------------------------------------------------------------------
def to_sim_requests(
    shaped: Sequence[ShapedRequest], tokenizer: Tokenizer | None = None
) -> list[SimRequest]:
    """Each body's prompt as the engine renders and tokenizes it (chat: `encode_chat`, the
    template then the tokenizer; a completion string: `encode`; token ids as they are), for the
    DES; the same ids the simulator's HTTP endpoints cut.

    `meta` carries the request as the client sent it (`raw`, `body`, `kind`) and its `group` and
    `first`: a router parses `raw` with the gateway's parser and never reads the tokens.
    """
    # a throwaway tokenizer may memoise the whole trace's distinct text (22M tokens, ~300 MB)
    tok = tokenizer or ByteTokenizer(memo_tokens=1 << 25)
    out = []
    for i, r in enumerate(shaped):
        body = r.body
        if r.kind == "chat":
            ids: Sequence[int] = tok.encode_chat(body["messages"], True, body.get("tools"))
        elif isinstance(body["prompt"], str):
            ids = tok.encode(body["prompt"])
        elif isinstance(body["prompt"], list) and all(isinstance(t, int) for t in body["prompt"]):
            ids = body["prompt"]
        else:
            raise ValueError(f"request {i}: only a string or token-id prompt is supported")
        meta = {"kind": r.kind, "raw": r.raw, "body": body, "group": r.group, "first": r.first}
        out.append(SimRequest(f"q{i}", r.arrival_s, array("q", ids), body["max_tokens"], meta=meta))
    return out
