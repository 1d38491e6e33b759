"""The simulator's pooling, tokenizer, Responses and audio endpoints, on a running replica: vLLM's
shapes, deterministic values, the engine's prefix cache under `/v1/responses`."""

from __future__ import annotations

import base64
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import orjson
import pytest

from simulator import Fleet
from simulator.responses import input_messages
from tests.simulator.tiny_tokenizer import train_tokenizer

MODEL = "qwen2.5-14b"


@pytest.fixture
async def url() -> AsyncIterator[str]:
    async with Fleet(n=1, model=MODEL, speedup=2000.0) as fleet:
        yield fleet.urls[0]


async def post(url: str, path: str, body: object) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10.0) as h:
        return await h.post(url + path, json=body)


async def test_embeddings_are_unit_vectors_fixed_by_the_input(url: str) -> None:
    body = {"model": MODEL, "input": ["same text", "other text", "same text"], "dimensions": 16}
    j = (await post(url, "/v1/embeddings", body)).json()
    vecs = [d["embedding"] for d in j["data"]]
    assert [len(v) for v in vecs] == [16, 16, 16] and vecs[0] == vecs[2] != vecs[1]
    assert abs(sum(x * x for x in vecs[0]) - 1) < 1e-9
    assert j["object"] == "list" and j["id"].startswith("embd-") and j["usage"]["prompt_tokens"] > 0
    b64 = (await post(url, "/v1/embeddings", {**body, "encoding_format": "base64"})).json()
    raw = base64.b64decode(b64["data"][0]["embedding"])
    assert struct.unpack("<16f", raw) == pytest.approx(vecs[0], abs=1e-6)
    res = await post(url, "/v1/embeddings", {"model": "other", "input": "x"})
    assert res.status_code == 404 and res.json()["error"]["param"] == "model"


async def test_scores_and_rerank_favour_the_document_holding_the_query(url: str) -> None:
    j = (await post(url, "/score", {"text_1": "red fox", "text_2": ["a red fox", "blue"]})).json()
    assert [d["object"] for d in j["data"]] == ["score", "score"]
    assert j["data"][0]["score"] == 1.0 > j["data"][1]["score"]
    j = (await post(url, "/v2/rerank", {"query": "red fox", "documents": ["blue", "red fox"],
                                        "top_n": 1})).json()
    assert [r["index"] for r in j["results"]] == [1] and j["results"][0]["document"]["text"]
    assert set(j) == {"id", "model", "usage", "results"} and j["usage"]["total_tokens"] > 0
    j = (await post(url, "/classify", {"input": "hello"})).json()
    assert j["data"][0]["label"] in ("negative", "positive") and sum(j["data"][0]["probs"]) == 1


async def test_tokenize_and_detokenize_round_trip_with_a_tokenizer_json(tmp_path: Path) -> None:
    tok = train_tokenizer(tmp_path / "tok.json")
    async with Fleet(n=1, model=MODEL, speedup=2000.0, tokenizer=tok) as fleet:
        t = (await post(fleet.urls[0], "/tokenize", {"prompt": "The quick brown fox"})).json()
        assert set(t) == {"count", "max_model_len", "tokens", "token_strs"}
        assert t["count"] == len(t["tokens"]) > 0
        d = (await post(fleet.urls[0], "/detokenize", {"tokens": t["tokens"]})).json()
        assert d == {"prompt": "The quick brown fox"}


async def test_responses_reuse_the_engines_prefix_cache_and_chain(url: str) -> None:
    body = {"model": MODEL, "instructions": "You are terse. " * 40, "input": "Say hi.",
            "max_output_tokens": 4}
    first = (await post(url, "/v1/responses", body)).json()
    assert first["status"] == "incomplete" and first["output"][0]["content"][0]["type"] == "output_text"
    again = (await post(url, "/v1/responses", {**body, "input": "Say bye."})).json()
    assert again["usage"]["input_tokens_details"]["cached_tokens"] >= 160  # the instructions' blocks
    follow = await post(url, "/v1/responses", {**body, "previous_response_id": first["id"]})
    assert follow.status_code == 200
    # the stored conversation sits between the instructions and the new input: a longer prompt
    assert follow.json()["usage"]["input_tokens"] > first["usage"]["input_tokens"]
    gone = await post(url, "/v1/responses", {**body, "previous_response_id": "resp_nope"})
    assert gone.status_code == 404 and "resp_nope" in gone.json()["error"]["message"]


async def test_a_stored_response_is_retrieved_cancelled_and_deleted_by_id(url: str) -> None:
    first = (await post(url, "/v1/responses", {"input": "Hi", "max_output_tokens": 3})).json()
    rid = first["id"]
    async with httpx.AsyncClient(timeout=10.0) as h:
        got = await h.get(f"{url}/v1/responses/{rid}")
        assert got.status_code == 200 and got.json() == first  # vLLM's retrieve: the Response
        cancel = await h.post(f"{url}/v1/responses/{rid}/cancel")
        assert cancel.status_code == 400  # vLLM: a finished synchronous response
        assert cancel.json()["error"]["message"] == "Cannot cancel a synchronous response."
        gone = await h.delete(f"{url}/v1/responses/{rid}")
        assert gone.json() == {"id": rid, "object": "response.deleted", "deleted": True}
        for res in (await h.get(f"{url}/v1/responses/{rid}"),
                    await h.post(f"{url}/v1/responses/{rid}/cancel"),
                    await h.delete(f"{url}/v1/responses/{rid}")):
            assert res.status_code == 404
            assert res.json()["error"] == {"message": f"Response with id '{rid}' not found.",
                                           "type": "invalid_request_error", "param": None,
                                           "code": 404}


async def test_a_streamed_response_sends_vllms_events_and_no_done(url: str) -> None:
    res = await post(url, "/v1/responses", {"input": "Hi", "stream": True, "max_output_tokens": 3})
    assert res.headers["content-type"].startswith("text/event-stream")
    events = [e for e in res.text.split("\n\n") if e]
    kinds = [e.split("\n")[0].removeprefix("event: ") for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * 3,
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.incomplete"]
    data = [orjson.loads(e.split("\ndata: ", 1)[1]) for e in events]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert data[0]["response"]["id"] == data[-1]["response"]["id"]
    assert data[-1]["response"]["usage"]["output_tokens"] == 3


def test_responses_items_become_chat_messages_as_vllm_builds_them() -> None:
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
    ]
    assert input_messages(items) == [
        {"role": "user", "content": [{"type": "text", "text": "q"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "assistant", "content": "a"},
    ]  # fmt: skip


async def test_a_transcription_reads_the_uploaded_form(url: str) -> None:
    form = {"model": (None, MODEL), "response_format": (None, "json")}
    async with httpx.AsyncClient(timeout=10.0) as h:
        res = await h.post(url + "/v1/audio/transcriptions",
                           files={**form, "file": ("a.wav", b"RIFF" + bytes(63996))})
        j = res.json()
        assert res.status_code == 200 and j["text"] and j["usage"] == {"type": "duration",
                                                                        "seconds": 2}
        res = await h.post(url + "/v1/audio/translations", files=form)
        assert res.status_code == 400 and res.json()["error"]["param"] == "file"
