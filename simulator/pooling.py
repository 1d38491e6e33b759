"""vLLM's pooling and tokenizer endpoints, simulated: `/v1/embeddings`, `/pooling`, `/classify`,
`/score` (`/v1/score`), `/rerank` (`/v1/rerank`, `/v2/rerank`), `/detokenize`.

Deterministic, not semantic: an embedding is a unit vector drawn from a generator seeded by the
xxhash of the input's token ids (`dimensions` honoured, `encoding_format: base64` as little-endian
float32, which the `openai` SDK asks for by default); a score is the share of the first text's
distinct words that the second holds, so a document containing the query ranks first; a
classification's two probabilities come from the same hash. The shapes are vLLM's
(EmbeddingResponse, PoolingResponse, ClassificationResponse, ScoreResponse, RerankResponse,
DetokenizeResponse). Pure functions of a parsed body; the routes are in `simulator/app.py`.
"""

from __future__ import annotations

import base64
import math
import random
import struct
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

from simulator.openai_api import MAX_TOKEN_ID, bad
from simulator.tokenizer import Tokenizer

DEFAULT_DIMENSIONS = 256
MAX_DIMENSIONS = 8192
LABELS = ("negative", "positive")


def _ids(v: Any, tok: Tokenizer, param: str) -> list[int]:
    if isinstance(v, str):
        return tok.encode(v)
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        if any(t < 0 or t > MAX_TOKEN_ID for t in v):
            raise bad(f"token ids must be in [0, {MAX_TOKEN_ID}]", param)
        return list(v)
    raise bad(f"{param} must be a string or a list of token ids", param)


def inputs(body: Mapping[str, Any], tok: Tokenizer) -> list[list[int]]:
    """The token ids of each input: `input` (str, list[str], list[int], list[list[int]]) or a
    chat's `messages` (rendered as the chat endpoint renders them)."""
    if "input" not in body and isinstance(body.get("messages"), list):
        try:
            return [tok.encode_chat(body["messages"], False)]
        except (ValueError, AttributeError) as exc:
            raise bad(f"messages: {exc}", "messages") from None
    v = body.get("input")
    if isinstance(v, list) and v and all(isinstance(x, str | list) for x in v):
        out = [_ids(x, tok, "input") for x in v]
    else:
        out = [_ids(v, tok, "input")]
    if any(not ids for ids in out):
        raise bad("the input is empty", "input")
    return out


def vector(ids: Sequence[int], dims: int) -> list[float]:
    """A unit vector of `dims` floats, a function of the token ids alone."""
    seed = xxhash.xxh3_64_intdigest(struct.pack(f"<{len(ids)}q", *ids))
    rng = random.Random(seed)
    v = [rng.gauss(0.0, 1.0) for _ in range(dims)]
    norm = math.sqrt(sum(x * x for x in v)) or 1.0
    return [x / norm for x in v]


def usage(prompt_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
            "completion_tokens": 0, "prompt_tokens_details": None}


def _envelope(prefix: str, model: str, data: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": model, "data": data, "usage": usage(tokens)}


def embeddings(body: Mapping[str, Any], tok: Tokenizer, model: str) -> dict[str, Any]:
    dims = body.get("dimensions")
    if dims is None:
        dims = DEFAULT_DIMENSIONS
    if isinstance(dims, bool) or not isinstance(dims, int) or not 1 <= dims <= MAX_DIMENSIONS:
        raise bad(f"dimensions must be an integer in [1, {MAX_DIMENSIONS}]", "dimensions")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise bad("encoding_format must be float or base64", "encoding_format")
    all_ids = inputs(body, tok)
    data = []
    for i, ids in enumerate(all_ids):
        v = vector(ids, dims)
        emb: Any = base64.b64encode(struct.pack(f"<{dims}f", *v)).decode() if fmt == "base64" else v
        data.append({"index": i, "object": "embedding", "embedding": emb})
    return _envelope("embd", model, data, sum(map(len, all_ids)))


def pooling(body: Mapping[str, Any], tok: Tokenizer, model: str) -> dict[str, Any]:
    all_ids = inputs(body, tok)
    data = [{"index": i, "object": "pooling", "data": vector(ids, DEFAULT_DIMENSIONS)}
            for i, ids in enumerate(all_ids)]
    return _envelope("pool", model, data, sum(map(len, all_ids)))


def classify(body: Mapping[str, Any], tok: Tokenizer, model: str) -> dict[str, Any]:
    all_ids = inputs(body, tok)
    data = []
    for i, ids in enumerate(all_ids):
        p = (xxhash.xxh3_64_intdigest(struct.pack(f"<{len(ids)}q", *ids)) % 1000) / 1000
        probs = [round(1 - p, 3), round(p, 3)]
        data.append({"index": i, "label": LABELS[probs[1] > probs[0]], "probs": probs,
                     "num_classes": len(LABELS)})
    return _envelope("classify", model, data, sum(map(len, all_ids)))


def relevance(query: str, doc: str) -> float:
    """The share of the query's distinct words found in the document, in [0, 1]."""
    q = set(query.lower().split())
    return round(len(q & set(doc.lower().split())) / len(q), 6) if q else 0.0


def _texts(v: Any, param: str) -> list[str]:
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and v and all(isinstance(s, str) for s in v):
        return list(v)
    raise bad(f"{param} must be a string or a non-empty list of strings", param)


def score(body: Mapping[str, Any], tok: Tokenizer, model: str) -> dict[str, Any]:
    """vLLM's pairing: one text_1 against each text_2, or text_1[i] against text_2[i]."""
    t1, t2 = _texts(body.get("text_1"), "text_1"), _texts(body.get("text_2"), "text_2")
    if len(t1) == 1:
        t1 = t1 * len(t2)
    if len(t1) != len(t2):
        raise bad("text_1 and text_2 must have the same length (or text_1 one text)", "text_2")
    pairs = list(zip(t1, t2, strict=True))
    data = [{"index": i, "object": "score", "score": relevance(a, b)}
            for i, (a, b) in enumerate(pairs)]
    tokens = sum(len(tok.encode(a)) + len(tok.encode(b)) for a, b in pairs)
    return _envelope("score", model, data, tokens)


def rerank(body: Mapping[str, Any], tok: Tokenizer, model: str) -> dict[str, Any]:
    query = body.get("query")
    if not isinstance(query, str):
        raise bad("query must be a string", "query")
    docs = _texts(body.get("documents"), "documents")
    top_n = body.get("top_n") or len(docs)
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0:
        raise bad("top_n must be an integer >= 0", "top_n")
    q = len(tok.encode(query))
    scored = [(relevance(query, d), i, q + len(tok.encode(d))) for i, d in enumerate(docs)]
    results = [{"index": i, "document": {"text": docs[i], "multi_modal": None},
                "relevance_score": s} for s, i, _ in sorted(scored, key=lambda x: (-x[0], x[1]))]
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model,
            "usage": {"total_tokens": sum(n for _, _, n in scored)}, "results": results[:top_n]}


def detokenize(body: Mapping[str, Any], tok: Tokenizer) -> dict[str, Any]:
    """The text of `tokens`: the tokenizer's decoding when it has one (a tokenizer.json), else
    each id's filler word (the stand-in tokenizer cannot be inverted)."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID
            for t in tokens):
        raise bad("tokens must be a list of token ids", "tokens")
    decoder = getattr(getattr(tok, "_tok", None), "decode", None)
    if callable(decoder):
        return {"prompt": decoder(tokens)}
    return {"prompt": "".join(tok.decode_filler(t) or f"<{t}>" for t in tokens)}

