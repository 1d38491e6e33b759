"""The endpoint kinds the gateway proxies, one row each: the path, how the body is parsed and
checked, what of it is prefix-hashed, how its answer's tokens are counted, whether it streams.

Every kind runs the same pipeline (auth, limits, priority, admission, failover before the first
byte, metrics, traces, the request log); the row is all that differs. `PATHS` is the app's dispatch
table (a dict lookup per request), `passthrough_kind` makes the row of a path an operator exposes
with `passthrough:`.

| kind | hashed (prefix routing) | tokens counted |
|---|---|---|
| chat, completions | the rendered chat / the (first) prompt | usage: prompt + completion |
| responses | `instructions` + `input` rendered as chat messages (only `instructions` after a `previous_response_id`) | usage: input + output |
| embeddings, pooling, classify | the first `input` (or `messages` rendered) | usage.prompt_tokens, no output |
| score, rerank | `text_1` / `query` (the leading text of every pair) | usage, no output |
| tokenize, detokenize, audio, passthrough | nothing: routed by load, no index record | none |
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.api import bodies
from gateway.api.multipart import parse_audio
from gateway.api.openai import ParsedRequest, parse_body
from gateway.api.streams import ResponsesTap, StreamTap
from prefix_index.chunking import Chunker
from prefix_index.templates import responses_messages

Parse = Callable[[bytes, bytes | None], ParsedRequest]  # (body, content-type) -> request
HashSource = str | Sequence[int]
PromptOf = Callable[[ParsedRequest, Chunker], tuple[HashSource, int]]  # -> (hashed, est. tokens)
Counts = tuple[int | None, int | None, int | None]  # input, output, cached tokens

GENERATIVE_FIELDS = frozenset({"cache_salt", "priority"})
POOLING_FIELDS = frozenset({"priority"})


@dataclass(frozen=True, slots=True)
class EndpointKind:
    name: str
    path: bytes  # the upstream path: the client's
    parse: Parse
    prompt: PromptOf
    usage: Callable[[dict[str, Any]], Any]  # a whole JSON answer -> its usage object
    counts: Callable[[dict[str, Any]], Counts]  # a usage object -> the counts
    fields: frozenset[str] = frozenset()  # what the gateway may set in the body (engine fields)
    tap: type[StreamTap] = StreamTap  # a streamed answer's watcher
    method: bytes = b"POST"
    json_answer: bool = True  # a 200 must be a JSON object (else the replica is broken: retry)
    client_content_type: bool = False  # forward the client's content-type (not application/json)
    sticky: bool = False  # answers' ids are remembered (previous_response_id)
    generates: bool = False  # it writes an answer of up to max_tokens (what token limits charge)


# --- prompts ------------------------------------------------------------------------------------
def _text_prompt(p: Any, chunker: Chunker) -> tuple[HashSource, int]:
    if isinstance(p, str):
        return p, chunker.estimate_tokens(p)
    if isinstance(p, list) and p and isinstance(p[0], str | list):  # a batch: its first
        total = sum(chunker.estimate_tokens(x) if isinstance(x, str) else len(x) for x in p)
        return _text_prompt(p[0], chunker)[0], total
    if isinstance(p, list):
        return p, len(p)
    return "", 0


def _chat(messages: Any, chunker: Chunker, tools: Any = None) -> tuple[HashSource, int]:
    text = chunker.chat_prompt(messages, tools if isinstance(tools, list) else None)
    return text, chunker.estimate_tokens(text) if isinstance(text, str) else len(text)


def chat_prompt(req: ParsedRequest, chunker: Chunker) -> tuple[HashSource, int]:
    """The chat as the engine renders it: its messages and the tool definitions it sent."""
    return _chat(req.messages, chunker, req.body.get("tools"))


def completion_prompt(req: ParsedRequest, chunker: Chunker) -> tuple[HashSource, int]:
    """The prompt, or a batch's first (what is hashed); the estimate counts every prompt of a
    batch: each is prefilled, and each is charged to the tenant's token limits."""
    return _text_prompt(req.prompt, chunker)


def input_prompt(req: ParsedRequest, chunker: Chunker) -> tuple[HashSource, int]:
    body = req.body
    if "input" not in body and "messages" in body:
        return _chat(body["messages"], chunker)
    return _text_prompt(body.get("input"), chunker)


def responses_prompt(req: ParsedRequest, chunker: Chunker) -> tuple[HashSource, int]:
    body = req.body
    items = [] if body.get("previous_response_id") else body.get("input")
    messages = responses_messages(body.get("instructions"), items)
    return _chat(messages, chunker) if messages else ("", 0)


def rerank_prompt(req: ParsedRequest, chunker: Chunker) -> tuple[HashSource, int]:
    query, docs = req.body.get("query"), req.body.get("documents")
    if not isinstance(query, str):
        return "", 0
    q = chunker.estimate_tokens(query)
    texts = [d for d in docs if isinstance(d, str)] if isinstance(docs, list) else []
    return query, q * max(1, len(texts)) + sum(chunker.estimate_tokens(d) for d in texts)


def score_prompt(req: ParsedRequest, chunker: Chunker) -> tuple[HashSource, int]:
    first, est1 = _text_prompt(req.body.get("text_1"), chunker)
    return first, est1 + _text_prompt(req.body.get("text_2"), chunker)[1]


def no_prompt(req: ParsedRequest, chunker: Chunker) -> tuple[HashSource, int]:
    return "", 0


# --- usage --------------------------------------------------------------------------------------
def _count(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _cached(details: Any) -> int | None:
    return _count(details.get("cached_tokens")) if isinstance(details, dict) else None


def usage_field(answer: dict[str, Any]) -> Any:
    return answer.get("usage")


def no_usage(answer: dict[str, Any]) -> Any:
    return {"completion_tokens": 0}  # tokenize, detokenize: no engine work counted


def generation_counts(u: dict[str, Any]) -> Counts:
    """Chat and completions (`prompt_tokens`, ...), or the Responses API's names (`input_tokens`)."""
    if "input_tokens" in u or "output_tokens" in u:
        return _count(u.get("input_tokens")), _count(u.get("output_tokens")), _cached(
            u.get("input_tokens_details")
        )
    return (
        _count(u.get("prompt_tokens")),
        _count(u.get("completion_tokens")),
        _cached(u.get("prompt_tokens_details")),
    )


def pooling_counts(u: dict[str, Any]) -> Counts:
    """Pooling answers generate nothing: the input is all (rerank reports only `total_tokens`)."""
    prompt = _count(u.get("prompt_tokens"))
    return (prompt if prompt is not None else _count(u.get("total_tokens")), 0,
            _cached(u.get("prompt_tokens_details")))  # fmt: skip


# --- the table ----------------------------------------------------------------------------------
def _json(name: str, check: bodies.Check) -> Parse:
    return lambda raw, ctype: bodies.parse_json(name, raw, check)


def _pooling(name: str, path: str, check: bodies.Check, prompt: PromptOf) -> EndpointKind:
    return EndpointKind(name, path.encode(), _json(name, check), prompt, usage_field,
                        pooling_counts, POOLING_FIELDS)  # fmt: skip


def _tokenizer(name: str, path: str, check: bodies.Check) -> EndpointKind:
    return EndpointKind(name, path.encode(), _json(name, check), no_prompt, no_usage, pooling_counts)


def _audio(name: str, path: str) -> EndpointKind:
    return EndpointKind(
        name, path.encode(), lambda raw, ctype: parse_audio(name, raw, ctype), no_prompt,
        usage_field, generation_counts, json_answer=False, client_content_type=True,
    )  # fmt: skip


def _rows() -> list[tuple[str, EndpointKind]]:
    chat = EndpointKind("chat", b"/v1/chat/completions", lambda raw, c: parse_body("chat", raw),
                        chat_prompt, usage_field, generation_counts, GENERATIVE_FIELDS,
                        generates=True)  # fmt: skip
    completions = EndpointKind(
        "completions", b"/v1/completions", lambda raw, c: parse_body("completions", raw),
        completion_prompt, usage_field, generation_counts, GENERATIVE_FIELDS, generates=True,
    )  # fmt: skip
    responses = EndpointKind(
        "responses", b"/v1/responses", lambda raw, c: bodies.parse_responses(raw),
        responses_prompt, usage_field, generation_counts, GENERATIVE_FIELDS, tap=ResponsesTap,
        sticky=True, generates=True,
    )  # fmt: skip
    rows = [chat, completions, responses,
            _pooling("embeddings", "/v1/embeddings", bodies.check_embeddings, input_prompt),
            _pooling("pooling", "/pooling", bodies.check_input_or_messages, input_prompt),
            _pooling("classify", "/classify", bodies.check_input_or_messages, input_prompt),
            _tokenizer("tokenize", "/tokenize", bodies.check_tokenize),
            _tokenizer("detokenize", "/detokenize", bodies.check_detokenize),
            _audio("transcriptions", "/v1/audio/transcriptions"),
            _audio("translations", "/v1/audio/translations")]  # fmt: skip
    out = [(k.path.decode(), k) for k in rows]
    for path in ("/v1/score", "/score"):
        out.append((path, _pooling("score", path, bodies.check_score, score_prompt)))
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        out.append((path, _pooling("rerank", path, bodies.check_rerank, rerank_prompt)))
    return out


PATHS: dict[str, EndpointKind] = dict(_rows())  # client path -> kind (POST)
KINDS: dict[str, EndpointKind] = {k.name: k for k in PATHS.values()}  # name -> a row of it


# --- passthrough ----------------------------------------------------------------------------------
def parse_passthrough(raw: bytes, content_type: bytes | None) -> ParsedRequest:
    """Any body; a JSON object's string `model` picks the pool (else the default pool)."""
    body: dict[str, Any] = {}
    if raw[:1] in (b"{", b" ", b"\n", b"\t", b"\r"):
        try:
            loaded = orjson.loads(raw)
        except orjson.JSONDecodeError:
            loaded = None
        if isinstance(loaded, dict):
            body = loaded
    model = body.get("model")
    return ParsedRequest("passthrough", raw, body, model if isinstance(model, str) else "",
                         include_usage=True)  # fmt: skip


def passthrough_kind(method: bytes, path: str) -> EndpointKind:
    """The row of an engine path an operator exposes (`passthrough:`), for GET or POST: the
    answer is relayed whole, whatever its type; nothing is hashed or counted."""
    return EndpointKind("passthrough", path.encode(), parse_passthrough, no_prompt, no_usage,
                        pooling_counts, method=method, json_answer=False,
                        client_content_type=True)  # fmt: skip


KINDS["passthrough"] = passthrough_kind(b"POST", "/")
